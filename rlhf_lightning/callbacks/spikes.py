"""A KL spike said at once: a warning when the KL to the reference, or the update's approximate KL to the
sampling policy, jumps far beyond its recent range in one iteration, and by enough to matter."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.run_shape import batches_done, run_name

WATCHED = ("objective/kl", "policy/approx_kl")  # after the module's metric prefix (docs/logging.md)
# The rise above the recent median a spike needs at least, per metric. On the quick start's healthy PPO and GRPO runs
# (replayed by python -m rlhf_lightning.callbacks.spike_replay) the rises that clear the MAD test are at most 3.8 nats
# of sequence KL (early, while the KL grows from 0) and 0.21 of approx_kl; its one real instability rose 22 and 0.46.
FLOORS = {"objective/kl": 5.0, "policy/approx_kl": 0.3}
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
    to the sampling policy (``<prefix>/policy/approx_kl``) jumps far beyond its recent range, and by enough to
    matter::

        [ppo] KL spike at iteration 15: ppo/objective/kl 24 against 2.1 ± 0.31 · ppo/policy/approx_kl 0.48
        against 0.021 ± 0.004 (median ± median absolute deviation of iterations 5-14): one update moved the
        policy far: ...

    A value is a spike when it exceeds the median of the last ``window`` training batches (iterations of the
    on-policy loop) by more than ``threshold`` times their median absolute deviation (MAD), and by at least its
    metric's floor in the metric's own units (``floors``): a KL near 0 that triples is noise, not an instability.
    The MAD counts as at least a quarter of the median's size, so that a series that barely varies is not flagged
    for a modest move. Only upward jumps count: a KL that falls is no alarm. Nothing is said before ``warmup``
    values are known, and a metric warned about is not warned about again for ``cooldown`` iterations (the first
    line stands for the episode). The end-of-fit summary lists the spikes said.

    Its history is kept in checkpoints, so a resumed fit goes on judging against the iterations before it. The
    command line adds it to every fit: ``--spikes.threshold 20``, ``--spikes.floors '{"policy/approx_kl": 0.1}'``.
    ``python -m rlhf_lightning.callbacks.spike_replay RUN_FOLDER`` replays it over a finished run's logged
    history, with other settings if asked: the way to choose them for a new task.

    Args:
        threshold: how many MADs above the recent median a value must be to count as a spike; 0 turns the
            check off.
        window: training batches (iterations) the median and the MAD are taken over.
        warmup: values a metric must have before the check judges its next one (the first iterations' KL, near
            0 and rising, have no range to leave yet).
        metrics: the names watched, after the module's metric prefix.
        floors: the rise above the recent median a spike needs at least, per metric (after the prefix), in the
            metric's units; merged into the defaults (``objective/kl``: 5 nats of sequence KL,
            ``policy/approx_kl``: 0.3), which stay quiet on the quick start's healthy runs; 0 = no floor.
        cooldown: iterations after a line about a metric during which it is not warned about again.
    """

    def __init__(self, threshold: float = 10.0, window: int = 20, warmup: int = 5,
                 metrics: Sequence[str] = WATCHED, floors: dict[str, float] | None = None,
                 cooldown: int = 20) -> None:
        if threshold < 0 or not math.isfinite(threshold) or window < 2 or not 2 <= warmup <= window:
            raise ValueError(f"SpikeCheck: threshold must be >= 0, window >= 2 and warmup in 2..window, got "
                             f"{threshold}, {window}, {warmup}")
        bad = {name: value for name, value in (floors or {}).items()
               if not isinstance(value, int | float) or not 0 <= value < math.inf}
        if bad:
            raise ValueError(f"SpikeCheck: floors must be finite numbers >= 0, got {bad}")
        if cooldown < 0:
            raise ValueError(f"SpikeCheck: cooldown must be >= 0 iterations, got {cooldown}")
        self.threshold = threshold
        self.window = window
        self.warmup = warmup
        self.metrics = list(metrics)
        self.floors = {**FLOORS, **(floors or {})}
        self.cooldown = cooldown
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
        prefix = getattr(pl_module, "metric_prefix", type(pl_module).__name__)
        values = {}
        for metric in self.metrics:
            value = trainer.callback_metrics.get(f"{prefix}/{metric}")
            if value is not None and value.numel() == 1:
                values[metric] = float(value)
        found = self.observe(prefix, batches_done(trainer), values)
        if found:
            name = "batch" if pl_module.automatic_optimization else "iteration"
            rank_zero_warn(self.message(run_name(pl_module), name, found))

    def observe(self, prefix: str, at: int, values: Mapping[str, float]) -> list[Spike]:
        """Judge training batch ``at``'s ``values`` of the watched metrics (named after ``prefix``): the spikes to
        say, which the check keeps. A metric still in its cooldown after a line is judged (its history grows) but
        not said."""
        found = []
        for metric in self.metrics:
            value = values.get(metric)
            if value is None or not math.isfinite(value):
                continue
            name = f"{prefix}/{metric}"
            spike = self.judge(name, at, value, self.floors.get(metric, 0.0))
            said = [earlier.at for earlier in self.spikes if earlier.name == name and earlier.at < at]
            if spike is not None and (not said or at - max(said) > self.cooldown):
                found.append(spike)
        self.spikes += found
        return found

    def judge(self, name: str, at: int, value: float, floor: float = 0.0) -> Spike | None:
        """Add ``value`` of ``name`` at training batch ``at`` to its history; the spike it is (beyond the recent
        range and at least ``floor`` above its median), or None."""
        points = [point for point in self.history.get(name, []) if point[0] < at]  # a batch logged twice: once
        spike = None
        if len(points) >= self.warmup:
            values = [value for _, value in points]
            median = statistics.median(values)
            mad = statistics.median(abs(value - median) for value in values)
            spread = max(mad, abs(median) / 4)
            if value > median + self.threshold * spread and spread > 0 and value - median >= floor:
                spike = Spike(name, at, value, median, mad, points[0][0])
        self.history[name] = [*points, (at, value)][-self.window:]
        return spike

    @staticmethod
    def message(run: str, unit: str, spikes: Sequence[Spike]) -> str:
        """The warning's line for the spikes of one training batch of run ``run`` (``ppo``), whose training batches
        are called ``unit`` (``iteration``)."""
        first, at = min(spike.since for spike in spikes), spikes[0].at
        return (f"[{run}] KL spike at {unit} {at}: " + " · ".join(spike.text() for spike in spikes)
                + f" (median ± median absolute deviation of {unit}s {first}-{at - 1}): {HINT}")
