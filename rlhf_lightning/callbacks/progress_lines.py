"""Progress as plain lines, for output that is not a terminal (``nohup``, a scheduler's log, CI).

A progress bar redraws one line with carriage returns: in a log file it shows nothing until the end. The CLI
uses :class:`ProgressLines` instead when standard output is not a terminal.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlhf_lightning.callbacks.run_shape import batches_done, run_name, step_bounded, training_batches

HIDDEN = ("v_num", "iteration")  # the line says these itself


def duration(seconds: float) -> str:
    """``2h03m``, ``3m05s`` or ``12s``."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def metric_text(metrics: Mapping[str, Any]) -> str:
    """``reward 1.23 · kl 4.51``: each value with 4 significant digits."""
    parts = []
    for name, value in metrics.items():
        value = float(value)
        parts.append(f"{name} {value:.4g}" if math.isfinite(value) else f"{name} {value}")
    return " · ".join(parts)


def held_out(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The validation metrics (``<prefix>/val/<name>``) among ``metrics``, sorted by name."""
    return {name: float(value) for name, value in sorted(metrics.items()) if "/val/" in name}


def unit(pl_module: L.LightningModule) -> str:
    """What one training batch is: an iteration of the on-policy loop (manual optimization), else a batch."""
    return "batch" if pl_module.automatic_optimization else "iteration"


class ProgressLines(Callback):
    """Progress as plain lines on standard output, at most one every ``every_seconds`` (the first and the last
    training batch always), and one after each validation with its held-out metrics::

        [ppo] iteration 1/96 · epoch 1/3 · step 4 · 41s · 07:02:11 · first iteration 41s (warm-up) · reward ...
        [ppo] iteration 12/96 · epoch 1/3 · step 48 · 3m05s · 07:04:35 · 13.0 s/iteration · 18m12s left · reward ...
        [ppo] validation after iteration 16: ppo/val/eos_frac 1 · ppo/val/gold 1.31 · ppo/val/kl 8.68 · ...

    Each progress line says the time of day it was printed. The time per iteration (or batch) is that of the last
    ``window`` ones, so a slowdown shows at once, and never counts this process's first one, whose warm-up (loading,
    compiling, caches) would inflate the time left several-fold; the time left is the work left at that rate
    (validations not included), when the run's length is known. The metrics
    are those a progress bar would show (the main ones: reward, KL and gold for the on-policy algorithms, loss and
    accuracy for the offline stages). Printed by rank 0 only.

    Args:
        every_seconds: least time between two progress lines.
        window: training batches the time per batch is measured over.
    """

    def __init__(self, every_seconds: float = 60.0, window: int = 20) -> None:
        if not every_seconds >= 0 or window < 1:
            raise ValueError(f"ProgressLines: every_seconds must be >= 0 and window >= 1, got {every_seconds}, "
                             f"{window}")
        self.every_seconds = every_seconds
        self.window = window
        self._started = self._last_line = 0.0
        self._first_batch = 0
        self._recent: deque[tuple[float, int, int]] = deque(maxlen=window + 1)  # (time, batches, steps)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.monotonic()
        self._last_line = -math.inf
        self._first_batch = batches_done(trainer)  # resumed runs: the rate counts this process's batches
        self._recent.clear()  # from the end of the first batch on: the steady state

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.monotonic()
        done, total = batches_done(trainer), training_batches(trainer)
        self._recent.append((now, done, trainer.global_step))
        last = (total is not None and done >= total) or (step_bounded(trainer)
                                                         and trainer.global_step >= trainer.max_steps)
        if now - self._last_line < self.every_seconds and done > self._first_batch + 1 and not last:
            return
        self._last_line = now
        self.emit(trainer, self.progress_line(trainer, pl_module, now))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = held_out(trainer.callback_metrics)
        if metrics:
            where = f"after {unit(pl_module)} {batches_done(trainer)}"
            self.emit(trainer, f"[{self.prefix(pl_module)}] validation {where}: {metric_text(metrics)}")

    def progress_line(self, trainer: L.Trainer, pl_module: L.LightningModule, now: float) -> str:
        done, total = batches_done(trainer), training_batches(trainer)
        name = unit(pl_module)
        parts = [f"{name} {done}" + (f"/{total}" if total is not None else "")]
        if not step_bounded(trainer) and trainer.max_epochs not in (None, -1) and trainer.max_epochs > 1:
            parts.append(f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}")
        parts.append(f"step {trainer.global_step}" + (f"/{trainer.max_steps}" if step_bounded(trainer) else ""))
        parts.append(duration(now - self._started))
        parts.append(time.strftime("%H:%M:%S"))
        (then, batches_then, steps_then), (_, _, steps_now) = self._recent[0], self._recent[-1]
        if done == self._first_batch + 1:
            parts.append(f"first {name} {duration(now - self._started)} (warm-up)")
        elif done > batches_then:
            per_batch = (now - then) / (done - batches_then)
            parts.append(f"{per_batch:.3g} s/{name}")
            if total is not None:
                parts.append(f"{duration(per_batch * max(total - done, 0))} left")
            elif step_bounded(trainer) and steps_now > steps_then:
                per_step = (now - then) / (steps_now - steps_then)
                parts.append(f"{duration(per_step * max(trainer.max_steps - steps_now, 0))} left")
        training = {key: value for key, value in trainer.progress_bar_metrics.items()
                    if key not in HIDDEN and "/val/" not in key}
        if training:
            parts.append(metric_text(training))
        return f"[{self.prefix(pl_module)}] " + " · ".join(parts)

    @staticmethod
    def prefix(pl_module: L.LightningModule) -> str:
        return run_name(pl_module)

    @staticmethod
    def emit(trainer: L.Trainer, line: str) -> None:
        if trainer.is_global_zero:
            print(line, flush=True)
