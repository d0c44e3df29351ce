"""Analytic FLOPs of a decoder-only transformer, and the peak they are measured against: what the throughput figures
(``perf/mfu``) and the benchmarks (``benchmarks/harness/flops.py``) count, written once.

A forward pass costs ``2 * N`` per token through the decoder (``N``: the weights of the decoder layers' matmuls,
embeddings and LM head excluded), plus attention ``4 * n_layer * d`` per token and per position it attends to (QK^T
and AV), plus the LM head ``2 * V * d`` per position whose logits are computed. A LoRA adapter adds ``2 * r * (in +
out)`` per adapted matrix and token. With the base frozen, a backward pass computes the activations' gradients and the
adapters' small weight gradients: about one forward (two when the base trains too). Generation encodes the prompt once,
then runs one token per step with a KV cache, each step attending to every position before it. Dense models: a
mixture of experts would be counted with every expert.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

MEASURED_SIZE, MEASURED_SECONDS = 1024, 0.25  # the matmul the peak is measured with on a machine without a table
_measured: dict[tuple[str, torch.dtype], float] = {}
_uncounted = [0]  # depth of the `uncounted` blocks entered
_head_recorders: list[Callable[[int], None]] = []


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count reads of a model: ``layers`` decoder layers of width ``width``, a ``vocab``-row LM head,
    ``matmul_parameters`` weights in the decoder layers' matmuls and ``lora_parameters`` in one adapter's matrices."""

    layers: int
    width: int
    vocab: int
    matmul_parameters: int
    lora_parameters: int = 0

    def forward(self, tokens: float, attended: float, adapter: bool = True) -> float:
        """FLOPs of ``tokens`` tokens through the decoder, which attend to ``attended`` positions in all (the sum over
        the tokens of the positions each sees, itself included), through the adapter or not."""
        weights = self.matmul_parameters + (self.lora_parameters if adapter else 0)
        return 2 * weights * tokens + 4 * self.layers * self.width * attended

    def head(self, positions: float) -> float:
        """FLOPs of the LM head at ``positions`` positions."""
        return 2 * self.vocab * self.width * positions

    def prefill(self, prompt: int, adapter: bool = True) -> float:
        """FLOPs of encoding a ``prompt``-token prompt before generating (causal: position ``i`` sees ``i + 1``)."""
        return self.forward(prompt, prompt * (prompt + 1) / 2, adapter)

    def decode(self, prompt: int, response: int, adapter: bool = True) -> float:
        """FLOPs of drawing ``response`` tokens after an encoded ``prompt``-token prompt: the LM head at each, and
        ``response - 1`` steps over a KV cache (the prompt's last position gave the first token)."""
        if response <= 0:
            return 0.0
        steps = response - 1
        return self.forward(steps, steps * (prompt + 1) + steps * (steps - 1) / 2, adapter) + self.head(response)

    def generation(self, prompt: int, response: int, rows: int = 1, adapter: bool = True) -> float:
        """FLOPs of generating ``response`` tokens after a ``prompt``-token prompt, ``rows`` times, each row encoding
        its prompt."""
        return rows * (self.prefill(prompt, adapter) + self.decode(prompt, response, adapter))


@dataclass(frozen=True)
class TokenCounts:
    """The tokens a training batch processed, for the throughput figures: each generated row's prompt and response
    lengths (``group`` consecutive rows share a prompt, which our decoders encode once), and the prompt and response
    tokens the update's passes went over (once per epoch; the offline stages' batch)."""

    update_prompt: int = 0
    update_response: int = 0
    prompt_lengths: tuple[int, ...] = ()
    response_lengths: tuple[int, ...] = ()
    group: int = 1

    def generation_flops(self, shape: ModelShape) -> float:
        """The analytic FLOPs of the generation (:meth:`ModelShape.prefill` once per prompt, then each row's
        :meth:`ModelShape.decode`)."""
        pairs = list(zip(self.prompt_lengths, self.response_lengths, strict=True))
        return (sum(shape.prefill(prompt) for prompt, _ in pairs[::max(self.group, 1)])
                + sum(shape.decode(prompt, response) for prompt, response in pairs))


def matmul_flops_per_second(device: str | torch.device, dtype: torch.dtype = torch.float32, size: int = 2048,
                            seconds: float = 2.0) -> float:
    """Measured throughput of a large square matmul: what this machine's matmul units give at best. The random
    matrices come from a generator of their own: the caller's random streams are left as they were."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for _ in range(2):
        a @ b
    count, start = 0, now()
    while now() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (now() - start)


def peak_flops_per_second(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """The peak that MFU is taken against: Lightning's table of GPUs (``get_available_flops``) for ``dtype``, else the
    matmul throughput measured here once per process and device (a quarter of a second: a CPU has no table)."""
    from lightning.fabric.utilities.throughput import get_available_flops

    if device.type == "cuda":
        listed = get_available_flops(device, dtype)
        if listed:
            return float(listed)
    key = (str(device), dtype)
    if key not in _measured:
        _measured[key] = matmul_flops_per_second(device, dtype, MEASURED_SIZE, MEASURED_SECONDS)
    return _measured[key]


# ---- what module hooks cannot see ---------------------------------------------------------------------------------


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Forward passes in the block are left out of a hook-based count: generation (the engines' sampling mode), whose
    FLOPs are counted from the rollout's lengths instead, and evaluations of the policy beside the training."""
    _uncounted[0] += 1
    try:
        yield
    finally:
        _uncounted[0] -= 1


def counting_paused() -> bool:
    """Whether an :func:`uncounted` block is running."""
    return _uncounted[0] > 0


def count_head(positions: int) -> None:
    """Mark LM-head work at ``positions`` positions that no module hook sees: the fused log-prob head reads the
    head's weight without calling the module (:mod:`rlhf_lightning.ops.lm_head`)."""
    if not counting_paused():
        for recorder in _head_recorders:
            recorder(positions)


@contextlib.contextmanager
def recording_heads(recorder: Callable[[int], None]) -> Iterator[None]:
    """Send every :func:`count_head` to ``recorder`` inside the block."""
    _head_recorders.append(recorder)
    try:
        yield
    finally:
        _head_recorders.remove(recorder)
