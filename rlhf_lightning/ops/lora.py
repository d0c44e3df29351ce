"""A fused forward and backward for peft's LoRA linear layers in the case every role here uses.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the three matmuls, a scaling multiply
and an addition over the ``[tokens, out_features]`` output in the forward pass, and their mirrors plus the sum of
two ``[tokens, in_features]`` input gradients in the backward pass. On a 2-core CPU with GPT-2-sized layers those
element-wise passes are about a fifth of a LoRA forward + backward. Here the low-rank term is accumulated into the
base output by the matmul itself (``addmm_`` with ``alpha = scaling``), and the backward does the same for the
input gradient. The numbers are peft's to float rounding.

The fused path runs only for one active plain LoRA adapter (no dropout, no DoRA or other variant, no LoRA bias)
on a frozen ``nn.Linear`` or transformers ``Conv1D`` base, outside autocast, with one dtype throughout; anything
else (adapters disabled, merged, mixed-adapter batches) goes through peft's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D


class _LowRankLinear(torch.autograd.Function):
    """``x @ weight_io + bias + scaling * (x @ lora_a.T) @ lora_b.T`` with gradients for ``x``, ``lora_a`` and
    ``lora_b`` only (the base ``weight_io`` [in, out] and ``bias`` are frozen)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight_io: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float) -> Tensor:
        down = x @ lora_a.t()  # [N, r]
        out = x @ weight_io if bias is None else torch.addmm(bias, x, weight_io)
        out.addmm_(down, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, down, weight_io, lora_a, lora_b)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, down, weight_io, lora_a, lora_b = ctx.saved_tensors
        scaling = ctx.scaling
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[3]:
            grad_up = grad_out @ lora_b  # [N, r]
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight_io.t()
            grad_x.addmm_(grad_up, lora_a, alpha=scaling)
        if ctx.needs_input_grad[3]:
            grad_a = (grad_up.t() @ x).mul_(scaling)
        if ctx.needs_input_grad[4]:
            grad_b = (grad_out.t() @ down).mul_(scaling)
        return grad_x, None, None, grad_a, grad_b, None


class FusedLoraLinear(LoraLinear):
    """peft's ``lora.Linear`` whose forward fuses the low-rank update into the base matmul when it can.

    Instances are made by :func:`fuse_lora_layers` (a class swap: still a ``lora.Linear`` for peft).
    """

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        adapter = self._fusable_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        base = self.base_layer
        weight_io = base.weight if isinstance(base, Conv1D) else base.weight.t()
        out = _LowRankLinear.apply(x.reshape(-1, x.shape[-1]), weight_io, base.bias,
                                   self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.scaling[adapter])
        return out.view(*x.shape[:-1], out.shape[-1])

    def _fusable_adapter(self, x: Tensor, args: tuple, kwargs: dict) -> str | None:
        """The one plain adapter to fuse, or None when peft's own forward must run."""
        if args or kwargs or self.disable_adapters or self.merged or torch.is_autocast_enabled(x.device.type):
            return None
        active = [name for name in self.active_adapters if name in self.lora_A]
        if len(active) != 1:
            return None
        adapter = active[0]
        base = self.base_layer
        lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
        if (adapter in self.lora_variant or not isinstance(self.lora_dropout[adapter], nn.Identity)
                or not isinstance(base, (nn.Linear, Conv1D)) or lora_a.bias is not None or lora_b.bias is not None
                or any(p.requires_grad for p in base.parameters())):
            return None
        if not x.dtype == base.weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype:
            return None
        return adapter


def fuse_lora_layers(model: nn.Module) -> int:
    """Give every peft ``lora.Linear`` layer of ``model`` the fused forward; returns how many were changed."""
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            module.__class__ = FusedLoraLinear
            count += 1
    return count
