"""A full validation before the first update, so that every run's curves start at the starting policy."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlhf_lightning.callbacks.run_shape import batches_done, validation_problem


class ValidateAtStart(Callback):
    """Runs the whole validation once when a fresh fit starts, before the first training batch: the held-out
    metrics of the starting policy (the SFT model, before any update) are logged at iteration / step 0, progress
    lines print ``validation after iteration 0``, and the end-of-fit summary prints each metric's change
    (``ppo/val/gold -0.08 → 1.967``).

    It costs one validation (``trainer.limit_val_batches`` bounds it as it bounds every other). A resumed fit does
    not repeat it: its checkpoint carries the starting values (see :class:`~rlhf_lightning.callbacks.RunReport`).
    Lightning's sanity check (``trainer.num_sanity_val_steps``) is a separate, unlogged run of a few validation
    batches; with this callback it adds nothing, so the configs set it to 0.

    The command line adds it to every fit: ``--validate_at_start.enabled false`` skips it.

    Args:
        enabled: run the validation before the first update.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After every on_train_start (the module's checks of the run folder, the preemption handler): at the
        # start of the first epoch of a fresh fit.
        fresh = batches_done(trainer) == 0 and trainer.global_step == 0
        # A fit whose interval exceeds its length validates never (RunReport warns): nothing to compare with.
        if not (self.enabled and fresh and trainer.enable_validation and validation_problem(trainer) is None):
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        # As Lightning's own validation inside the epoch loop: the active loop is picked from these flags.
        trainer.validating = True
        first_loop_iter = trainer._logger_connector._first_loop_iter
        epoch_loop.val_loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_loop_iter
