"""Every method of the family study measured the same way, on the same held-out prompts.

:class:`HeldOutEvaluation` is a callback that any policy-optimising stage (the online RL family and DPO alike)
runs under: before the first update and every ``every`` training batches it samples one response per held-out
prompt with the evaluation's fixed seeds, and records the mean gold reward, the proxy reward model's score and
the KL to the reference, beside the process CPU time training has used so far (evaluations excluded). Methods
that have no reward model of their own (DPO) get the study's proxy loaded onto their base as an extra adapter,
so that their samples are scored by the very same reward model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch

from rlhf_lightning.rewards import AdapterReward, RewardSet, reward_inputs
from rlhf_lightning.study.gao import kl_distance


@dataclass
class EvalPoint:
    """Means over the held-out prompts after ``step`` training batches (iterations of the online methods,
    optimizer steps of DPO), and the training CPU time spent to get there."""

    step: int
    kl: float
    gold: float
    proxy: float
    cpu_seconds: float

    @property
    def d(self) -> float:
        """``sqrt(KL)`` from the SFT policy: :func:`~rlhf_lightning.study.gao.kl_distance`."""
        return kl_distance(self.kl)


@dataclass
class MethodRun:
    """One run of the study: a method at one strength on one seed of the pipeline."""

    method: str
    strength: float
    seed: int
    points: list[EvalPoint] = field(default_factory=list)
    wall_seconds: float = 0.0
    directory: str = ""

    @property
    def cpu_seconds(self) -> float:
        """Training CPU time of the whole run (evaluations excluded)."""
        return self.points[-1].cpu_seconds if self.points else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "strength": self.strength, "seed": self.seed,
                "wall_seconds": self.wall_seconds, "directory": self.directory,
                "points": [asdict(point) for point in self.points]}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> MethodRun:
        return cls(row["method"], float(row["strength"]), int(row["seed"]),
                   [EvalPoint(**point) for point in row["points"]], float(row.get("wall_seconds", 0.0)),
                   row.get("directory", ""))


class HeldOutEvaluation(L.Callback):
    """Evaluates the policy on fixed held-out prompt batches every ``every`` training batches, records the
    points in ``run``, logs them as ``study/*`` and stops the fit after ``steps`` training batches.

    Args:
        run: where the points go.
        batches: held-out prompt batches as :class:`~rlhf_lightning.PromptDataModule`'s validation loader
            yields them (the same for every method of a seed).
        every: evaluate after every this many training batches (and after the last one).
        steps: training batches of the run.
        reward_adapter: the proxy reward model, loaded onto the module's base when the module has no reward
            sources of its own (DPO); modules with reward sources are scored by those.
    """

    def __init__(self, run: MethodRun, batches: Sequence[dict[str, Any]], every: int, steps: int,
                 reward_adapter: str | None = None) -> None:
        if every < 1 or steps < 1:
            raise ValueError(f"every and steps must be >= 1, got {every} and {steps}")
        self.run, self.batches, self.every, self.steps = run, list(batches), every, steps
        self.reward_adapter = reward_adapter
        self.rewards: RewardSet | None = None
        self.done = 0
        self.cpu_start = 0.0
        self.cpu_in_evaluation = 0.0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Callbacks' on_fit_start runs before the module's: DPO's reference precomputation counts as training.
        if getattr(getattr(pl_module, "policy", None), "gold_reward", None) is None:
            raise ValueError("the study needs the task's gold reward (model.init_args.gold_reward)")
        self.rewards = getattr(pl_module, "rewards", None)
        if self.rewards is None:
            if self.reward_adapter is None:
                raise ValueError(f"{type(pl_module).__name__} has no reward sources: give the study's "
                                 "reward_adapter to score its samples")
            self.rewards = RewardSet([AdapterReward(self.reward_adapter)])
            self.rewards.setup(pl_module.model, pl_module.tokenizer)
            pl_module.model.to(pl_module.device)
        self.cpu_start = time.process_time()
        self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done >= self.steps:
            self.evaluate(trainer, pl_module)
        if self.done >= self.steps:
            trainer.should_stop = True

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> EvalPoint:
        """Measure the policy now; append and log the point."""
        started = time.process_time()
        training = pl_module.training
        pl_module.eval()
        sums = {"kl": 0.0, "gold": 0.0, "proxy": 0.0}
        count = 0
        for index, batch in enumerate(self.batches):
            batch = {key: value.to(pl_module.device) if isinstance(value, torch.Tensor) else value
                     for key, value in batch.items()}
            values, rollout, texts = pl_module.held_out.sample_and_measure(batch, index, extra=False)  # scored below
            raw = batch.get("raw_prompt") or batch["prompt"]
            scores = self.rewards.combine(self.rewards.score(reward_inputs(
                rollout.input_ids, rollout.attention_mask, rollout.read_mask, texts, raw, batch.get("columns"),
                pl_module.tokenizer, pl_module.policy.sampler.settings.stop_token_ids)))
            sums["kl"] += float(values["kl"].sum())
            sums["gold"] += float(values["gold"].sum())
            sums["proxy"] += float(scores.float().sum())
            count += len(texts)
        pl_module.train(training)
        self.cpu_in_evaluation += time.process_time() - started
        point = EvalPoint(self.done, sums["kl"] / count, sums["gold"] / count, sums["proxy"] / count,
                          self.training_cpu_seconds())
        self.run.points.append(point)
        for logger in trainer.loggers:
            logger.log_metrics({"study/gold": point.gold, "study/proxy": point.proxy, "study/kl": point.kl,
                                "study/d": point.d, "study/cpu_seconds": point.cpu_seconds,
                                "study/step": point.step}, step=trainer.global_step)
        return point

    def training_cpu_seconds(self) -> float:
        """Process CPU time (every thread) since the fit started, evaluations excluded."""
        return time.process_time() - self.cpu_start - self.cpu_in_evaluation
