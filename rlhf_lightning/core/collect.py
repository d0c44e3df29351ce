"""Collection, the online loop's first step (:class:`Collector`): a batch of prompts in, one
:class:`~rlhf_lightning.core.experience.Experience` out.

One rollout (single-turn, or episodes with an ``environment``), then the passes that run once per rollout, as the
loop's :class:`~rlhf_lightning.core.pass_plan.PassPlan` says: the policy's log-probs at sampling time, the
reference's, and the reward sources' scores, with the statistics of what was sampled and the guards that keep a
non-finite score out of training. Held-out prompts go through the same rollout.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.experience import Experience, FirstPass, Samples, sampling_statistics
from rlhf_lightning.core.held_out import POLICY, gold_scores
from rlhf_lightning.core.pass_plan import PassPlan
from rlhf_lightning.models.shared_base import REFERENCE
from rlhf_lightning.rewards.combine import RewardSet
from rlhf_lightning.rewards.inputs import RewardInputs, reward_inputs
from rlhf_lightning.rollout.ahead import Asynchronous, DrawAhead, loader_ahead
from rlhf_lightning.rollout.episodes import episode_statistics, episode_values, transcript_text
from rlhf_lightning.rollout.rollouts import Rollout
from rlhf_lightning.utils.nonfinite import SKIP_HINT, NonFiniteError, listing, score_problems
from rlhf_lightning.utils.timing import phase

OnlineModule = Any  # the online module served (rlhf_lightning.core.online.OnlineRL, which imports this module)

Stats = dict[str, Tensor]
log = logging.getLogger(__name__)


class SkipIteration(Exception):
    """Raised by collection under ``optimizer.nonfinite: skip`` when the iteration must not be trained on."""


class Collector:
    """Step 1 of the online loop, held by the module as ``collector``: a batch of prompts in, one
    :class:`Experience` out (:meth:`collect`), and the held-out rollout's scores (:meth:`held_out_values`).

    It keeps what collection carries from one iteration to the next: the reward sources, the
    :class:`~rlhf_lightning.core.pass_plan.PassPlan` (made at setup), the fixed-lag schedule of
    ``asynchronous.max_staleness`` > 0 and the latest rollout as text. The module it serves is handed to each call,
    for what the module owns: its model, sampler and rollouts, its forward passes (``response_logprobs``,
    ``first_update_pass``), its tokenizer, iteration, ranks, ``optimizer.nonfinite`` policy and
    ``dense_step_rewards`` (whether a step-scoring source's steps are credited at their tokens: PPO).

    Args:
        rewards: the reward sources and their shaping (the module's ``rewards``).
        samples_per_prompt: responses sampled per prompt (the group size of group baselines).
        asynchronous: drawing ahead: ``max_staleness`` (0 = the synchronous loop) and ``rollout_timeout``.
    """

    def __init__(self, rewards: RewardSet, samples_per_prompt: int, asynchronous: Asynchronous) -> None:
        self.rewards = rewards
        self.samples_per_prompt = samples_per_prompt
        self.asynchronous = asynchronous
        self.plan: PassPlan | None = None  # set at the module's setup (pass_plan)
        self.last_samples: Samples | None = None  # the latest rollout as text (see callbacks.CompletionsTable)
        self._draw_ahead: DrawAhead | None = None

    def check_sources(self, datamodule: Any) -> None:
        """A reward function that cannot take TRL's keywords or the data's columns, or cannot read a row's value of
        one, fails now, not after a rollout."""
        examples = [*(getattr(datamodule, "train_set", None) or []), *getattr(datamodule, "val_set", [])]
        rows = [(example.where, example.columns) for example in examples if hasattr(example, "columns")]
        for source in self.rewards.sources:
            source.check_columns(getattr(datamodule, "columns", []))
            source.check_values(rows)

    # ---- drawing ahead ------------------------------------------------------------------------------------

    def draw_ahead(self, module: OnlineModule) -> DrawAhead | None:
        """The fixed-lag schedule of ``asynchronous.max_staleness`` > 0, made at the first training rollout; None if
        synchronous."""
        settings = self.asynchronous
        if self._draw_ahead is None and settings.max_staleness and module.model is not None:
            self._draw_ahead = DrawAhead(module.policy.rollouts, module.model, self.samples_per_prompt,
                                         module.global_rank, settings.max_staleness, settings.rollout_timeout)
        return self._draw_ahead

    def training_rollout(self, module: OnlineModule, prompts: dict[str, Any]) -> tuple[Rollout, Stats]:
        """The current training iteration's rollout of ``samples_per_prompt`` responses to each prompt, with
        statistics: drawn now, or drawn ahead by the policy of ``asynchronous.max_staleness`` iterations ago (and the
        statistics of its age)."""
        if (draw_ahead := self.draw_ahead(module)) is not None:
            return draw_ahead.rollout(prompts, module.iteration, module.trainer.global_step,
                                      loader_ahead(module.trainer.train_dataloader), module.device)
        with phase("rollout/generate"):
            return module.policy.rollouts.run(module.model, POLICY, prompts, self.samples_per_prompt,
                                       f"train {module.iteration}"), {}

    def save(self, module: OnlineModule, checkpoint: dict[str, Any]) -> None:
        """Keep in ``checkpoint`` the policies that drew the rollouts not yet trained on (drawing ahead only)."""
        if (draw_ahead := self.draw_ahead(module)) is not None:
            draw_ahead.save(checkpoint)

    def load(self, module: OnlineModule, checkpoint: dict[str, Any]) -> None:
        """Take back what :meth:`save` kept (drawing ahead only; a synchronous checkpoint is refused then)."""
        if (draw_ahead := self.draw_ahead(module)) is not None:
            draw_ahead.load(checkpoint, module.trainer.ckpt_path if module._trainer is not None else "the checkpoint")

    def close(self) -> None:
        """Stop drawing ahead (the producer's thread, the versions it holds)."""
        if self._draw_ahead is not None:
            self._draw_ahead.close()
            self._draw_ahead = None

    # ---- collection ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def collect(self, module: OnlineModule, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """``samples_per_prompt`` responses (or episodes) to each prompt of a data module's batch, every pass over
        them made once (those the module's ``pass_plan`` names), and what they show. Run without gradients inside the
        sharded base's gathered scope (``sampler.gathered_base``)."""
        group = self.samples_per_prompt
        rollout, ahead_stats = self.training_rollout(module, prompts)
        ids, attention, mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
        logprobs = entropy = ref_logprobs = None
        plan = module.pass_plan  # made at setup (outside a fit, now)
        with phase("rollout/logprobs"):
            if plan.rollout_logprobs:
                logprobs, entropy = module.policy.response_logprobs(POLICY, ids, attention, mask, with_entropy=True)
            if plan.reference_logprobs:
                ref_logprobs, _ = module.policy.response_logprobs(REFERENCE, ids, attention, mask)
        texts = [text for text in prompts["prompt"] for _ in range(group)]
        completions = module.policy.decode(rollout.responses, rollout.read_mask)
        try:
            with phase("rollout/reward"):
                source_scores, step_rewards = self.rewards.score_steps(self.reward_inputs(
                    module, ids, attention, rollout.read_mask, completions,
                    prompts=[p for p in prompts.get("raw_prompt", prompts["prompt"]) for _ in range(group)],
                    columns={name: [v for v in column for _ in range(group)]
                             for name, column in prompts.get("columns", {}).items()}))
        except ValueError as error:  # e.g. FunctionReward's refusal of a NaN, which names the row: add the iteration
            raise ValueError(f"iteration {module.iteration + 1}: {error}") from error
        self.guard_scores(module, score_problems(source_scores, self.rewards.sources)[0])
        raw_scores = self.rewards.combine(source_scores)
        if not module.dense_step_rewards:
            step_rewards = None  # the step-scoring sources' reductions are in the scores instead
        scores = self.rewards.response_scores(source_scores, rollout.is_stopped, without_steps=step_rewards is not None)
        bad = ~torch.isfinite(scores)
        self.guard_scores(module, [f"the combined reward is non-finite for rows {listing(bad.nonzero().flatten().tolist())} "
                                   f"of {bad.shape[0]} (reward_shaping.normalize statistics or reward_shaping.weights?)"]
                          if bad.any() else [])
        experience = Experience(ids, attention, mask, scores, rollout.is_stopped, rollout.sampler_logprobs, logprobs,
                                ref_logprobs, rollout.turn_rewards, group_size=group, step_rewards=step_rewards,
                                entropy=entropy)
        stats = sample_statistics(rollout, self.rewards, source_scores, raw_scores) | ahead_stats
        gold = None
        if module.policy.gold_reward is not None:
            gold = gold_scores(module.policy.gold_reward, prompts["prompt"], completions, prompts.get("columns"),
                               repeat=group)
            stats["objective/gold"] = torch.tensor(gold).mean()
        if rollout.episodes is not None:
            stats.update(episode_statistics(rollout.episodes))
            completions = [transcript_text(module.tokenizer, episode) for episode in rollout.episodes]
        # the KL is set once the rollout's log-probs are known (sampling_statistics)
        self.last_samples = Samples(module.iteration, texts, completions, raw_scores.tolist(), None, gold)
        return experience, stats

    def early_first_pass(self, module: OnlineModule, experience: Experience) -> tuple[Experience, FirstPass | None]:
        """With the plan's ``reuse_first_pass``: the first optimizer step's forward pass (the module's
        ``first_update_pass``), made now, with gradients, and returned for the update to hand to that step; its
        log-probs and entropy, detached, are the rollout's. Otherwise the experience as it is, and None."""
        if not module.pass_plan.reuse_first_pass:
            return experience, None
        first_pass = module.first_update_pass(experience)
        return dataclasses.replace(experience, logprobs=first_pass.logprobs.detach(),
                                   entropy=first_pass.entropy.detach()), first_pass

    def sampling_statistics(self, experience: Experience) -> Stats:
        """After :meth:`collect` (which made the :attr:`plan`): the statistics of the policy at sampling time
        (``policy/entropy``, ``objective/kl``) when the rollout's log-probs are known before the update (the
        rollout's pass or the first update pass; otherwise the update's own pass gives them, and its loss logs them),
        and the rollout's texts' sequence KL (``last_samples``)."""
        stats, kl = {}, None
        if self.plan.logprobs_before_update:
            stats, kl = sampling_statistics(experience.logprobs, experience.entropy, experience.ref_logprobs,
                                            experience.response_mask)
        if self.last_samples is not None:
            kl_list = [0.0] * len(self.last_samples.responses) if kl is None else kl.tolist()
            self.last_samples = dataclasses.replace(self.last_samples, kl=kl_list)
        return stats

    def reward_inputs(self, module: OnlineModule, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                      completions: list[str], prompts: Sequence[Any], columns: dict[str, list] | None = None
                      ) -> RewardInputs:
        """What the reward sources read of ``module``'s sampled responses (``rewards.score`` of them: scores
        ``[B, S]``, NaN where a source does not apply; ``prompts`` as the dataset holds them, text or messages,
        ``columns`` its other columns)."""
        return reward_inputs(input_ids, attention_mask, response_mask, completions, prompts, columns,
                             module.tokenizer, module.policy.sampler.settings.stop_token_ids)

    def guard_scores(self, module: OnlineModule, problems: list[str]) -> None:
        """Stop on non-finite scores (``problems``, one line each, possibly from another rank): raise
        :class:`NonFiniteError`, or under ``optimizer.nonfinite: skip`` raise :class:`SkipIteration`."""
        found = torch.tensor(float(bool(problems)), device=module.device)
        found = module.ranks.sum(found)  # every rank takes the same decision
        if not bool(found > 0):
            return
        message = f"iteration {module.iteration + 1}: {'; '.join(problems) or 'non-finite reward on another rank'}"
        if module.nonfinite_policy != "skip":
            raise NonFiniteError(f"{message}; {SKIP_HINT}")
        raise SkipIteration(message)

    # ---- held-out prompts ---------------------------------------------------------------------------------

    def held_out_values(self, module: OnlineModule, rollout: Rollout, prompts: dict[str, Any], texts: list[str]
                        ) -> dict[str, Tensor]:
        """The held-out rollout's ``score``, the reward sources' values per response and, for episodes, its
        ``turns``, ``tool_calls``, ``tool_errors`` and ``invalid_tool_calls``."""
        scores = self.rewards.score(self.reward_inputs(module, rollout.input_ids, rollout.attention_mask,
                                                       rollout.read_mask, texts,
                                                       prompts.get("raw_prompt", prompts["prompt"]),
                                                       prompts.get("columns")))
        values = self.rewards.response_values()  # per response (an ensemble's disagreement)
        if rollout.episodes is not None:
            values.update(episode_values(rollout.episodes))
        problems, bad = score_problems(scores, self.rewards.sources)
        if problems:  # no optimizer step depends on it, but a NaN validation score must not pass unnoticed
            message = f"validation after iteration {module.iteration}: {'; '.join(problems)}"
            if module.nonfinite_policy != "skip":
                raise NonFiniteError(f"{message}; {SKIP_HINT}")
            log.warning("%s; those rows are left out of %s/val/score", message, module.metric_prefix)
            scores = scores[~bad]
        return {**values, "score": self.rewards.combine(scores)}


def sample_statistics(rollout: Rollout, rewards: RewardSet, source_scores: Tensor, raw_scores: Tensor) -> Stats:
    """What a training rollout shows: scores (per source too, and what a source counted while scoring), lengths,
    stop rate (the policy's entropy and KL at sampling time: ``OnlineRL.sampling_statistics``)."""
    mask = rollout.response_mask
    stats = {
        "objective/score": raw_scores.mean(),
        "objective/score_std": raw_scores.std() if raw_scores.numel() > 1 else torch.zeros(()),
        "response/length": mask.sum(-1).float().mean(),
        "response/eos_frac": rollout.is_stopped.float().mean(),
    }
    if len(rewards.sources) > 1:
        stats.update({f"objective/{name}": value for name, value in rewards.statistics(source_scores).items()})
    for source in rewards.sources:  # what a source counted while scoring (a judge's parse failures)
        stats.update({f"objective/{key}": value for key, value in source.batch_metrics().items()})
    return stats
