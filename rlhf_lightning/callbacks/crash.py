"""Nothing lost to a crash: an exception in a training iteration (a reward source or server, an environment, a
judge, a data error) writes the checkpoint of the last completed iteration before the fit ends, and the error line
says which iteration failed and how to resume.

The iteration that failed had taken no optimizer step (a rollout failed), so the weights and optimizer are those
the last completed iteration left; what had moved on is put back for the save: Lightning's count of the batch it
had started, and the training loader's position (the failed iteration's prompts are trained on after the resume).
The random streams are seeded per iteration, so the resumed run draws what the uninterrupted one would have: a
fit resumed after the cause is fixed continues as if nothing had happened. Not saved (the line says why): a
failure after the update began (the weights are half-way), under several ranks (the others are not at a boundary
to save with), or under gradient accumulation; a run without checkpoints says nothing more.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from rlhf_lightning.callbacks.preemption import save_last
from rlhf_lightning.callbacks.run_shape import batches_done

# The attribute that carries the resume hint on the exception, for the command line's error line.
HINT = "rlhf_lightning_resume_hint"


def resume_hint(error: BaseException) -> str | None:
    """The sentence the crash checkpoint left on ``error`` (or on an exception in its chain), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        hint = getattr(current, HINT, None)
        if hint:
            return hint
        current = current.__cause__ or current.__context__
    return None


class CrashCheckpoint(L.Callback):
    """On an exception in a training iteration that took no optimizer step: every checkpoint callback writes
    ``last.ckpt`` as of the last completed iteration, and the error line ends with where it is and how to
    resume (see :mod:`rlhf_lightning.callbacks.crash`). The command line adds it to every fit."""

    def __init__(self) -> None:
        self._in_batch = False
        self._steps_before = 0
        self._loader_states: list[dict[str, Any]] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loader_states = self.loader_states(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._in_batch, self._steps_before = True, trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._in_batch = False
        self._loader_states = self.loader_states(trainer)  # where the next batch's iteration starts

    @staticmethod
    def loaders(trainer: L.Trainer) -> list[Any]:
        combined = trainer.fit_loop._combined_loader
        return list(combined.flattened) if combined is not None else []

    def loader_states(self, trainer: L.Trainer) -> list[dict[str, Any]] | None:
        """Every training loader's ``state_dict()``; None when one cannot say where it is."""
        loaders = self.loaders(trainer)
        if not loaders or not all(hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
                                  for loader in loaders):
            return None
        return [dict(loader.state_dict()) for loader in loaders]

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if (not self._in_batch or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                or isinstance(exception, SystemExit | KeyboardInterrupt)):
            return
        self._in_batch = False
        unit = "batch" if pl_module.automatic_optimization else "iteration"
        done = batches_done(trainer)
        failed = f"{unit} {done + 1} failed"
        if not any(isinstance(callback, ModelCheckpoint) for callback in trainer.checkpoint_callbacks):
            return  # a run without checkpoints: nothing to resume from, nothing to say
        why_not = self.why_not(trainer, pl_module)
        if why_not is not None:
            hint = (f"{failed}; the run as it was then is not saved ({why_not}): --ckpt_path last resumes from its "
                    "last checkpoint")
        else:
            paths = self.save(trainer)
            hint = (f"{failed}; the run up to {unit} {done} is saved in {paths[0]}: fix the cause, then run the same "
                    "command with --ckpt_path last")
        try:
            setattr(exception, HINT, hint)
        except AttributeError:  # an exception type that takes no attributes: the hint goes out on its own
            print(hint, file=sys.stderr, flush=True)

    def why_not(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
        """Why the last completed iteration cannot be saved now, or None when it can."""
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        if trainer.world_size > 1:
            return f"{trainer.world_size} ranks: the others are not at a step boundary to save with"
        if trainer.global_step != self._steps_before:
            return "its update had begun: the weights are half-way"
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            return "gradient accumulation: the batch's accumulated gradients are not saved"
        if self._loader_states is None:
            return "the training loader cannot say where it is"
        if not progress.ready == progress.started == progress.processed + 1 == progress.completed + 1:
            return "Lightning's loop is not where a batch's step fails"
        return None

    def save(self, trainer: L.Trainer) -> list[str]:
        """Write ``last.ckpt`` of every checkpoint callback as of the last completed iteration; their paths."""
        progress = trainer.fit_loop.epoch_loop.batch_progress
        loaders = self.loaders(trainer)
        ahead = [dict(loader.state_dict()) for loader in loaders]
        for tracker in (progress.total, progress.current):  # the failed batch, counted ready and started
            tracker.ready -= 1
            tracker.started -= 1
        for loader, state in zip(loaders, self._loader_states or [], strict=True):
            loader.load_state_dict(state)
        try:
            return [save_last(callback, trainer) for callback in trainer.checkpoint_callbacks
                    if isinstance(callback, ModelCheckpoint)]
        finally:
            for tracker in (progress.total, progress.current):
                tracker.ready += 1
                tracker.started += 1
            for loader, state in zip(loaders, ahead, strict=True):
                loader.load_state_dict(state)
