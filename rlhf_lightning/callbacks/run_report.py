"""What a fit says at its start and its end: a warning when it would never validate, and a summary that leads
with the held-out metrics."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.learning_check import LearningCheck
from rlhf_lightning.callbacks.progress_lines import (
    HIDDEN,
    ProgressLines,
    duration,
    held_out,
    metric_text,
    unit,
)
from rlhf_lightning.callbacks.run_shape import batches_done, validation_problem


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies under it, else absolute."""
    absolute = Path(path).absolute()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def plural(noun: str, count: int) -> str:
    return noun if count == 1 else noun + ("es" if noun.endswith("ch") else "s")


class RunReport(Callback):
    """At the start of a fit, warn once when its validation interval exceeds its length (it would never
    validate); at the end, print a summary on rank 0 that leads with the last validation's held-out metrics
    (gold where the task knows it, KL, score; validation loss and accuracy for SFT, reward model and DPO), then the
    last training values, then where the checkpoints and exported adapters are::

        [ppo] fit ended: 96 iterations, 384 optimizer steps, 27m12s
          held-out (validation after iteration 96): ppo/val/gold 1.967 · ppo/val/kl 7.84 · ppo/val/score 2.1 · ...
          change (iteration 0 → 96): ppo/val/gold -0.08 → 1.967 · ppo/val/kl 0 → 7.84 · ...
          [ppo] not learning: ...   (only when LearningCheck saw a stall)
          training (last iteration): gold 2.14 · kl 8.01 · reward 3.2
          run folder: outputs/ppo · checkpoints: outputs/ppo/checkpoints · exports: outputs/ppo/export

    The change line compares with the validation before the first update (see
    :class:`~rlhf_lightning.callbacks.ValidateAtStart`); its values are kept in checkpoints, so a resumed fit
    prints it too. Paths are relative to the working directory when they lie under it.

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
        self.at_start: dict[str, float] = {}  # the held-out metrics of the starting policy (kept in checkpoints)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.monotonic()
        self._held_out, self._validated_after = {}, None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.at_start = {}  # before a checkpoint's state is loaded: a resumed fit then takes its checkpoint's

    def state_dict(self) -> dict[str, Any]:
        return {"at_start": dict(self.at_start)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.at_start = dict(state_dict.get("at_start") or {})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        problem = validation_problem(trainer)
        if problem:
            rank_zero_warn(problem)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._held_out = held_out(trainer.callback_metrics)
        self._validated_after = batches_done(trainer)
        if self._validated_after == 0:
            self.at_start = dict(self._held_out)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self.summary_text = self.summary(trainer, pl_module)
        if self.print_at_fit_end:
            print(self.summary_text, flush=True)

    def summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """The end-of-fit summary (see the class)."""
        name = unit(pl_module)
        done = batches_done(trainer)
        lines = [f"[{ProgressLines.prefix(pl_module)}] fit ended: {done} {plural(name, done)}, "
                 f"{trainer.global_step} optimizer steps, {duration(time.monotonic() - self._started)}"]
        if self._held_out:
            lines.append(f"  held-out (validation after {name} {self._validated_after}): "
                         f"{metric_text(self._held_out)}")
            change = self.change_text()
            if change:
                lines.append(f"  change ({name} 0 → {self._validated_after}): {change}")
        else:
            reason = validation_problem(trainer) or ("trainer.limit_val_batches=0 or no validation data"
                                                     if not trainer.enable_validation
                                                     or trainer.limit_val_batches == 0 else "")
            lines.append("  held-out: no validation ran" + (f" ({reason})" if reason else ""))
        for check in trainer.callbacks:
            if isinstance(check, LearningCheck):
                lines += [f"  {check.message(pl_module, stall)}" for stall in check.stalls]
        training = {key: value for key, value in trainer.progress_bar_metrics.items()
                    if key not in HIDDEN and "/val/" not in key}
        if training:
            lines.append(f"  training (last {name}): {metric_text(training)}")
        lines.append("  " + " · ".join(self.places(trainer, pl_module)))
        return "\n".join(lines)

    def change_text(self) -> str:
        """``ppo/val/gold -0.08 → 1.967 · ...``: each held-out metric from the starting policy's validation to the
        last one (empty without a validation at the start, or when the last one was it)."""
        if not self.at_start or not self._validated_after:
            return ""
        return " · ".join(f"{name} {self.at_start[name]:.4g} → {value:.4g}"
                          for name, value in self._held_out.items() if name in self.at_start)

    @staticmethod
    def places(trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        """Where the run wrote: its folder, checkpoints and exports (adapters, or SFT's model)."""
        places = [f"run folder: {shown_path(trainer.default_root_dir)}"]
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and getattr(checkpoint, "dirpath", None):
            places.append(f"checkpoints: {shown_path(checkpoint.dirpath)}")
        export: Any = getattr(pl_module, "export_folder", None)
        if export is not None:
            places.append(f"exports: {shown_path(export)}")
        return places
