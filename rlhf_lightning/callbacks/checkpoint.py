"""Checkpoints that survive a crash at any moment, and resuming that says which file it used."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.preemption import validation_follows
from rlhf_lightning.utils.atomic_io import (
    AtomicCheckpointIO,
    CheckpointError,
    checkpoint_problem,
    readable_checkpoints,
    remove_leftovers,
    temp_path,
)


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose files are complete or absent, and whose ``ckpt_path="last"`` never loads a
    broken file.

    - Every checkpoint (``last.ckpt`` included) is written to a temp file in its own folder, flushed, fsynced,
      then renamed into place (:class:`~rlhf_lightning.utils.atomic_io.AtomicCheckpointIO`, installed on
      the Trainer's strategy unless it already has a custom ``CheckpointIO``). ``last.ckpt`` is replaced only
      after the new file is complete, so a crash (``kill -9``, a full disk) leaves the previous one in place;
      the temp files of interrupted writes are removed at the next start and save.
    - ``fit(ckpt_path="last")`` checks the last checkpoint; when it is cut short or corrupt it resumes from the
      newest complete checkpoint in the folder instead, with a warning naming both files.
    - Without a ``dirpath``, checkpoints go to ``<run folder>/checkpoints`` (the Trainer's ``default_root_dir``).
    - A checkpoint due after a training batch that validation follows is written once that validation has run
      (and been logged): a run resumed from it never skips a validation, and one killed during the validation
      resumes from the checkpoint before, which runs it again.

    Takes every ``ModelCheckpoint`` argument (``dirpath``, ``save_last``, ``every_n_train_steps``...).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after_validation = False  # a save due at the last training batch waits for its validation

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if validation_follows(trainer):
            self._after_validation = True
            return
        self.save_if_due(trainer, pl_module, outputs, batch, batch_idx)

    def save_if_due(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                    batch_idx: int) -> None:
        """Save when this training batch's step is one to save at (``every_n_train_steps``...)."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._after_validation:
            self._after_validation = False
            # The same step as at the batch's end, so the same decision; the validation is now in the state.
            self.save_if_due(trainer, pl_module, None, None, trainer.fit_loop.epoch_loop.batch_idx)
            return
        super().on_validation_end(trainer, pl_module)

    def use_run_folder(self, trainer: L.Trainer) -> None:
        """Take ``<default_root_dir>/checkpoints`` as the folder when none was given."""
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.use_run_folder(trainer)
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # leave custom IO (async, cloud) alone
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.is_global_zero and self.dirpath and Path(self.dirpath).is_dir():
            remove_leftovers(Path(self.dirpath))

    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        self.use_run_folder(trainer)  # `--ckpt_path last` is resolved before setup
        found = super()._find_last_checkpoints(trainer)
        complete = {path for path in found if checkpoint_problem(path) is None}
        if complete or not found:
            return complete
        broken = max(found, key=lambda p: Path(p).stat().st_mtime if Path(p).exists() else 0.0)
        problem = checkpoint_problem(broken)
        fallback = readable_checkpoints(Path(broken).parent)
        if not fallback:
            raise CheckpointError(f"checkpoint {broken}: {problem}; no complete checkpoint in "
                                  f"{Path(broken).parent} to resume from")
        rank_zero_warn(f"checkpoint {broken}: {problem}; resuming from the newest complete checkpoint "
                       f"{fallback[0]} instead")
        return {str(fallback[0])}

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        # `save_last="link"`: Lightning deletes the old link before making the new one; a crash in between
        # would leave no last checkpoint. A link made aside and renamed over the old one never leaves a gap.
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link = temp_path(Path(linkpath))
            link.unlink(missing_ok=True)
            os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), link)
            os.replace(link, linkpath)
        trainer.strategy.barrier()


class IterationCheckpoint(Checkpoint):
    """:class:`Checkpoint` that saves every ``every_n_iterations`` training batches (on-policy iterations).

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

    def save_if_due(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                    batch_idx: int) -> None:
        iterations = trainer.fit_loop.epoch_loop.total_batch_idx + 1
        if self.every_n_iterations < 1 or iterations % self.every_n_iterations:
            return
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
