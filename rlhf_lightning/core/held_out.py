"""The evaluation of sampled responses on held-out prompts (:class:`HeldOutSamples`, a part of
:class:`~rlhf_lightning.core.policy.PolicyModule`): one response per prompt (and more for pass@k), its KL to the
reference, length, stop rate and gold reward, and the gold reward per task where the prompts name their task."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.experience import sequence_kl
from rlhf_lightning.core.held_out_pass_at_k import answer_reader, pass_at_k_values
from rlhf_lightning.models.shared_base import REFERENCE
from rlhf_lightning.rollout.rollouts import Rollout
from rlhf_lightning.utils.metrics import GroupMeans, reset_metrics

POLICY = "policy"  # the policy adapter's name (rlhf_lightning.core.policy.POLICY)
GROUP_COLUMN = "task"  # held-out prompts with this column get their gold reward logged per value: gold/<task>


def takes_columns(function: Callable[..., Any]) -> bool:
    """Whether a gold reward takes the data's columns as keywords (it has ``**kwargs``, TRL's reward signature)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin: nothing to inspect
        return False
    return any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters)


def gold_scores(gold_reward: Callable[..., Sequence[float]], prompts: Sequence[Any], completions: Sequence[str],
                columns: dict[str, list] | None = None, repeat: int = 1) -> list[float]:
    """The gold reward of each completion: ``gold_reward(prompts, completions)``, with the rows' ``columns`` as
    keywords when it takes them (a checker that reads a row's reference, e.g. reasoning-gym's entry); ``repeat``
    consecutive completions per prompt and row of ``columns``."""
    prompts = [prompt for prompt in prompts for _ in range(repeat)]
    if columns and takes_columns(gold_reward):
        repeated = {name: [value for value in values for _ in range(repeat)] for name, values in columns.items()}
        return [float(score) for score in gold_reward(prompts, list(completions), **repeated)]
    return [float(score) for score in gold_reward(prompts, list(completions))]


