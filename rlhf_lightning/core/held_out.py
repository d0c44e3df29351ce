"""The evaluation of sampled responses on held-out prompts (:class:`HeldOutSamples`, the ``held_out`` part of the
policy-optimising modules, :class:`~rlhf_lightning.core.online.OnlineRL` and
:class:`~rlhf_lightning.core.offline.OfflinePreference`): one response per prompt (and more for pass@k), its KL to the
reference, length, stop rate and gold reward, and the gold reward per task where the prompts name their task."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric

from rlhf_lightning.core.experience import sequence_kl
from rlhf_lightning.core.held_out_pass_at_k import answer_reader, pass_at_k_values
from rlhf_lightning.models.shared_base import REFERENCE
from rlhf_lightning.rollout.rollouts import Rollout
from rlhf_lightning.utils.metrics import GroupMeans, MeanStd, reset_metrics

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
    """The evaluation of sampled responses on held-out prompts, held by a policy-optimising module as ``held_out``:
    one response per prompt (and ``pass_at_k.samples`` more with pass@k), its KL to the reference, length, stop
    rate and gold reward, and what the module's ``evaluate_extra`` adds (an online module's reward scores), averaged
    over the validation and logged when it ends.

    It samples with the module's ``policy`` (its sampler, turn loop and log-probabilities) and logs through the
    module; its metrics are its own (``metrics``, ``gold_spread``), which the module registers so that they move to
    its device.

    Args:
        module: the policy module evaluated.
        names: the per-sample values averaged (the module's ``validation_metrics``, and pass@k's).
        gold: whether a gold reward is measured: then its spread (``gold_std``, ``gold_count``) is logged too.
    """

    def __init__(self, module: Any, names: Sequence[str], gold: bool) -> None:
        self.module = module
        self.metrics = torch.nn.ModuleDict({name: MeanMetric() for name in names})
        # The gold's spread over the held-out responses: the scale the summary measures the gold's change in.
        self.gold_spread = MeanStd() if gold else None
        self.group_gold: GroupMeans | None = None  # the gold per task (GROUP_COLUMN), made at validation start
        self.groups: list[str] | None = None

    @torch.no_grad()
    def evaluate(self, prompts: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """One response per held-out prompt of ``prompts`` (a data module's prompt batch), sampled from evaluation
        batch ``batch_idx``'s fixed stream (training's left untouched), and its :meth:`sample_values` and the
        module's ``evaluate_extra`` added to the validation metrics."""
        values, _, _ = self.sample_and_measure(prompts, batch_idx)
        self.record_groups(values.get("gold"), (prompts.get("columns") or {}).get(GROUP_COLUMN))
        if self.module.policy.pass_at_k.enabled:
            values.update(self.sample_pass_at_k(prompts, batch_idx))
        self.record(values)
        return values

    @torch.no_grad()
    def sample_pass_at_k(self, prompts: dict[str, Any], batch_idx: int) -> dict[str, Tensor]:
        """pass@k (and maj@k, when the gold reward reads answers) per held-out prompt of ``prompts``, from
        ``pass_at_k.samples`` responses each, drawn from a stream of their own (``purpose`` ``pass_at_k``)."""
        module, policy = self.module, self.module.policy
        n = policy.pass_at_k.samples
        with policy.sampler.seeds.evaluation(batch_idx, module.global_rank, module.device, "pass_at_k"), \
                policy.sampler.gathered_base(module.model):
            rollout = policy.rollouts.run(module.model, POLICY, prompts, n, "pass_at_k")
            texts = policy.decode(rollout.responses, rollout.read_mask)
        gold = gold_scores(policy.gold_reward, prompts["prompt"], texts, prompts.get("columns"), repeat=n)
        return pass_at_k_values(policy.pass_at_k, gold, texts, answer_reader(policy.gold_reward))

    @torch.no_grad()
    def sample_and_measure(self, prompts: dict[str, Any], batch_idx: int,
                           extra: bool = True) -> tuple[dict[str, Tensor], Rollout, list[str]]:
        """The per-sample validation values of one response per prompt (evaluation batch ``batch_idx``'s stream;
        with ``seed_scope: prompt`` each prompt's own), the rollout itself and its texts (what reward sources read).
        ``extra``: with the module's ``evaluate_extra`` values (the reward sources' scores of the online modules)."""
        module, policy = self.module, self.module.policy
        policy.check_built()
        with policy.sampler.seeds.evaluation(batch_idx, module.global_rank, module.device), \
                policy.sampler.gathered_base(module.model):
            rollout = policy.rollouts.run(module.model, POLICY, prompts, 1, "validation")
            texts = policy.decode(rollout.responses, rollout.read_mask)
            values = self.sample_values(rollout, prompts["prompt"], texts, prompts.get("columns"))
            if extra:
                values.update(module.evaluate_extra(rollout, prompts, texts))
        return values, rollout, texts

    @torch.no_grad()
    def sample_values(self, rollout: Rollout, prompts: Sequence[str], texts: list[str],
                      columns: dict[str, list] | None = None) -> dict[str, Tensor]:
        """Per-sample validation values of a rollout: ``kl`` (nats, to the reference, over the policy's tokens),
        ``length``, ``eos_frac`` and ``gold`` (with a gold reward, of ``texts``: what reward sources read; the
        prompts' other ``columns`` are its keywords when it takes them, :func:`gold_scores`)."""
        policy = self.module.policy
        ids, mask, response_mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
        logprobs, _ = policy.response_logprobs(POLICY, ids, mask, response_mask)
        ref_logprobs, _ = policy.response_logprobs(REFERENCE, ids, mask, response_mask)
        values = {
            "kl": sequence_kl(logprobs, ref_logprobs, response_mask),
            "length": response_mask.sum(-1).float(),
            "eos_frac": rollout.is_stopped.float(),
        }
        if policy.gold_reward is not None:
            values["gold"] = torch.tensor(gold_scores(policy.gold_reward, prompts, texts, columns))
        return values

    def record(self, values: dict[str, Tensor]) -> None:
        """Add per-sample validation ``values`` to the metrics logged when validation ends. An empty value (a
        batch without such samples, e.g. no desirable response for KTO) adds nothing: a metric no batch fed is not
        logged, never NaN."""
        device = self.module.device
        for name, value in values.items():
            if value.numel():
                self.metrics[name].update(value.to(device))
        gold = values.get("gold")
        if gold is not None and gold.numel() and self.gold_spread is not None:
            self.gold_spread.update(gold.to(device))

    # ---- the gold reward per task ----------------------------------------------------------------------

    def validation_groups(self) -> list[str]:
        """The values of the held-out prompts' ``task`` column (:data:`GROUP_COLUMN`), sorted: the same on every
        rank, since each holds the whole held-out set (a sampler splits it later); none without such a column."""
        held_out = getattr(self.module.datamodule, "val_set", None) or []
        return sorted({str(example.columns[GROUP_COLUMN]) for example in held_out
                       if GROUP_COLUMN in getattr(example, "columns", {})})

    def start(self) -> None:
        """At validation start: the per-task gold means for the held-out set's tasks."""
        groups = self.validation_groups()
        if groups != self.groups:
            # Created outside inference mode (validate's): its states must stay updatable under fit's no_grad.
            with torch.inference_mode(False):
                self.group_gold = GroupMeans(len(groups)).to(self.module.device) if groups else None
            self.groups = groups

    def record_groups(self, gold: Tensor | None, groups: list[Any] | None) -> None:
        """Add each sample's ``gold`` to its task's mean (``groups``: each prompt's task, from its column)."""
        if gold is None or groups is None or self.group_gold is None:
            return
        index = {name: position for position, name in enumerate(self.groups)}
        rows = [(row, index[str(group)]) for row, group in enumerate(groups) if str(group) in index]
        if rows:
            device = self.module.device
            self.group_gold.update(gold[[row for row, _ in rows]].to(device),
                                   torch.tensor([position for _, position in rows], device=device))

    def log(self) -> None:
        """At validation end: log ``<prefix>/val/<name>`` of every metric fed, the gold's spread and count, and the
        gold per task; then reset them."""
        module = self.module
        prefix = module.metric_prefix
        # Already the values of every rank (torchmetrics syncs them): sync_dist averages equal values (and keeps
        # Lightning's advice to use it away).
        for name, metric in self.metrics.items():
            if metric.update_count:
                module.log(f"{prefix}/val/{name}", metric.compute(), sync_dist=True)
        reset_metrics(*self.metrics.values())
        spread = self.gold_spread
        if spread is not None and (spread.update_count or module.ranks.distributed):  # a collective on several ranks
            with warnings.catch_warnings():  # a rank that saw no sample still takes part in the sum
                warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
                module.log(f"{prefix}/val/gold_std", spread.compute()[1], sync_dist=True)
            # The samples behind the mean, summed over ranks: with the SD, the mean's error bar (plots draw it).
            module.log(f"{prefix}/val/gold_count", spread.count.float(), sync_dist=True, reduce_fx="sum")
            reset_metrics(spread)
        self.log_groups()

    def log_groups(self) -> None:
        """Log ``<prefix>/val/gold/<task>`` for each task some rank saw. Every rank computes (a collective) whether
        or not it saw any of them, so a rank without a task's prompts never leaves the others waiting."""
        module, metric = self.module, self.group_gold
        if metric is None or (not metric.update_count and not module.ranks.distributed):
            return
        with warnings.catch_warnings():  # a rank that saw no sample still takes part in the sum
            warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
            means, counts = metric.compute()
        for name, mean, count in zip(self.groups, means.tolist(), counts.tolist(), strict=True):
            if count:
                module.log(f"{module.metric_prefix}/val/gold/{name}", mean, sync_dist=True)
        reset_metrics(metric)
