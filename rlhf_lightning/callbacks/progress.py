"""Progress bars that count what bounds the run: optimizer steps when ``max_steps`` does, epochs otherwise."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

from rlhf_lightning.callbacks.run_shape import step_bounded

STEPS = "Steps"


def epoch_description(trainer: L.Trainer, current_epoch: int) -> str:
    """``Epoch 3/3`` in the last of three epochs (Lightning's bars count from 0: ``Epoch 2/2``)."""
    total = f"/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1) else ""
    return f"Epoch {current_epoch + 1}{total}"


class StepRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar; a step-bounded run reads ``Steps 412/1000`` (optimizer steps of
    ``max_steps``) instead of ``Epoch 0/-2`` with the batches of the current epoch, and epochs count from 1
    (``Epoch 3/3`` in the last of three).

    Takes every ``RichProgressBar`` argument.
    """

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if step_bounded(self.trainer) else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if step_bounded(self.trainer):
            return f"{STEPS:{len(self.validation_description)}}"  # padded like Lightning's, against flicker
        description = epoch_description(self.trainer, current_epoch)
        return f"{description:{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if step_bounded(trainer):
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not step_bounded(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # resumed mid-epoch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar with the same step count as :class:`StepRichProgressBar` (used when
    ``rich`` is not installed).

    Takes every ``TQDMProgressBar`` argument.
    """

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if step_bounded(self.trainer) else super().total_train_batches

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if step_bounded(trainer):
            self.train_progress_bar.n = trainer.global_step
            self.train_progress_bar.set_description(STEPS)
        else:
            self.train_progress_bar.set_description(epoch_description(trainer, trainer.current_epoch))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not step_bounded(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if bar is not None and self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))


def default_progress_bar() -> ProgressBar:
    """The bar the CLI adds when the config names none: rich when installed (as Lightning chooses), else tqdm."""
    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
