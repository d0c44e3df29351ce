"""Collection: a batch of prompts in, one :class:`~rlhf_lightning.core.experience.Experience` out.

One rollout (single-turn, or episodes with an ``environment``), then the passes that run once per rollout, as the
loop's :class:`~rlhf_lightning.core.pass_plan.PassPlan` says: the policy's log-probs at sampling time, the
reference's, and the reward sources' scores, with the statistics of what was sampled and the guards that keep a
non-finite score out of training. Held-out prompts go through the same rollout.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.experience import Experience, FirstPass, Samples, sampling_statistics
from rlhf_lightning.core.held_out import gold_scores
from rlhf_lightning.core.pass_plan import PassPlan, plan_passes
from rlhf_lightning.core.policy import POLICY, PolicyModule
from rlhf_lightning.environments.environment import Environment
from rlhf_lightning.models.shared_base import REFERENCE, SharedBase
from rlhf_lightning.rewards.combine import RewardSet, RewardShaping
from rlhf_lightning.rewards.inputs import RewardInputs, reward_inputs
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.rollout.ahead import Asynchronous, DrawAhead, loader_ahead
from rlhf_lightning.rollout.episodes import episode_statistics, episode_values, transcript_text
from rlhf_lightning.rollout.rollouts import Rollout, Rollouts
from rlhf_lightning.rollout.settings import Episodes
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.nonfinite import SKIP_HINT, NonFiniteError, listing, score_problems
from rlhf_lightning.utils.timing import phase

Stats = dict[str, Tensor]
log = logging.getLogger(__name__)


class SkipIteration(Exception):
    """Raised by collection under ``optimizer.nonfinite: skip`` when the iteration must not be trained on."""


class ExperienceCollector(PolicyModule):
    """The policy module that samples and scores: prompts in, :class:`Experience` out (:meth:`collect`).

    Args:
        reward: how responses are scored: ``AdapterReward`` (the reward stage's adapter on this base),
            ``ModelReward`` (a separate model), ``FunctionReward`` (a Python function with TRL's signature),
            or a list of them, summed with ``reward_shaping.weights``.
        reward_shaping: how the sources' scores become the trained score: ``weights`` of the sources,
            ``normalize`` (each by its saved mean and std), ``missing_eos_penalty``, ``clip`` (see
            :class:`~rlhf_lightning.rewards.combine.RewardShaping`).
        samples_per_prompt: responses sampled per prompt (the group size of group baselines).
        episodes: multi-turn episodes instead of one response per prompt: ``environment`` (made anew for every
            episode; null = single-turn), ``max_turns``, ``max_tokens`` (see
            :class:`~rlhf_lightning.rollout.settings.Episodes`).
        share_prompt: encode a group's prompt once in every pass after sampling (log-probs, reference, values,
            reward adapter, the update's forward) and reuse its keys/values for its responses: the same numbers up to
            rounding; rows with equal prompt tokens are found in each batch, so nothing changes where none share.
        asynchronous: drawing the rollouts of the next ``max_staleness`` iterations while the policy trains, on an
            engine that draws ahead (``VLLMServer``), and the ``rollout_timeout`` (see
            :class:`~rlhf_lightning.rollout.ahead.Asynchronous` and ``docs/async.md``); ``max_staleness: 0`` = the
            synchronous loop.
    """

    # Whether a reward source that scores steps (ProcessReward) gives each step's score at its step's last token
    # (``Experience.step_rewards``; PPO, whose critic can credit tokens) or the reduction of its steps' scores as
    # the response's score (the critic-free algorithms, as the PRM papers do).
    dense_step_rewards = False
    # per-sample validation values; the episode ones are logged only by runs with an environment
    validation_metrics = ("score", "kl", "length", "eos_frac", "gold", "turns", "tool_calls", "tool_errors",
                          "invalid_tool_calls", "reward_disagreement")

    def __init__(
        self,
        *args: Any,
        reward: RewardSource | list[RewardSource],
        reward_shaping: RewardShaping = RewardShaping(),  # noqa: B008 (frozen; the CLI shows it as the default)
        samples_per_prompt: int = 1,
        episodes: Episodes = Episodes(),  # noqa: B008 (frozen; the CLI shows it as the default)
        share_prompt: bool = True,
        asynchronous: Asynchronous = Asynchronous(),  # noqa: B008 (frozen; the CLI shows it as the default)
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.asynchronous: Asynchronous = self.keep_group("asynchronous", asynchronous, Asynchronous())
        if staleness := self.asynchronous.max_staleness:
            if refusal := self.engine.ahead_refusal(staleness):
                raise ValueError(refusal)
            self.engine.keep_versions(staleness)
        checks.at_least("samples_per_prompt", samples_per_prompt)
        self.episodes: Episodes = self.keep_group("episodes", episodes, Episodes())
        step_sources = [type(source).__name__ for source in (reward if isinstance(reward, list | tuple) else [reward])
                        if source.scores_steps]
        if self.environment is not None and step_sources:
            raise ValueError(f"reward: {step_sources[0]} scores the steps of single-turn responses, and "
                             "episodes.environment is set; drop one of them")
        self.rewards = RewardSet(reward if isinstance(reward, list | tuple) else [reward],
                                 self.keep_group("reward_shaping", reward_shaping, RewardShaping()))
        self.share_prompt = share_prompt
        self.last_samples: Samples | None = None  # the latest rollout as text (see callbacks.CompletionsTable)
        self._pass_plan: PassPlan | None = None
        self._draw_ahead: DrawAhead | None = None

    def build_model(self, empty: bool) -> SharedBase:
        model = super().build_model(empty)
        model.share_prompt = self.share_prompt
        self.rewards.setup(model, self.tokenizer)
        return model

    @property
    def environment(self) -> Callable[[], Environment] | None:
        """The episodes' environment (``episodes.environment``); None = single-turn responses."""
        return self.episodes.environment

    def make_rollouts(self) -> Rollouts:
        episodes = self.episodes
        return Rollouts(self.sampler, self.tokenizer, episodes.environment, episodes.max_turns, episodes.max_tokens)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self._pass_plan = plan_passes(self.pass_settings())  # the hyper-parameters are final
        self.rollouts  # noqa: B018 (an environment or chat template that cannot run episodes fails here)
        # A reward function that cannot take TRL's keywords or the data's columns, or cannot read a row's value of
        # one, fails now, not after a rollout.
        datamodule = self.datamodule
        examples = [*(getattr(datamodule, "train_set", None) or []), *getattr(datamodule, "val_set", [])]
        rows = [(example.where, example.columns) for example in examples if hasattr(example, "columns")]
        for source in self.rewards.sources:
            source.check_columns(getattr(datamodule, "columns", []))
            source.check_values(rows)

    def check_lengths(self, datamodule: Any) -> None:
        """With an environment, every position a turn can reach must be within the model's: the longest prompt's
        opening (the chat template's markers and the tools' schemas included) and the episode, whose last turn can
        start one token before the budget and decode ``sampling.max_new_tokens`` (see :meth:`Rollouts.positions`)."""
        if self.environment is None:
            return super().check_lengths(datamodule)
        examples = [*(datamodule.train_set or []), *datamodule.val_set]
        longest = max(examples, key=datamodule.length)
        self.check_positions(*self.rollouts.reach(longest.raw if longest.raw is not None else longest.text),
                             "lower episodes.max_tokens (null = episodes.max_turns x sampling.max_new_tokens), "
                             "sampling.max_new_tokens or data.init_args.max_length")

    @property
    def pass_plan(self) -> PassPlan:
        """Which passes every iteration runs, from :meth:`pass_settings`: made once, at setup (outside a fit, on
        first use)."""
        if self._pass_plan is None:
            self._pass_plan = plan_passes(self.pass_settings())
        return self._pass_plan

    # ---- drawing ahead ------------------------------------------------------------------------------------

    @property
    def draw_ahead(self) -> DrawAhead | None:
        """The fixed-lag schedule of ``asynchronous.max_staleness`` > 0, made at the first training rollout; None if
        synchronous."""
        settings = self.asynchronous
        if self._draw_ahead is None and settings.max_staleness and self.model is not None:
            self._draw_ahead = DrawAhead(self.rollouts, self.model, self.hparams.samples_per_prompt, self.global_rank,
                                         settings.max_staleness, settings.rollout_timeout)
        return self._draw_ahead

    def training_rollout(self, prompts: dict[str, Any], group: int) -> tuple[Rollout, Stats]:
        """The current training iteration's rollout of ``group`` responses to each prompt, with statistics: drawn
        now, or drawn ahead by the policy of ``asynchronous.max_staleness`` iterations ago (and the statistics of its
        age)."""
        if self.draw_ahead is not None:
            return self.draw_ahead.rollout(prompts, self.iteration, self.trainer.global_step,
                                           loader_ahead(self.trainer.train_dataloader), self.device)
        with phase("rollout/generate"):
            return self.rollouts.run(self.model, POLICY, prompts, group, f"train {self.iteration}"), {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.draw_ahead is not None:
            self.draw_ahead.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.draw_ahead is not None:
            self.draw_ahead.load(checkpoint, self.trainer.ckpt_path if self._trainer is not None else "the checkpoint")

    def teardown(self, stage: str) -> None:
        if self._draw_ahead is not None:
            self._draw_ahead.close()
            self._draw_ahead = None
        super().teardown(stage)

    # ---- collection ---------------------------------------------------------------------------------------

    def collect_experience(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """Step 1, without gradients and in the sharded base's gathered scope (gathered once for every pass):
        :meth:`collect` (sampling, the passes the plan names, the reward sources), then the algorithm's own passes
        (:meth:`extend_experience`)."""
        self.check_built()
        with torch.no_grad(), self.sampler.gathered_base(self.model):
            experience, stats = self.collect(prompts)
            return self.extend_experience(experience), stats

    def extend_experience(self, experience: Experience) -> Experience:
        """The algorithm's own passes over the rollout (PPO's values, a teacher's log-probs), in the rollout's
        gathered scope and without gradients; returns the experience extended (a subclass of
        :class:`Experience`). None here."""
        return experience

    def early_first_pass(self, experience: Experience) -> tuple[Experience, FirstPass | None]:
        """With :attr:`pass_plan`'s ``reuse_first_pass``: the first optimizer step's forward pass
        (:meth:`first_update_pass`), made now, with gradients, and returned for :meth:`update` to hand to that step;
        its log-probs and entropy, detached, are the rollout's. Otherwise the experience as it is, and None."""
        if not self.pass_plan.reuse_first_pass:
            return experience, None
        first_pass = self.first_update_pass(experience)
        return dataclasses.replace(experience, logprobs=first_pass.logprobs.detach(),
                                   entropy=first_pass.entropy.detach()), first_pass

    def first_update_pass(self, experience: Experience) -> FirstPass:
        """The policy's forward pass of the first optimizer step on the whole rollout, with gradients, for a loss
        that takes it (``PassSettings.reusable_first_pass``)."""
        raise NotImplementedError(f"{type(self).__name__} has no first update pass to reuse")

    def sampling_statistics(self, experience: Experience) -> Stats:
        """The statistics of the policy at sampling time (``policy/entropy``, ``objective/kl``) when the rollout's
        log-probs are known before the update (the rollout's pass or the first update pass; otherwise the update's
        own pass gives them, and its loss logs them), and the rollout's texts' sequence KL (``last_samples``)."""
        stats, kl = {}, None
        if self.pass_plan.logprobs_before_update:
            stats, kl = sampling_statistics(experience.logprobs, experience.entropy, experience.ref_logprobs,
                                            experience.response_mask)
        if self.last_samples is not None:
            kl_list = [0.0] * len(self.last_samples.responses) if kl is None else kl.tolist()
            self.last_samples = dataclasses.replace(self.last_samples, kl=kl_list)
        return stats

    @torch.no_grad()
    def collect(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """``samples_per_prompt`` responses (or episodes) to each prompt of a data module's batch, every pass over
        them made once (those the loop's :attr:`pass_plan` names), and what they show. Run without gradients inside
        the sharded base's gathered scope (``sampler.gathered_base``)."""
        group = self.hparams.samples_per_prompt
        rollout, overlap_stats = self.training_rollout(prompts, group)
        ids, attention, mask = rollout.input_ids, rollout.attention_mask, rollout.response_mask
        logprobs = entropy = ref_logprobs = None
        plan = self.pass_plan
        with phase("rollout/logprobs"):
            if plan.rollout_logprobs:
                logprobs, entropy = self.response_logprobs(POLICY, ids, attention, mask, with_entropy=True)
            if plan.reference_logprobs:
                ref_logprobs, _ = self.response_logprobs(REFERENCE, ids, attention, mask)
        texts = [text for text in prompts["prompt"] for _ in range(group)]
        completions = self.decode(rollout.responses, rollout.read_mask)
        try:
            with phase("rollout/reward"):
                source_scores, step_rewards = self.rewards.score_steps(self.reward_inputs(
                    ids, attention, rollout.read_mask, completions,
                    prompts=[p for p in prompts.get("raw_prompt", prompts["prompt"]) for _ in range(group)],
                    columns={name: [v for v in column for _ in range(group)]
                             for name, column in prompts.get("columns", {}).items()}))
        except ValueError as error:  # e.g. FunctionReward's refusal of a NaN, which names the row: add the iteration
            raise ValueError(f"iteration {self.iteration + 1}: {error}") from error
        self.guard_scores(score_problems(source_scores, self.rewards.sources)[0])
        raw_scores = self.rewards.combine(source_scores)
        if not self.dense_step_rewards:
            step_rewards = None  # the step-scoring sources' reductions are in the scores instead
        scores = self.rewards.response_scores(source_scores, rollout.is_stopped, without_steps=step_rewards is not None)
        bad = ~torch.isfinite(scores)
        self.guard_scores([f"the combined reward is non-finite for rows {listing(bad.nonzero().flatten().tolist())} "
                           f"of {bad.shape[0]} (reward_shaping.normalize statistics or reward_shaping.weights?)"]
                          if bad.any() else [])
        experience = Experience(ids, attention, mask, scores, rollout.is_stopped, rollout.sampler_logprobs, logprobs,
                                ref_logprobs, rollout.turn_rewards, group_size=group, step_rewards=step_rewards,
                                entropy=entropy)
        stats = sample_statistics(rollout, self.rewards, source_scores, raw_scores) | overlap_stats
        gold = None
        if self.gold_reward is not None:
            gold = gold_scores(self.gold_reward, prompts["prompt"], completions, prompts.get("columns"), repeat=group)
            stats["objective/gold"] = torch.tensor(gold).mean()
        if rollout.episodes is not None:
            stats.update(episode_statistics(rollout.episodes))
            completions = [transcript_text(self.tokenizer, episode) for episode in rollout.episodes]
        # the KL is set once the rollout's log-probs are known (OnlineRL.sampling_statistics)
        self.last_samples = Samples(self.iteration, texts, completions, raw_scores.tolist(), None, gold)
        return experience, stats

    def reward_inputs(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                      completions: list[str], prompts: Sequence[Any], columns: dict[str, list] | None = None
                      ) -> RewardInputs:
        """What the reward sources read of sampled responses (``rewards.score`` of them: scores ``[B, S]``, NaN where
        a source does not apply; ``prompts`` as the dataset holds them, text or messages, ``columns`` its other
        columns)."""
        return reward_inputs(input_ids, attention_mask, response_mask, completions, prompts, columns,
                             self.tokenizer, self.sampler.settings.stop_token_ids)

    def guard_scores(self, problems: list[str]) -> None:
        """Stop on non-finite scores (``problems``, one line each, possibly from another rank): raise
        :class:`NonFiniteError`, or under ``optimizer.nonfinite: skip`` raise :class:`SkipIteration`."""
        found = torch.tensor(float(bool(problems)), device=self.device)
        found = self.ranks.sum(found)  # every rank takes the same decision
        if not bool(found > 0):
            return
        message = f"iteration {self.iteration + 1}: {'; '.join(problems) or 'non-finite reward on another rank'}"
        if self.nonfinite_policy != "skip":
            raise NonFiniteError(f"{message}; {SKIP_HINT}")
        raise SkipIteration(message)

    # ---- held-out prompts ---------------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.held_out.evaluate(batch, batch_idx)

    def evaluate_extra(self, rollout: Rollout, prompts: dict[str, Any], texts: list[str]) -> dict[str, Tensor]:
        """The held-out rollout's ``score``, the reward sources' values per response and, for episodes, its
        ``turns``, ``tool_calls``, ``tool_errors`` and ``invalid_tool_calls``."""
        scores = self.rewards.score(self.reward_inputs(rollout.input_ids, rollout.attention_mask, rollout.read_mask,
                                                       texts, prompts.get("raw_prompt", prompts["prompt"]),
                                                       prompts.get("columns")))
        values = self.rewards.response_values()  # per response (an ensemble's disagreement)
        if rollout.episodes is not None:
            values.update(episode_values(rollout.episodes))
        problems, bad = score_problems(scores, self.rewards.sources)
        if problems:  # no optimizer step depends on it, but a NaN validation score must not pass unnoticed
            message = f"validation after iteration {self.iteration}: {'; '.join(problems)}"
            if self.nonfinite_policy != "skip":
                raise NonFiniteError(f"{message}; {SKIP_HINT}")
            log.warning("%s; those rows are left out of %s/val/score", message, self.metric_prefix)
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
