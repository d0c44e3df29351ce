"""A W&B table of what the policy writes, so a researcher can read it, not only plot its rewards."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger

log = logging.getLogger(__name__)

COLUMNS = ["iteration", "prompt", "response", "score", "gold", "kl"]


class CompletionsTable(L.Callback):
    """Logs a ``wandb.Table`` of the latest rollout every ``every_n_iterations`` PPO iterations.

    Reads ``pl_module.last_samples`` (a :class:`rlhf_lightning.core.experience.Samples`, which the PPO module
    fills at every rollout) after the training batch and logs its first ``max_rows`` responses under ``key``
    with the columns ``iteration, prompt, response, score, gold, kl``: the iteration the samples were drawn at
    (0 = the SFT policy, before any update), the reward-model score before normalisation and penalties, the
    gold reward when the task knows one (empty otherwise) and the sequence KL to the reference in nats.

    The table goes through the Trainer's W&B logger, so W&B keeps every version of it (one file per logged
    step under the run's ``media/table``). Without a W&B logger the callback does nothing; only rank 0 logs,
    its own samples.

    Args:
        every_n_iterations: log the rollouts drawn at iterations 0, N, 2N, ...; 0 turns the table off.
        max_rows: at most this many responses per table (the batch's prompts are already shuffled).
        key: the W&B key of the table; null = ``<module's metric prefix>/completions`` (``ppo/completions``,
            ``grpo/completions``...).
    """

    def __init__(self, every_n_iterations: int = 16, max_rows: int = 16, key: str | None = None) -> None:
        if every_n_iterations < 0 or max_rows < 1:
            raise ValueError(f"every_n_iterations must be >= 0 and max_rows >= 1, got {every_n_iterations}, "
                             f"{max_rows}")
        self.every_n_iterations = every_n_iterations
        self.max_rows = max_rows
        self.key = key
        self._warned = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        samples = getattr(pl_module, "last_samples", None)
        if samples is None or self.every_n_iterations < 1 or samples.iteration % self.every_n_iterations:
            return
        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if not loggers:
            if not self._warned:
                log.info("CompletionsTable: the Trainer has no WandbLogger; no table is logged")
                self._warned = True
            return
        if not trainer.is_global_zero:
            return
        key = self.key or f"{getattr(pl_module, 'metric_prefix', 'ppo')}/completions"
        loggers[0].log_table(key, columns=COLUMNS, data=self.rows(samples), step=trainer.global_step)

    def rows(self, samples: Any) -> list[list[Any]]:
        """The table's rows: one per response, at most ``max_rows``."""
        count = min(self.max_rows, len(samples.responses))
        gold = samples.gold if samples.gold is not None else [None] * len(samples.responses)
        return [
            [samples.iteration, samples.prompts[i], samples.responses[i], round(float(samples.scores[i]), 4),
             None if gold[i] is None else float(gold[i]), round(float(samples.kl[i]), 4)]
            for i in range(count)
        ]
