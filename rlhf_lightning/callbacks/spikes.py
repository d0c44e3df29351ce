"""A KL spike said at once: a warning when the KL to the reference, or the update's approximate KL to the
sampling policy, jumps far beyond its recent range in one iteration."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.run_shape import batches_done, run_name

WATCHED = ("objective/kl", "policy/approx_kl")  # after the module's metric prefix (docs/logging.md)
HINT = ("one update moved the policy far: lower optimizer.lr or the clip range, or set target_kl to stop an "
        "iteration's epochs early")


@dataclass(frozen=True)
class Spike:
    """Metric ``name`` at ``value`` in training batch ``at`` (iteration of the on-policy loop), against the
    ``median`` and ``mad`` (median absolute deviation) of training batches ``since``..``at - 1``."""

    name: str
    at: int
    value: float
    median: float
    mad: float
    since: int

    def text(self) -> str:
        """``ppo/objective/kl 24 against 2.1 ± 0.31``."""
        return f"{self.name} {self.value:.4g} against {self.median:.4g} ± {self.mad:.2g}"


class SpikeCheck(Callback):
    """Warns, in one line, when the KL to the reference (``<prefix>/objective/kl``) or the update's approximate KL
    to the sampling policy (``<prefix>/policy/approx_kl``) jumps far beyond its recent range::

        [ppo] KL spike at iteration 15: ppo/objective/kl 24 against 2.1 ± 0.31 · ppo/policy/approx_kl 0.48
        against 0.021 ± 0.004 (median ± median absolute deviation of iterations 5-14): one update moved the
        policy far: ...

    A value is a spike when it exceeds the median of the last ``window`` training batches (iterations of the
    on-policy loop) by more than ``threshold`` times their median absolute deviation (MAD). The MAD counts as at
    least a quarter of the median's size, so that a series that barely varies is not flagged for a modest move
    (with the default threshold a value must then be at least 3.5 times the median). Only upward jumps count: a KL that falls
    is no alarm. Nothing is said before ``warmup`` values are known. The end-of-fit summary lists the spikes.

    Its history is kept in checkpoints, so a resumed fit goes on judging against the iterations before it. The
    command line adds it to every fit: ``--spikes.threshold 20``, ``--spikes.window 10``.

    Args:
        threshold: how many MADs above the recent median a value must be to count as a spike; 0 turns the
            check off.
        window: training batches (iterations) the median and the MAD are taken over.
        warmup: values a metric must have before the check judges its next one (the first iterations' KL, near
            0 and rising, have no range to leave yet).
        metrics: the names watched, after the module's metric prefix.
    """

    def __init__(self, threshold: float = 10.0, window: int = 20, warmup: int = 5,
                 metrics: Sequence[str] = WATCHED) -> None:
        if threshold < 0 or not math.isfinite(threshold) or window < 2 or not 2 <= warmup <= window:
            raise ValueError(f"SpikeCheck: threshold must be >= 0, window >= 2 and warmup in 2..window, got "
                             f"{threshold}, {window}, {warmup}")
        self.threshold = threshold
        self.window = window
        self.warmup = warmup
        self.metrics = list(metrics)
        self.history: dict[str, list[tuple[int, float]]] = {}  # metric -> its last `window` (batch, value)
        self.spikes: list[Spike] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before a checkpoint's state is loaded: a fit starts clean, a resumed one then takes its checkpoint's.
        self.history, self.spikes = {}, []

    def state_dict(self) -> dict[str, Any]:
        """Kept in checkpoints: a resumed fit judges its first iterations against the ones before the kill."""
        return {"history": {name: [list(point) for point in points] for name, points in self.history.items()},
                "spikes": [vars(spike).copy() for spike in self.spikes]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {name: [(int(at), float(value)) for at, value in points]
                        for name, points in (state_dict.get("history") or {}).items()}
        self.spikes = [Spike(**spike) for spike in state_dict.get("spikes", [])]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.threshold:
            return
        done = batches_done(trainer)
        prefix = getattr(pl_module, "metric_prefix", type(pl_module).__name__)
        found = []
        for metric in self.metrics:
            name = f"{prefix}/{metric}"
            value = trainer.callback_metrics.get(name)
            if value is None or value.numel() != 1 or not math.isfinite(float(value)):
                continue
            spike = self.judge(name, done, float(value))
            if spike is not None:
                found.append(spike)
        if found:
            self.spikes += found
            rank_zero_warn(self.message(pl_module, found))

    def judge(self, name: str, at: int, value: float) -> Spike | None:
        """Add ``value`` of ``name`` at training batch ``at`` to its history; the spike it is, or None."""
        points = [point for point in self.history.get(name, []) if point[0] < at]  # a batch logged twice: once
        spike = None
        if len(points) >= self.warmup:
            values = [value for _, value in points]
            median = statistics.median(values)
            mad = statistics.median(abs(value - median) for value in values)
            spread = max(mad, abs(median) / 4)
            if value > median + self.threshold * spread and spread > 0:
                spike = Spike(name, at, value, median, mad, points[0][0])
        self.history[name] = [*points, (at, value)][-self.window:]
        return spike

    @staticmethod
    def message(pl_module: L.LightningModule, spikes: Sequence[Spike]) -> str:
        """The warning's line for the spikes of one training batch."""
        name = "batch" if pl_module.automatic_optimization else "iteration"
        first, at = min(spike.since for spike in spikes), spikes[0].at
        return (f"[{run_name(pl_module)}] KL spike at {name} {at}: " + " · ".join(spike.text() for spike in spikes)
                + f" (median ± median absolute deviation of {name}s {first}-{at - 1}): {HINT}")
