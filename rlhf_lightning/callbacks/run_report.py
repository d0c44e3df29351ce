"""What a fit says at its start and its end: a warning when it would never validate, and a summary that leads
with the held-out metrics."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.progress_lines import (
    HIDDEN,
    ProgressLines,
    duration,
    held_out,
    metric_text,
    unit,
)
from rlhf_lightning.callbacks.run_shape import validation_problem


def plural(noun: str, count: int) -> str:
    return noun if count == 1 else noun + ("es" if noun.endswith("ch") else "s")


class RunReport(Callback):
    """At the start of a fit, warn once when its validation interval exceeds its length (it would never
    validate); at the end, print a summary on rank 0 that leads with the last validation's held-out metrics
    (gold where the task knows it, KL, score; validation loss and accuracy for SFT, reward model and DPO), then the
    last training values, then where the checkpoints and exported adapters are::

        [ppo] fit ended: 96 iterations, 384 optimizer steps, 27m12s
          held-out (validation after iteration 96): ppo/val/gold 1.967 · ppo/val/kl 7.84 · ppo/val/score 2.1 · ...
          training (last iteration): gold 2.14 · kl 8.01 · reward 3.2
          run folder: outputs/ppo · checkpoints: outputs/ppo/checkpoints · exports: outputs/ppo/export

    The CLI adds it to every fit and prints the summary once the loggers have finished (W&B prints its own
    summary then), so that it is the last thing a run says.

    Args:
        print_at_fit_end: print the summary when the fit ends; false = only keep it in ``summary_text`` for the
            caller to print.
    """

    def __init__(self, print_at_fit_end: bool = True) -> None:
        self.print_at_fit_end = print_at_fit_end
        self.summary_text: str | None = None
        self._started = 0.0
        self._held_out: dict[str, float] = {}
        self._validated_after: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.monotonic()
        self._held_out, self._validated_after = {}, None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        problem = validation_problem(trainer)
        if problem:
            rank_zero_warn(problem)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._held_out = held_out(trainer.callback_metrics)
        self._validated_after = ProgressLines.batches_done(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self.summary_text = self.summary(trainer, pl_module)
        if self.print_at_fit_end:
            print(self.summary_text, flush=True)

    def summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """The end-of-fit summary (see the class)."""
        name = unit(pl_module)
        done = ProgressLines.batches_done(trainer)
        lines = [f"[{ProgressLines.prefix(pl_module)}] fit ended: {done} {plural(name, done)}, "
                 f"{trainer.global_step} optimizer steps, {duration(time.monotonic() - self._started)}"]
        if self._held_out:
            lines.append(f"  held-out (validation after {name} {self._validated_after}): "
                         f"{metric_text(self._held_out)}")
        else:
            reason = validation_problem(trainer) or ("trainer.limit_val_batches=0 or no validation data"
                                                     if not trainer.enable_validation
                                                     or trainer.limit_val_batches == 0 else "")
            lines.append("  held-out: no validation ran" + (f" ({reason})" if reason else ""))
        training = {key: value for key, value in trainer.progress_bar_metrics.items()
                    if key not in HIDDEN and "/val/" not in key}
        if training:
            lines.append(f"  training (last {name}): {metric_text(training)}")
        lines.append("  " + " · ".join(self.places(trainer, pl_module)))
        return "\n".join(lines)

    @staticmethod
    def places(trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """Where the run wrote: its folder, checkpoints and exports (adapters, or SFT's model)."""
        places = [f"run folder: {trainer.default_root_dir}"]
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and getattr(checkpoint, "dirpath", None):
            places.append(f"checkpoints: {checkpoint.dirpath}")
        export: Any = getattr(pl_module, "export_folder", None)
        if export is not None:
            places.append(f"exports: {export}")
        return places
