"""Nothing lost when the job is asked to stop: SIGTERM (what SLURM, Kubernetes and most schedulers send), SIGINT
(Ctrl-C) and SIGUSR1 (SLURM's ``--signal``) end the fit at the next step boundary with a checkpoint.

The first signal is only noted. At the end of the current training batch (an optimizer step; an on-policy
iteration with its rollout and update) every rank learns of it (one all-reduce per batch), every checkpoint
callback writes ``last.ckpt`` (atomically: complete or absent), and the process exits with ``128 + signal``
(143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1) after one line saying where to resume from. When validation is
due after that batch it runs first, so that the checkpoint holds it. A second signal stops at once: nothing is
saved of the current step, and the last complete checkpoint stays as it was (a save in progress leaves its temp
file, removed at the next start, never a broken ``last.ckpt``).

Under Lightning's SLURM environment with ``auto_requeue`` (its default), the job is requeued (``scontrol
requeue``) once the checkpoint is written, when the signal is the environment's requeue signal (SIGUSR1 unless
configured otherwise): give the job ``#SBATCH --signal=USR1@120`` (the signal 120 s before the time limit) and
``--ckpt_path last`` in its command, which starts fresh the first time and continues after a requeue.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Preempted(SystemExit):
    """The fit stopped on a signal after writing its checkpoint; the exit status is ``128 + signal``."""


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning runs validation right after the current training batch: its own decision, which it
    keeps private (anything unexpected there reads as no)."""
    loop = trainer.fit_loop.epoch_loop
    try:
        return bool(not loop._skip_next_val and loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except (AttributeError, TypeError):
        return False


def accumulating(trainer: L.Trainer) -> bool:
    """Whether the current batch is in the middle of a gradient accumulation (no step boundary)."""
    try:
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())
    except AttributeError:
        return False


def save_last(callback: ModelCheckpoint, trainer: L.Trainer) -> str:
    """Write ``callback``'s ``last.ckpt`` now (every rank takes part; rank 0 writes), whatever its ``save_last``."""
    candidates = callback._monitor_candidates(trainer)
    filepath = callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)
    callback.last_model_path = filepath
    callback._save_checkpoint(trainer, filepath)
    return filepath


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this SLURM job (an array task by its array id); returns the job id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        log.warning("scontrol requeue %s failed (%s): %s", job, result.returncode, result.stderr.strip())
    return job


class Preemption(L.Callback):
    """Stops a fit at the next step boundary with a checkpoint on SIGTERM, SIGINT or SIGUSR1; a second signal
    stops at once (see :mod:`rlhf_lightning.callbacks.preemption`). The command line adds it to every fit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._after_validation = False
        self._saves = True  # whether stopping writes a checkpoint (a checkpoint callback is configured)

    # ---- the signals --------------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its own SIGTERM handler just before training starts (it ends the fit with status 0
        # and no checkpoint): ours replaces it for the fit's duration.
        self.received, self._after_validation = None, False
        self._saves = any(isinstance(callback, ModelCheckpoint) for callback in trainer.checkpoint_callbacks)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._launcher = trainer.strategy.launcher

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"error: stopped at once by a second {name}: nothing was saved of the current step (the last "
                  "complete checkpoint stays as it was)", file=sys.stderr, flush=True)
            if self._launcher is not None:
                self._launcher.kill(signal.SIGKILL)  # the other ranks of this machine, wherever they wait
            os._exit(128 + signum)
        self.received = signum
        saving = ("with a checkpoint" if self._saves else "without a checkpoint (no checkpoint callback is "
                  "configured: trainer.enable_checkpointing)")
        print(f"{name} received: the run stops after the current step, {saving} (send it again to stop at once)",
              file=sys.stderr, flush=True)

    # ---- the step boundaries ------------------------------------------------------------------------------

    def _agreed(self, trainer: L.Trainer) -> int | None:
        """The signal any rank received (a signal may reach rank 0 alone); every rank calls this at each
        boundary, in the same order."""
        received = torch.tensor(float(self.received or 0), device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            received = trainer.strategy.reduce(received, reduce_op="max")
        return int(received.item()) or None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if accumulating(trainer):
            return
        signum = self._agreed(trainer)
        if signum is None:
            return
        if validation_follows(trainer):
            self._after_validation = True  # the checkpoint waits for the validation due after this batch
            return
        self.stop(trainer, signum)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return
        signum = self._agreed(trainer)
        if signum is not None:
            self.stop(trainer, signum)

    def stop(self, trainer: L.Trainer, signum: int) -> None:
        """Write ``last.ckpt`` with every checkpoint callback, say where to resume from, exit."""
        name = signal.Signals(signum).name
        saved = [save_last(callback, trainer) for callback in trainer.checkpoint_callbacks
                 if isinstance(callback, ModelCheckpoint)]
        where = f"step {trainer.global_step} (training batch {trainer.fit_loop.epoch_loop.total_batch_idx + 1})"
        environment = trainer._accelerator_connector.cluster_environment
        requeued = ""
        if (isinstance(environment, SLURMEnvironment) and environment.auto_requeue
                and signum == environment.requeue_signal and trainer.is_global_zero):
            requeued = f"; SLURM job {requeue_slurm_job()} requeued"
        if trainer.is_global_zero:
            if saved:
                print(f"error: stopped by {name} after {where}: checkpoint {saved[0]} written; resume with "
                      f"--ckpt_path last{requeued}", file=sys.stderr, flush=True)
            else:
                print(f"error: stopped by {name} after {where}; no checkpoint callback is configured "
                      "(trainer.enable_checkpointing), so nothing was saved", file=sys.stderr, flush=True)
        raise Preempted(128 + signum)
