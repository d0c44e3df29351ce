"""A table of what the policy writes, so a researcher can read it, not only plot its rewards."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlhf_lightning.callbacks.run_shape import batches_done
from rlhf_lightning.core.experience import Samples
from rlhf_lightning.utils.atomic_io import atomic_write

COLUMNS = ["iteration", "prompt", "response", "score", "gold", "kl"]


def shown(value: float) -> float | None:
    """A number as the table shows it: 4 decimals, empty when not finite (JSON has no NaN)."""
    value = float(value)
    return round(value, 4) if math.isfinite(value) else None


class CompletionsTable(L.Callback):
    """The policy's responses as a table, every ``every_n_iterations`` iterations and at the end of the fit.

    During the fit it reads ``pl_module.last_samples`` (a :class:`rlhf_lightning.core.experience.Samples`, which the
    on-policy modules fill at every rollout) after the training batch, for the rollouts drawn at iterations 0, N,
    2N, ... When the fit ends it samples the **final policy** once on the first validation batch (the first training
    batch without validation data), from the evaluation stream (as validation does: training's seeds untouched).

    Columns ``iteration, prompt, response, score, gold, kl``: the iterations the policy had been trained for when it
    wrote the response (0 = the starting policy), the reward sources' score before normalisation and penalties
    (the validation score for the final table), the gold reward when the task knows one (empty otherwise) and the
    sequence KL to the reference in nats.

    Each table is written to ``<run folder>/completions/iteration_<NNNN>.jsonl`` (one JSON object per row; the name
    and the rows' ``iteration`` agree) and, with a W&B logger, logged under ``key`` (W&B keeps every version; its
    media file names count W&B's own log calls, not iterations). Only rank 0 writes, its own samples.

    Args:
        every_n_iterations: tables of the rollouts drawn at iterations 0, N, 2N, ...; 0 = only the final table.
        max_rows: at most this many responses per table (the batch's prompts are already shuffled).
        key: the W&B key of the table; null = ``<module's metric prefix>/completions`` (``ppo/completions``,
            ``grpo/completions``...).
        at_fit_end: a table of the final policy when the fit ends (a failure to sample it is a warning: the fit's
            result is saved after it).
        files: write each table as a file in the run folder too (the sweeps, whose trials share a folder, don't).
    """

    def __init__(self, every_n_iterations: int = 16, max_rows: int = 16, key: str | None = None,
                 at_fit_end: bool = True, files: bool = True) -> None:
        if every_n_iterations < 0 or max_rows < 1:
            raise ValueError(f"every_n_iterations must be >= 0 and max_rows >= 1, got {every_n_iterations}, "
                             f"{max_rows}")
        self.every_n_iterations = every_n_iterations
        self.max_rows = max_rows
        self.key = key
        self.at_fit_end = at_fit_end
        self.files = files

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        samples = getattr(pl_module, "last_samples", None)
        if samples is None or self.every_n_iterations < 1 or samples.iteration % self.every_n_iterations:
            return
        self.write(trainer, pl_module, samples)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.at_fit_end or not hasattr(pl_module, "last_samples"):
            return
        done = batches_done(trainer)
        # Every rank samples (a sharded model's forward passes are collective); rank 0 writes. The export comes
        # after this hook: nothing here may lose it.
        try:
            samples = self.final_samples(trainer, pl_module, done)
        except Exception as error:  # noqa: BLE001 - a table must not cost the run its export
            rank_zero_warn(f"CompletionsTable: the final policy's table was not written ({type(error).__name__}: "
                           f"{error})")
            return
        self.write(trainer, pl_module, samples)

    def final_samples(self, trainer: L.Trainer, pl_module: Any, iteration: int) -> Samples:
        """One response of the final policy to each prompt of the first held-out batch (else training batch)."""
        datamodule = trainer.datamodule
        loader = datamodule.val_dataloader() if trainer.enable_validation else []
        prompts = next(iter(loader)) if loader else next(iter(datamodule.train_dataloader()["prompts"]))
        prompts = trainer.strategy.batch_to_device(prompts)
        values, rollout, texts = pl_module.held_out.sample_and_measure(prompts, 0)
        if rollout.episodes is not None:
            from rlhf_lightning.rollout.episodes import transcript_text

            texts = [transcript_text(pl_module.tokenizer, episode) for episode in rollout.episodes]
        gold, scores = values.get("gold"), values["score"].tolist()
        if len(scores) != len(texts):  # rows with a non-finite score left out (optimizer.nonfinite: skip): none is shown
            scores = [float("nan")] * len(texts)
        return Samples(iteration, list(prompts["prompt"]), texts, scores, values["kl"].tolist(),
                       None if gold is None else gold.tolist())

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule, samples: Samples) -> None:
        """``samples`` as the table's file and, with a W&B logger, as a W&B table (rank 0)."""
        if not trainer.is_global_zero:
            return
        rows = self.rows(samples)
        if self.files:
            path = Path(trainer.default_root_dir) / "completions" / f"iteration_{samples.iteration:04d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(dict(zip(COLUMNS, row, strict=True))) + "\n" for row in rows)
            atomic_write(path, lambda file: file.write(text.encode()))
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                key = self.key or f"{getattr(pl_module, 'metric_prefix', 'ppo')}/completions"
                logger.log_table(key, columns=COLUMNS, data=rows, step=trainer.global_step)
                break

    def rows(self, samples: Samples) -> list[list[Any]]:
        """The table's rows: one per response, at most ``max_rows``."""
        count = min(self.max_rows, len(samples.responses))
        gold = samples.gold if samples.gold is not None else [None] * len(samples.responses)
        return [
            [samples.iteration, samples.prompts[i], samples.responses[i], shown(samples.scores[i]),
             None if gold[i] is None else float(gold[i]), shown(samples.kl[i])]
            for i in range(count)
        ]
