"""The FLOPs a shared base runs, counted as its passes go: a hook before every decoder pass reads how many real
tokens it takes and how many positions they attend to, a hook after the LM head (and the fused log-prob head's own
mark) how many positions get logits; :mod:`rlhf_lightning.utils.flops` turns them into FLOPs.

A pass run with gradients on counts its backward too: one forward more with the base frozen (the activations'
gradients; the adapters' weight gradients are small), two when the base trains. Recomputation (gradient
checkpointing) is not counted: these are the model's FLOPs, as MFU counts them. Passes in an
:func:`~rlhf_lightning.utils.flops.uncounted` block (the engines' sampling, lm-eval during a fit) are left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from rlhf_lightning.models.merging import adapter_of
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.utils.flops import ModelShape, counting_paused, recording_heads


def matmul_parameters(layers: list[nn.Module]) -> int:
    """Weights of the matmuls in ``layers`` (linear layers and GPT-2's ``Conv1D``; adapters' own matrices not)."""
    total = 0
    for layer in layers:
        for name, module in layer.named_modules():
            if "lora_" in name:
                continue
            if isinstance(module, nn.Linear):
                total += module.in_features * module.out_features
            elif isinstance(module, Conv1D):
                total += module.nx * module.nf
    return total


def adapter_parameters(model: SharedBase) -> dict[str, int]:
    """Parameters of each adapter's LoRA matrices (their full shapes, also when sharded)."""
    counts: dict[str, int] = {}
    for name, parameter in model.model.named_parameters():
        adapter = adapter_of(name)
        if adapter is not None and ".lora_" in name:
            counts[adapter] = counts.get(adapter, 0) + parameter.shape.numel()
    return counts


def model_shape(model: SharedBase) -> ModelShape:
    """The shape the FLOP count reads of ``model`` (its adapters' parameters not included: see ``FlopCounter``)."""
    head = model.lm_head
    vocab = head.out_features if isinstance(head, nn.Linear) else model.hf_model.get_input_embeddings().num_embeddings
    layers = model.decoder_layers()
    return ModelShape(len(layers), model.hidden_size, vocab, matmul_parameters(layers))


class FlopCounter:
    """Counts the FLOPs of the passes a shared base runs between :meth:`attach` and :meth:`detach`; :meth:`take`
    returns those since the last call.

    Args:
        model: the shared base (its decoder, LM head and adapters are read once, here).
    """

    def __init__(self, model: SharedBase) -> None:
        self.model = model
        self.shape = model_shape(model)
        self.adapters = adapter_parameters(model)
        self._lora_layer = next((module for module in model.hf_model.modules() if hasattr(module, "lora_A")), None)
        self._handles: list[Any] = []
        self._heads = contextlib.ExitStack()
        self._pending: Tensor | float = 0.0

    def attach(self) -> None:
        """Start counting (the hooks are registered)."""
        if self._handles:
            return
        decoder = self.model.hf_model.get_decoder()
        self._handles = [decoder.register_forward_pre_hook(self._decoder_pass, with_kwargs=True),
                         self.model.lm_head.register_forward_hook(self._head_pass)]
        self._heads.enter_context(recording_heads(self._fused_head))

    def detach(self) -> None:
        """Stop counting (the hooks are removed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._heads.close()

    def take(self) -> float:
        """The FLOPs counted since the last call."""
        pending, self._pending = self._pending, 0.0
        return float(pending)

    def add(self, flops: float) -> None:
        """Add FLOPs counted elsewhere (generation, from the rollout's lengths)."""
        self._pending = self._pending + flops

    # ---- the hooks ----------------------------------------------------------------------------------------

    def _skipped(self) -> bool:
        return counting_paused() or torch.compiler.is_compiling()

    def _passes(self) -> int:
        """Forward-pass equivalents of a pass now: 1, plus its backward when gradients are on."""
        return 1 if not torch.is_grad_enabled() else 3 if self.model.train_base else 2

    def _adapter_weights(self) -> int:
        layer = self._lora_layer
        if layer is None or layer.disable_adapters:
            return 0
        return sum(self.adapters.get(name, 0) for name in layer.active_adapters if name in layer.lora_A)

    def _decoder_pass(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._skipped():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        rows, new = (ids if ids is not None else embeds).shape[:2]
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        device = (ids if ids is not None else embeds).device
        real = (mask[:, -new:] if isinstance(mask, Tensor) and mask.dim() == 2
                else torch.ones(rows, new, dtype=torch.long, device=device)).double()
        if positions is None:
            if isinstance(mask, Tensor) and mask.dim() == 2:
                positions = (mask.long().cumsum(-1) - 1)[:, -new:]
            else:
                positions = torch.arange(new, device=device).expand(rows, new)
        tokens, attended = real.sum(), ((positions.double() + 1) * real).sum()
        shape = dataclasses.replace(self.shape, lora_parameters=self._adapter_weights())
        self._pending = self._pending + shape.forward(tokens, attended) * self._passes()

    def _head_pass(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        if not self._skipped():
            self._pending = self._pending + self.shape.head(args[0].numel() / self.shape.width) * self._passes()

    def _fused_head(self, positions: int) -> None:
        if not torch.compiler.is_compiling():
            self._pending = self._pending + self.shape.head(positions) * self._passes()
