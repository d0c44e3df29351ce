"""Runs of the distributed equivalence and preemption tests (``tests/contracts/test_distributed_equivalence.py``,
``tests/callbacks/test_preemption.py``), outside pytest.

``python tests/helpers/equivalence.py RUNS.json`` runs each ``fit`` listed in the file, in order, through the real command
line (``rlhf_lightning.cli.main``), with :class:`Probe` recording what the test compares and the run's extra
callbacks (:class:`KillAt`, :class:`SignalAt`, :class:`KillInValidation`, checkpoints). A run on two devices starts
the second process by running this script again (Lightning's launcher), and the later runs reuse the processes,
so one launch serves every two-process run of a test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rlhf_lightning.models.sharding import full_tensor, local_numel, reshard_all  # noqa: E402

SKIPPED_METRICS = ("time/", "throughput/", "perf/", "reward_std", "score_std", "iteration")  # perf/: wall-clock rates


class Probe(L.Callback):
    """Records, on rank 0, what the equivalence tests compare: the training metrics of every batch (already
    averaged over ranks), the gradients of every trainable parameter before every optimizer step and the trained
    weights at the end, both whole (gathered from the shards under FSDP2), the validation metrics, and each
    rank's share of the base's parameters, and the process group's backend (gloo, nccl; None in one process).

    Args:
        out: the file to write (``torch.save``).
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.metrics: list[dict[str, float]] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Each validation's metrics as a line of ``{out}.validations.jsonl`` at once (a killed run keeps them)."""
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        record = {"step": trainer.global_step, "batch": trainer.fit_loop.epoch_loop.total_batch_idx + 1,
                  **{name: float(value) for name, value in trainer.callback_metrics.items() if "/val/" in name}}
        with open(f"{self.out}.validations.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
            os.fsync(file.fileno())

    @staticmethod
    def _trainable(pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        return {name: parameter for name, parameter in pl_module.named_parameters() if parameter.requires_grad}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.gradients.append({name: full_tensor(parameter.grad).detach().clone()
                               for name, parameter in self._trainable(pl_module).items()
                               if parameter.grad is not None})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.metrics.append({name: float(value) for name, value in trainer.callback_metrics.items()
                             if "/val/" not in name and not any(skip in name for skip in SKIPPED_METRICS)})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        weights = {name: full_tensor(parameter.detach()).clone() for name, parameter in self._trainable(pl_module).items()}
        reshard_all(pl_module.model)  # count the shards, not the root unit FSDP2 keeps gathered after a pass
        base = [parameter for name, parameter in pl_module.model.base_parameters()]
        shares = [local_numel(base)]
        if dist.is_available() and dist.is_initialized():
            shares = [None] * dist.get_world_size()
            dist.all_gather_object(shares, local_numel(base))
        validation = {name: float(value) for name, value in trainer.callback_metrics.items() if "/val/" in name}
        if trainer.is_global_zero:
            torch.save({"metrics": self.metrics, "gradients": self.gradients, "weights": weights,
                        "validation": validation, "base_shares": shares,
                        "base_numel": sum(parameter.numel() for parameter in base),
                        "sharded": pl_module.model.is_sharded,
                        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
                        "checkpoint_io": type(trainer.strategy.checkpoint_io).__name__}, self.out)


class KillAt(L.Callback):
    """Kills every process of the run (``SIGKILL`` to its process group, as ``kill -9`` of a job would) just
    before optimizer step ``step`` of iteration ``iteration`` (both from 1): mid-update, after the checkpoints of
    the iterations before.

    Args:
        iteration: the training batch (on-policy iteration) to die in.
        step: the optimizer step of that iteration to die before.
    """

    def __init__(self, iteration: int, step: int) -> None:
        self.iteration, self.step, self.steps = iteration, step, 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.fit_loop.epoch_loop.total_batch_idx + 1 != self.iteration:
            return
        self.steps += 1
        if self.steps == self.step and trainer.is_global_zero:
            os.killpg(os.getpgrp(), signal.SIGKILL)


class SignalAt(L.Callback):
    """Sends ``signal`` to this process (rank 0's, or every rank's with ``every_rank``) just before optimizer step
    ``step`` of training batch ``batch`` (both from 1), as a scheduler's ``kill -TERM`` would mid-step.

    Args:
        batch: the training batch (an on-policy iteration) to signal in.
        step: the optimizer step of that batch.
        name: the signal's name (``SIGTERM``, ``SIGINT``, ``SIGUSR1``).
        every_rank: signal every rank (as a terminal's Ctrl-C or SLURM does), not rank 0 alone.
    """

    def __init__(self, batch: int, step: int = 1, name: str = "SIGTERM", every_rank: bool = False) -> None:
        self.batch, self.step, self.name, self.every_rank, self.steps = batch, step, name, every_rank, 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.fit_loop.epoch_loop.total_batch_idx + 1 != self.batch:
            return
        self.steps += 1
        if self.steps == self.step and (self.every_rank or trainer.is_global_zero):
            os.kill(os.getpid(), getattr(signal, self.name))


class KillInValidation(L.Callback):
    """``SIGKILL`` to every process of the run in the middle of its ``number``-th validation (after its first
    batch), as a ``kill -9`` would.

    Args:
        number: the validation (from 1, sanity checks not counted) to die in.
    """

    def __init__(self, number: int) -> None:
        self.number, self.seen = number, 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.seen += 1

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.seen == self.number and batch_idx == 0 and trainer.is_global_zero:
            os.killpg(os.getpgrp(), signal.SIGKILL)


class RowsTrained(L.Callback):
    """Appends the dataset rows of each training batch's prompts to ``out`` (a line per batch), as the batch ends:
    what a run trained on, counted across a stop and its resume.

    Args:
        out: the file the lines go to.
    """

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        with open(self.out, "a") as lines:
            lines.write(json.dumps(batch["prompts"]["index"].tolist()) + "\n")


def main(runs_file: str) -> None:
    from rlhf_lightning.cli import main as cli_main

    for run in json.loads(Path(runs_file).read_text()):
        probe = {"class_path": "tests.helpers.equivalence.Probe", "init_args": {"out": run["out"]}}
        callbacks = [probe, *run.get("callbacks", [])]
        cli_main(["fit", *run["args"], f"--trainer.callbacks={json.dumps(callbacks)}"])


if __name__ == "__main__":
    main(sys.argv[1])
