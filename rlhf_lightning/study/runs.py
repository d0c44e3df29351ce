"""PPO runs of the study: the framework's own CLI and Trainer, one run per KL coefficient, and what they
measured.

Each run is ``python -m rlhf_lightning fit --config <ppo config> --model.init_args.kl.coef=<c> ...`` in this
process (the same parser, config and W&B logger a user gets), with a callback that records, at every
iteration, the mean gold reward, proxy score and KL of the rollout the policy was trained on, and at every
evaluation the same on the held-out prompts.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L

from rlhf_lightning.cli import RLHFCLI
from rlhf_lightning.study.gao import kl_distance


@dataclass
class Point:
    """Mean gold reward, proxy score and KL (nats) of a policy after ``iteration`` PPO iterations."""

    iteration: int
    kl: float
    gold: float
    proxy: float

    @property
    def d(self) -> float:
        """``sqrt(KL)``: :func:`~rlhf_lightning.study.gao.kl_distance`."""
        return kl_distance(self.kl)


@dataclass
class RunResult:
    """One PPO run of the study.

    ``train`` has a point per iteration, measured on that iteration's rollout (sampled before its update, so
    the point of iteration ``i`` is the policy after ``i`` updates); ``eval`` a point per evaluation on the
    held-out prompts (fixed sampling seeds), after ``iteration`` updates.
    """

    kl_coef: float
    train: list[Point] = field(default_factory=list)
    eval: list[Point] = field(default_factory=list)
    seconds: float = 0.0
    directory: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_coef, "seconds": self.seconds, "directory": self.directory,
                "train": [vars(p) for p in self.train], "eval": [vars(p) for p in self.eval]}


class StudyRecorder(L.Callback):
    """Records the study's points during a PPO fit and stops it after ``iterations`` iterations.

    Reads ``pl_module.last_samples`` (every response of the rollout: its gold, score and KL) after each
    training batch, and the logged ``ppo/val/*`` means after each evaluation.
    """

    def __init__(self, result: RunResult, iterations: int) -> None:
        self.result = result
        self.iterations = iterations

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        samples = pl_module.last_samples
        if samples.gold is None:
            raise ValueError("the study needs the task's gold reward (model.init_args.gold_reward)")
        self.result.train.append(Point(samples.iteration, _mean(samples.kl), _mean(samples.gold),
                                       _mean(samples.scores)))
        if samples.iteration + 1 >= self.iterations:
            trainer.should_stop = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        if "ppo/val/gold" in metrics:
            self.result.eval.append(Point(len(self.result.train), float(metrics["ppo/val/kl"]),
                                          float(metrics["ppo/val/gold"]), float(metrics["ppo/val/score"])))


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def ppo_arguments(config: str | Path, sft_model: str | Path, reward_adapter: str | Path, kl_coef: float,
                  directory: Path, group: str, eval_every: int, table_every: int,
                  overrides: Sequence[str] = ()) -> list[str]:
    """The ``fit`` command line of one study run.

    The run writes only under ``directory``: its W&B run (in ``group``, named after the coefficient), the
    exported adapters and the resolved config. Checkpoints are off (a study run is short and never resumed);
    the completions table is logged every ``table_every`` iterations. ``overrides`` come last and win.
    """
    table = {"class_path": "rlhf_lightning.callbacks.CompletionsTable",
             "init_args": {"every_n_iterations": table_every, "max_rows": 16}}
    return [
        "fit", "--config", str(config),
        f"--model.init_args.base.name_or_path={sft_model}",
        f"--model.init_args.reward.init_args.path={reward_adapter}",
        f"--model.init_args.kl.coef={kl_coef}",
        "--model.init_args.kl.target=null",  # the coefficient under study stays fixed
        f"--model.init_args.export_dir={(directory / 'adapters').absolute()}",
        f"--trainer.default_root_dir={directory}",
        f"--trainer.logger.init_args.save_dir={directory}",
        f"--trainer.logger.init_args.group={group}",
        f"--trainer.logger.init_args.name=kl_coef={kl_coef:g}",
        f"--trainer.callbacks=[{json.dumps(table)}]",
        "--trainer.enable_checkpointing=false",
        f"--trainer.val_check_interval={eval_every}",
        "--trainer.check_val_every_n_epoch=null",
        "--trainer.num_sanity_val_steps=0",
        "--validate_at_start.enabled=false",  # the study measures the SFT policy itself (its baseline points)
        "--trainer.max_steps=-1",
        *overrides,
    ]


def held_out_batches(datamodule: Any, prompts: int, needed_for: str) -> list[dict[str, Any]]:
    """The first ``prompts`` held-out prompts of a prompt data module (set up), in its validation batches."""
    left, batches = prompts, []
    for batch in datamodule.val_dataloader():
        if left <= 0:
            break
        batches.append({key: {name: column[:left] for name, column in value.items()}
                        if isinstance(value, dict) else value[:left] for key, value in batch.items()})
        left -= len(batch["prompt"])
    if not batches:
        raise ValueError(f"{needed_for} needs held-out prompts: the config's data has no validation set")
    return batches


def build_cli(arguments: Sequence[str]) -> RLHFCLI:
    """The framework's CLI, instantiated (model, data, Trainer) from ``arguments`` without running."""
    with warnings.catch_warnings():
        # LightningCLI warns when given arguments while sys.argv holds others: here they are the study's own.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return RLHFCLI(args=list(arguments), run=False)


def run_ppo(arguments: Sequence[str], kl_coef: float, iterations: int, directory: Path) -> RunResult:
    """Fit PPO with ``arguments`` (see :func:`ppo_arguments`) for ``iterations`` iterations; return its
    points."""
    start = time.perf_counter()
    result = RunResult(kl_coef, directory=str(directory))
    cli = build_cli(arguments[1:])  # arguments[0] is the subcommand, "fit"
    cli.trainer.callbacks.append(StudyRecorder(result, iterations))
    # Enough epochs over the prompt set for `iterations` iterations; the recorder stops the run right there.
    cli.datamodule.tokenizer = cli.model.tokenizer
    cli.datamodule.setup("fit")
    per_epoch = len(cli.datamodule.train_dataloader()["prompts"])
    limit = cli.trainer.limit_train_batches
    per_epoch = min(per_epoch, limit) if isinstance(limit, int) else max(1, int(per_epoch * limit))
    cli.trainer.fit_loop.max_epochs = math.ceil(iterations / per_epoch)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    result.seconds = time.perf_counter() - start
    return result
