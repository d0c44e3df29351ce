"""Throughput every training batch (an iteration of the online algorithms, a step of the offline stages): tokens per
second of generation and of the update, prompt and response tokens apart, the FLOPs achieved and their share of the
device's peak (MFU), and each marked phase's share of the batch's time.

Rollouts vary in length, so the rates are counted from what each batch actually processed (an online module's
``tokens_processed``: its iteration's rollout and update; an offline stage's batch itself), not from a fixed batch
size (which Lightning's ``ThroughputMonitor`` assumes). The FLOPs are the base's and the adapters'
(:mod:`rlhf_lightning.models.flop_counter`: every pass of the training, counted as it runs; generation from the
rollout's lengths: :mod:`rlhf_lightning.utils.flops`); the phases are the loops' own markers
(:mod:`rlhf_lightning.utils.timing`). Nothing it does changes what the fit computes or logs otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.models.flop_counter import FlopCounter
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.flops import TokenCounts, peak_flops_per_second
from rlhf_lightning.utils.timing import record_phases

GENERATE = "rollout/generate"
SAMPLED_ROLE = "policy"  # the adapter generation runs through


def batch_tokens(batch: Any) -> TokenCounts:
    """What an offline stage's training batch holds for the update: its response tokens (a ``response_mask``, or
    the ``labels`` SFT trains on) apart from the other attended tokens; nothing generated."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, Tensor):
        return TokenCounts()
    if isinstance(batch.get("response_mask"), Tensor):
        response = int(batch["response_mask"].sum())
    elif isinstance(batch.get("labels"), Tensor):
        response = int((batch["labels"] != IGNORE_INDEX).sum())
    else:
        response = 0
    return TokenCounts(int(mask.sum()) - response, response)


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype of the matmuls under a Trainer's ``precision`` (``bf16-mixed``: bfloat16)."""
    if "bf16" in precision:
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


class Throughput(Callback):
    """Logs, under the module's metric prefix, after every training batch:

    - ``perf/generate/prompt_tokens_per_s``, ``perf/generate/response_tokens_per_s``: the rollout's prompt tokens
      and drawn tokens per second of generation (phase ``rollout/generate``; online algorithms only);
    - ``perf/update/prompt_tokens_per_s``, ``perf/update/response_tokens_per_s``: the tokens the update's passes went
      over (once per epoch) per second of the update (the ``update/*`` phases; an offline stage's whole step);
    - ``perf/flops``, ``perf/flops_per_s`` and ``perf/mfu``: the FLOPs of the batch, per second, and that over
      ``peak_flops``;
    - ``perf/share/<phase>``: each marked phase's share of the batch's seconds, ``perf/share/other`` the rest.

    Args:
        peak_flops: the device's peak FLOP/s that ``perf/mfu`` divides by; null = Lightning's table of GPUs at the
            trainer's precision, or, where there is none (a CPU), the matmul throughput measured when the fit
            starts (a quarter of a second).
        sync_phases: synchronise a GPU at every phase's start and end, so that each phase holds its own kernels (off:
            a phase that waits for the device absorbs the kernels queued before it).
        enabled: log the figures; false = nothing (no hooks).
    """

    def __init__(self, peak_flops: float | None = None, sync_phases: bool = False, enabled: bool = True) -> None:
        checks.positive("peak_flops", peak_flops, optional=True)
        self.peak_flops, self.sync_phases, self.enabled = peak_flops, sync_phases, enabled
        self.counter: FlopCounter | None = None
        self.device = torch.device("cpu")
        self._phases: dict[str, float] = {}
        self._recording = contextlib.ExitStack()
        self._started = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = getattr(pl_module, "model", None)
        first = next(c for c in trainer.callbacks if isinstance(c, Throughput))
        if not self.enabled or first is not self or not isinstance(model, SharedBase):
            return  # a second Throughput (the command line's beside a config's): the first one logs
        self.device = pl_module.device
        if self.peak_flops is None:
            self.peak_flops = peak_flops_per_second(self.device, precision_dtype(str(trainer.precision)))
        self.counter = FlopCounter(model)
        self.counter.attach()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.counter is None:
            return
        self._phases = {}
        self.counter.take()  # passes between training batches (validation) are not this batch's
        clock = self._now if self.sync_phases else time.perf_counter
        self._recording.enter_context(record_phases(self._add_phase, clock))
        self._started = self._now()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.counter is None:
            return
        elapsed = self._now() - self._started
        self._recording.close()
        # Evaluations run by other callbacks in this batch (lm-eval tasks) are no part of it.
        elapsed -= sum(getattr(c, "evaluation_seconds", 0.0) for c in trainer.callbacks if c is not self)
        reported = getattr(pl_module, "tokens_processed", None)  # the online loop's iteration
        counts = reported(batch) if callable(reported) else batch_tokens(batch)
        figures = self.figures(counts, max(elapsed, 1e-9))
        pl_module.log_dict({f"{pl_module.metric_prefix}/perf/{name}": value for name, value in figures.items()},
                           on_step=True, on_epoch=False, batch_size=1)

    def figures(self, counts: TokenCounts, seconds: float) -> dict[str, float]:
        """The batch's figures from what it processed and its seconds (evaluations left out)."""
        figures: dict[str, float] = {}
        generating = self._phases.get(GENERATE, 0.0)
        if counts.prompt_lengths and generating > 0:
            figures["generate/prompt_tokens_per_s"] = sum(counts.prompt_lengths) / generating
            figures["generate/response_tokens_per_s"] = sum(counts.response_lengths) / generating
        updating = (sum(value for name, value in self._phases.items() if name.startswith("update/"))
                    if counts.prompt_lengths else seconds)
        if updating > 0 and counts.update_prompt + counts.update_response > 0:
            figures["update/prompt_tokens_per_s"] = counts.update_prompt / updating
            figures["update/response_tokens_per_s"] = counts.update_response / updating
        shape = dataclasses.replace(self.counter.shape, lora_parameters=self.counter.adapters.get(SAMPLED_ROLE, 0))
        flops = self.counter.take() + counts.generation_flops(shape)
        figures["flops"] = flops
        figures["flops_per_s"] = flops / seconds
        figures["mfu"] = figures["flops_per_s"] / self.peak_flops
        shares = {name: value / seconds for name, value in self._phases.items()}
        figures.update({f"share/{name}": share for name, share in shares.items()})
        figures["share/other"] = max(0.0, 1.0 - sum(shares.values()))
        return figures

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        self._recording.close()
        if self.counter is not None:
            self.counter.detach()
            self.counter = None

    def _add_phase(self, name: str, seconds: float) -> None:
        self._phases[name] = self._phases.get(name, 0.0) + seconds

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