class HeldOutSamples:
    """The evaluation of sampled responses on held-out prompts, a part of :class:`PolicyModule`: one response per
    prompt (and ``pass_at_k.samples`` more with pass@k), its KL to the reference, length, stop rate and gold reward,
    added to the validation metrics (``val_metrics``) and logged when validation ends."""

    @torch.no_grad()
    def evaluate_samples(self, prompts: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """One response per held-out prompt of ``prompts`` (a data module's prompt batch), sampled from evaluation
        batch ``batch_idx``'s fixed stream (training's left untouched), and its :meth:`sample_values` and
        :meth:`evaluate_extra` added to the validation metrics."""
        values, _, _ = self.sample_and_measure(prompts, batch_idx)
        self.record_groups(values.get("gold"), (prompts.get("columns") or {}).get(GROUP_COLUMN))
        if self.pass_at_k.enabled:
            values.update(self.sample_pass_at_k(prompts, batch_idx))
        self.record_validation(values)
        return values

    @torch.no_grad()
    def sample_pass_at_k(self, prompts: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """pass@k (and maj@k, when the gold reward reads answers) per held-out prompt of ``prompts``, from
        ``pass_at_k.samples`` responses each, drawn from a stream of their own (``purpose`` ``pass_at_k``)."""
        n = self.pass_at_k.samples
        with self.sampler.seeds.evaluation(batch_idx, self.global_rank, self.device, "pass_at_k"), \
                self.sampler.gathered_base(self.model):
            rollout = self.rollouts.run(self.model, POLICY, prompts, n, "pass_at_k")
            texts = self.decode(rollout.responses, rollout.read_mask)
        gold = gold_scores(self.gold_reward, prompts["prompt"], texts, prompts.get("columns"), repeat=n)
        return pass_at_k_values(self.pass_at_k, gold, texts, answer_reader(self.gold_reward))

    @torch.no_grad()
    def sample_and_measure(self, prompts: dict[str, Any], batch_idx: int,
                           extra: bool = True) -> tuple[dict[str, Tensor], Rollout, list[str]]:
        """The per-sample validation values of one response per prompt (evaluation batch ``batch_idx``'s stream;
        with ``seed_scope: prompt`` each prompt's own), the rollout itself and its texts (what reward sources read).
        ``extra``: with :meth:`evaluate_extra`'s values (the reward sources' scores of the online modules)."""
        self.check_built()
        with self.sampler.seeds.evaluation(batch_idx, self.global_rank, self.device), \
                self.sampler.gathered_base(self.model):
            rollout = self.rollouts.run(self.model, POLICY, prompts, 1, "validation")
            texts = self.decode(rollout.responses, rollout.read_mask)
            values = self.sample_values(rollout, prompts["prompt"], texts, prompts.get("columns"))
            if extra:
                values.update(self.evaluate_extra(rollout, prompts, texts))
        return values, rollout, texts

    @torch.no_grad()
    def sample_values(self, rollout: Rollout, prompts: Sequence[str], texts: list[str],
                      columns: dict[str, list] | None = None) -> dict[str, Tensor]:
        """Per-sample validation values of a rollout: ``kl`` (nats, to the reference, over the policy's tokens),
        ``length``, ``eos_frac`` and ``gold`` (with a gold reward, of ``texts``: what reward sources read; the
        prompts' other ``columns`` are its keywords when it takes them, :func:`gold_scores`)."""
        ids, mask, response_mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
        logprobs, _ = self.response_logprobs(POLICY, ids, mask, response_mask)
        ref_logprobs, _ = self.response_logprobs(REFERENCE, ids, mask, response_mask)
        values = {
            "kl": sequence_kl(logprobs, ref_logprobs, response_mask),
            "length": response_mask.sum(-1).float(),
            "eos_frac": rollout.is_stopped.float(),
        }
        if self.gold_reward is not None:
            values["gold"] = torch.tensor(gold_scores(self.gold_reward, prompts, texts, columns))
        return values

    def evaluate_extra(self, rollout: Rollout, prompts: dict[str, Any], texts: list[str]) -> dict[str, Tensor]:
        """More per-sample validation values of a held-out rollout (``validation_metrics`` must name them); none
        here."""
        return {}

    def record_validation(self, values: dict[str, Tensor]) -> None:
        """Add per-sample validation ``values`` to the metrics logged when validation ends. An empty value (a
        batch without such samples, e.g. no desirable response for KTO) adds nothing: a metric no batch fed is not
        logged, never NaN."""
        for name, value in values.items():
            if value.numel():
                self.val_metrics[name].update(value.to(self.device))
        gold, spread = values.get("gold"), getattr(self, "val_gold_spread", None)
        if gold is not None and gold.numel() and spread is not None:
            spread.update(gold.to(self.device))

    # ---- the gold reward per task ----------------------------------------------------------------------

    def validation_groups(self) -> list[str]:
        """The values of the held-out prompts' ``task`` column (:data:`GROUP_COLUMN`), sorted: the same on every
        rank, since each holds the whole held-out set (a sampler splits it later); none without such a column."""
        held_out = getattr(self.datamodule, "val_set", None) or []
        return sorted({str(example.columns[GROUP_COLUMN]) for example in held_out
                       if GROUP_COLUMN in getattr(example, "columns", {})})

    def on_validation_epoch_start(self) -> None:
        groups = self.validation_groups()
        if groups != getattr(self, "_groups", None):
            # Created outside inference mode (validate's): its states must stay updatable under fit's no_grad.
            with torch.inference_mode(False):
                self.group_gold = GroupMeans(len(groups)).to(self.device) if groups else None
            self._groups = groups
        super().on_validation_epoch_start()

    def record_groups(self, gold: Tensor | None, groups: list[Any] | None) -> None:
        """Add each sample's ``gold`` to its task's mean (``groups``: each prompt's task, from its column)."""
        if gold is None or groups is None or getattr(self, "group_gold", None) is None:
            return
        index = {name: position for position, name in enumerate(self._groups)}
        rows = [(row, index[str(group)]) for row, group in enumerate(groups) if str(group) in index]
        if rows:
            self.group_gold.update(gold[[row for row, _ in rows]].to(self.device),
                                   torch.tensor([position for _, position in rows], device=self.device))

    def on_validation_epoch_end(self) -> None:
        # Already the values of every rank (torchmetrics syncs them): sync_dist averages equal values (and keeps
        # Lightning's advice to use it away).
        for name, metric in self.val_metrics.items():
            if metric.update_count:
                self.log(f"{self.metric_prefix}/val/{name}", metric.compute(), sync_dist=True)
        reset_metrics(*self.val_metrics.values())
        spread = getattr(self, "val_gold_spread", None)
        if spread is not None and (spread.update_count or self.is_distributed):  # a collective under several ranks
            with warnings.catch_warnings():  # a rank that saw no sample still takes part in the sum
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                self.log(f"{self.metric_prefix}/val/gold_std", spread.compute()[1], sync_dist=True)
            # The samples behind the mean, summed over ranks: with the SD, the mean's error bar (plots draw it).
            self.log(f"{self.metric_prefix}/val/gold_count", spread.count.float(), sync_dist=True, reduce_fx="sum")
            reset_metrics(spread)
        self.log_groups()
        super().on_validation_epoch_end()

    def log_groups(self) -> None:
        """Log ``<prefix>/val/gold/<task>`` for each task some rank saw. Every rank computes (a collective) whether
        or not it saw any of them, so a rank without a task's prompts never leaves the others waiting."""
        metric = getattr(self, "group_gold", None)
        if metric is None or (not metric.update_count and not self.is_distributed):
            return
        with warnings.catch_warnings():  # a rank that saw no sample still takes part in the sum
            warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
            means, counts = metric.compute()
        for name, mean, count in zip(self._groups, means.tolist(), counts.tolist(), strict=True):
            if count:
                self.log(f"{self.metric_prefix}/val/gold/{name}", mean, sync_dist=True)
        reset_metrics(metric)
