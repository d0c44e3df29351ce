"""lm-evaluation-harness tasks on the policy as it is during a fit: the module's own base with the policy adapter on
(no second copy of the weights), every N iterations, each result logged as ``eval/<task>/<metric>``."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlhf_lightning.evaluation.harness import HarnessSettings, metric_values, run_tasks
from rlhf_lightning.evaluation.tasks import load_tasks, select_tasks, task_manager
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.utils import checks

INSTALL_HINT = "pip install -e '.[eval]' (in the repository's clone)"


def evaluated_role(model: SharedBase, role: str | None) -> str | None:
    """The adapter ``role: auto`` evaluates: ``policy`` when the base has one, else its only trainable adapter (SFT's
    LoRA), else none: the base itself (full fine-tuning)."""
    if role != "auto":
        return role
    if "policy" in model.adapters:
        return "policy"
    trainable = sorted(model.trainable_adapters)
    return trainable[0] if len(trainable) == 1 else None


def last_batch(trainer: L.Trainer) -> bool:
    """Whether the training batch that just ended is the fit's last (``max_steps`` reached, or the last batch of the
    last epoch)."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    last_epoch = trainer.max_epochs is not None and trainer.max_epochs >= 0 and \
        trainer.current_epoch + 1 >= trainer.max_epochs
    return bool(last_epoch and trainer.is_last_batch)


class LMEvaluation(Callback):
    """Runs lm-evaluation-harness tasks on the policy during the fit, every ``every_n_iterations`` training batches
    (an online algorithm's iterations, an offline stage's steps) and after the last one, and logs every result as
    ``eval/<task>/<metric>`` (``eval/<task>/<metric>/<filter>`` for a filter other than lm-eval's ``none``) in that
    batch's row: W&B's summary keeps the last, and the fit's summary prints them. The tasks are found and their data
    loaded when the fit starts (one line if one cannot be); an evaluation leaves the random streams as they were,
    and its seconds are left out of the throughput figures.

    Args:
        tasks: lm-eval task names or globs, or task YAML files (``tiny_mc.yaml``).
        every_n_iterations: evaluate after every this many training batches.
        include_path: folders of task YAML files to find tasks in, besides lm-eval's own.
        role: the adapter evaluated: ``auto`` = ``policy``, else the only trainable adapter (SFT's), else the base
            itself; or an adapter's name.
        batch_size: requests per forward pass.
        max_length: tokens of context; null = the model's.
        max_gen_toks: tokens generated when a task does not say.
        at_end: evaluate after the fit's last training batch too.
        harness: lm-eval's settings (``limit``, ``num_fewshot``, ``apply_chat_template``, ``gen_kwargs``, ...:
            :class:`~rlhf_lightning.evaluation.harness.HarnessSettings`), e.g. ``{limit: 100}``.
    """

    def __init__(self, tasks: list[str], every_n_iterations: int = 50, include_path: list[str] | None = None,
                 role: str | None = "auto", batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, at_end: bool = True, harness: HarnessSettings | None = None) -> None:
        checks.at_least("every_n_iterations", every_n_iterations)
        checks.at_least("batch_size", batch_size)
        self.task_names, self.every, self.include_path = list(tasks), every_n_iterations, list(include_path or [])
        self.role, self.batch_size, self.max_length, self.max_gen_toks = role, batch_size, max_length, max_gen_toks
        self.at_end = at_end
        self.harness = (harness or HarnessSettings()).check()
        self.selection = select_tasks(self.task_names, self.include_path)  # files checked when the config is read
        self.manager: Any = None
        self.tasks: list[Any] = []
        self.evaluation_seconds = 0.0  # in the current training batch (the throughput figures leave them out)
        self.last_values: dict[str, float] = {}
        self.last_iteration = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.manager is not None:
            return
        try:
            import lm_eval  # noqa: F401
        except ImportError as error:
            raise RuntimeError(f"LMEvaluation needs lm-evaluation-harness ({error}): {INSTALL_HINT}") from error
        self.manager = task_manager(self.selection)
        self.tasks = load_tasks(self.manager, self.selection)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.evaluation_seconds = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        done = trainer.fit_loop.epoch_loop.total_batch_idx + 1
        if done % self.every and not (self.at_end and last_batch(trainer)):
            return
        started = time.perf_counter()
        values = self.evaluate(pl_module)
        self.last_values, self.last_iteration = values, done
        pl_module.log_dict({f"eval/{name}": value for name, value in values.items()}, on_step=True, on_epoch=False,
                           batch_size=1)
        self.evaluation_seconds = time.perf_counter() - started

    def evaluate(self, pl_module: L.LightningModule) -> dict[str, float]:
        """Every ``<task>/<metric>`` of the tasks on the module's policy now."""
        from rlhf_lightning.evaluation.harness_lm import SharedBaseLM

        model: SharedBase = pl_module.model
        lm = SharedBaseLM(model, pl_module.tokenizer, evaluated_role(model, self.role), self.batch_size,
                          self.max_length, self.max_gen_toks)
        return metric_values(run_tasks(lm, self.tasks, self.harness, self.manager))
