"""Checkpointing by PPO iteration."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class IterationCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves every ``every_n_iterations`` training batches (on-policy iterations).

    Under manual optimization an iteration makes several optimizer steps (fewer when ``target_kl`` stops it
    early), so ``every_n_train_steps`` would drift; iterations are what a PPO user counts. The checkpoint is
    taken after the iteration's update, so resuming starts with the next iteration.

    Args:
        every_n_iterations: save every this many iterations; 0 = only as the other ``ModelCheckpoint`` options
            say (e.g. ``save_last`` at the end).
        **kwargs: ``ModelCheckpoint`` arguments (``dirpath``, ``save_last``, ``filename``...).
    """

    def __init__(self, every_n_iterations: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("every_n_train_steps", 0)
        super().__init__(**kwargs)
        self.every_n_iterations = every_n_iterations

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        iterations = trainer.fit_loop.epoch_loop.total_batch_idx + 1
        if self.every_n_iterations < 1 or iterations % self.every_n_iterations:
            return
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
