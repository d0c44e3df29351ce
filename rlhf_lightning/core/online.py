"""On-policy RL of a causal LM on one frozen base: the loop that PPO, GRPO, RLOO and REINFORCE++ share.

One ``training_step`` is one iteration on a batch of prompts, four steps read top to bottom:

1. **sample** ``samples_per_prompt`` responses per prompt from the policy and **make experience** once (eval
   mode, no grad): old log-probs (when the update makes more than one optimizer step), reference log-probs
   (when a KL term needs them), scores from the reward sources;
2. :meth:`estimate_advantages`: the algorithm (GAE, group baselines, return-to-go...), given the KL
   coefficient in the rewards;
3. :meth:`update`: ``epochs`` passes over shuffled minibatches of micro-batches: clipped surrogate (token or
   sequence ratio, clip-higher), the KL term at the coefficient in the loss, entropy bonus, PPO-ptx; gradient
   clipping, optimizer step, optional target-KL stop.

The loop knows no algorithm: PPO adds its critic by overriding :meth:`make_experience` (the values),
:meth:`micro_step` and :meth:`losses` (the value loss); the critic-free family only defines
:meth:`estimate_advantages`.

Experience is never modified during the update. The loss of an optimizer step is normalised over the whole
step (every micro-batch and rank), so micro-batches of unequal token counts weigh what they would in one batch.

Manual optimization: ``trainer.global_step`` counts optimizer steps (iterations x epochs x num_minibatches, fewer
when ``target_kl`` stops the epochs early). Metrics are logged per iteration (training batch); bound a run with
``trainer.max_epochs`` over the prompt set or ``trainer.limit_train_batches``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_penalty,
    masked_mean,
)
from rlhf_lightning.algorithms.rollout_correction import (
    CORRECTIONS,
    RolloutCorrection,
    correction_weights,
    mismatch_statistics,
)
from rlhf_lightning.algorithms.surrogate import (
    LossAggregation,
    aggregate_loss,
    cispo_surrogate,
    clipped_surrogate,
    log_importance_ratio,
    loss_normaliser,
)
from rlhf_lightning.core.episodes import EpisodeSampling
from rlhf_lightning.core.policy import POLICY, PolicyModule, derive_seed
from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.episodes.environment import Environment
from rlhf_lightning.episodes.rollout import episode_statistics
from rlhf_lightning.models.sharding import full_tensor
from rlhf_lightning.models.shared_base import REFERENCE, SharedBase
from rlhf_lightning.optim import Schedule
from rlhf_lightning.rollout.experience import Experience, Samples, sequence_kl
from rlhf_lightning.rollout.generate import stopped
from rlhf_lightning.rollout.rewards import RewardSet, RewardSource, reward_inputs
from rlhf_lightning.timing import phase
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.nonfinite import (
    SKIP_HINT,
    NonFinite,
    NonFiniteError,
    listing,
    score_problems,
)

Stats = dict[str, Tensor]
log = logging.getLogger(__name__)


class SkipIteration(Exception):
    """Raised inside the rollout under ``nonfinite: skip`` when the iteration must not be trained on."""


class OnlineRL(EpisodeSampling, PolicyModule):
    """The on-policy loop shared by PPO, GRPO, RLOO and REINFORCE++; subclasses choose the advantages.

    Args:
        reward: how responses are scored: ``AdapterReward`` (the reward stage's adapter on this base),
            ``ModelReward`` (a separate model), ``FunctionReward`` (a Python function with TRL's signature),
            or a list of them, summed with ``reward_weights``.
        reward_weights: weight of each reward source; null = 1 each.
        samples_per_prompt: responses sampled per prompt (the group size of group baselines).
        missing_eos_penalty: subtracted from the score of a response that never emits the stop token; null = off.
        mask_truncated_completions: responses that never stop carry no loss (DAPO): a cut-off answer is no
            evidence for or against its tokens.
        reward_normalize: standardise each reward model's scores with its validation mean and std (saved by the
            reward stage).
        reward_clip: clip scores to [-reward_clip, reward_clip]; null = off.
        kl_coef: coefficient of the KL penalty to the reference (the initial one when ``kl_target`` is set);
            0 with no ``kl_target`` = no reference pass at all.
        kl_estimator: per-token KL estimator: ``k1`` (log-ratio), ``k2`` or ``k3`` (Schulman).
        kl_clamp: clamp every per-token KL estimate to [-kl_clamp, kl_clamp], as OpenRLHF does with 10 (it biases
            the estimate where the policy has moved far from the reference); null = off.
        kl_in: where the KL penalty goes: ``reward`` (shaped into the rewards before the advantages) or
            ``loss`` (a per-token term of the loss, GRPO's way).
        kl_ratio_weighting: with ``kl_in: loss``, weight each token's KL term by the importance ratio (TRL
            1.16's bias correction: the tokens were sampled from the old policy).
        kl_target: target KL per sequence (nats) of the adaptive controller; null = fixed ``kl_coef``.
        kl_horizon: horizon of the adaptive controller, in samples.
        epochs: passes over each rollout batch.
        num_minibatches: minibatches, hence optimizer steps, per pass.
        gradient_accumulation: micro-batches per minibatch (less memory; same result).
        clip_range: epsilon of the clipped objective below 1 (and above, unless ``clip_range_high``).
        clip_range_high: epsilon above 1 (DAPO's clip-higher, e.g. 0.28); null = ``clip_range``.
        policy_loss: ``clip``: PPO's clipped surrogate (with ``clip_range``, ``clip_range_high``); ``cispo``:
            CISPO's clipped, detached importance weight times the log-prob (MiniMax-M1; TRL's ``loss_type:
            cispo``), every token keeping its gradient.
        cispo_max_weight: CISPO's cap on the importance weight (TRL's ``epsilon_high`` under ``cispo``, 5.0 as
            ScaleRL recommends).
        cispo_min_weight: CISPO's floor on the importance weight; null = none (TRL's).
        rollout_correction: importance-sampling correction of the sampler's log-probs against the trainer's (another
            precision or kernel, a stale policy): each token's policy loss times w = pi_trainer / pi_sampler per
            token or per response, truncated to [``rollout_correction_min``, ``rollout_correction_max``]
            (``*_truncate``, TIS) or zero outside it (``*_mask``, MIS), TRL 1.16's ``vllm_importance_sampling_mode``
            names; ``none`` = off. The mismatch is logged either way (``rollout/mismatch_kl``).
        rollout_correction_min: lower bound of the correction's weight; null = none.
        rollout_correction_max: upper bound of the correction's weight (TRL's 3.0); null = none.
        ratio_level: ``token`` ratios (PPO, GRPO); one ``sequence`` ratio per response, the geometric mean of
            its token ratios (GSPO); or ``sequence_sum``, the product of its token ratios (TRL's RLOO).
        loss_aggregation: ``token_mean`` over every token of the optimizer step (DAPO, verl, OpenRLHF);
            ``sequence_mean`` of per-response token means (the original GRPO); ``constant``: token sum divided
            by responses x ``max_new_tokens`` (Dr. GRPO).
        ent_coef: weight of the entropy bonus.
        ptx_coef: weight of the pretraining loss (PPO-ptx) on the data module's ``ptx`` batches; 0 = off.
        target_kl: stop an iteration's epochs once a minibatch's approximate KL exceeds this; null = never.
        max_grad_norm: clip the gradient norm to this; null = off.
        policy_lr: learning rate of the policy adapter.
        adam_eps: Adam's epsilon (lm-human-preferences used 1e-5).
        weight_decay: AdamW weight decay.
        warmup_iterations: iterations of linear learning-rate warm-up.
        lr_schedule: decay after warm-up over the run's iterations: ``constant``, ``linear`` or ``cosine``.
        nonfinite: what a NaN or infinite reward score, loss or gradient does: ``raise`` stops the run with a
            message naming the iteration and the reward source and rows, the loss term or the parameters;
            ``skip`` skips the optimizer step (all of the iteration's steps for a bad score) and counts it in
            ``<prefix>/skipped_steps``. Either way nothing non-finite is trained on or written.
        environment: multi-turn episodes instead of one response per prompt: the episode's environment
            (``class_path`` + ``init_args``, made anew for every episode), e.g.
            ``rlhf_lightning.episodes.ToolEnvironment`` with ``tools: [my_tools.search]``. Each assistant turn
            (up to ``max_new_tokens``) ends at the turn-end token; the environment answers; its tokens are
            context only. Reward sources score the whole transcript; null = single-turn.
        max_turns: assistant turns per episode at most.
        max_episode_tokens: tokens per episode after its opening (the policy's and the environment's) at most;
            null = ``max_turns`` x ``max_new_tokens``.
    """

    metric_prefix = "online"
    # Compute the reference log-probs, hence log the KL, even when no KL term needs them (PPO always has; the
    # critic-free algorithms skip that pass at kl_coef 0, as TRL's GRPO does).
    measure_kl = False
    # Losses normalised over the whole optimizer step: their micro-batch parts add up to the step's loss.
    STEP_LOSSES = frozenset({"loss/policy", "loss/total"})
    # Consecutive rows that minibatches and micro-batches never split (a pair of online DPO).
    rows_kept_together = 1
    # per-sample validation values; the episode ones are logged only by runs with an environment
    validation_metrics = ("score", "kl", "length", "eos_frac", "gold", "turns", "tool_calls", "tool_errors",
                          "invalid_tool_calls")

    def __init__(
        self,
        *args: Any,
        reward: RewardSource | list[RewardSource],
        reward_weights: list[float] | None = None,
        samples_per_prompt: int = 1,
        missing_eos_penalty: float | None = None,
        mask_truncated_completions: bool = False,
        reward_normalize: bool = False,
        reward_clip: float | None = None,
        kl_coef: float = 0.05,
        kl_estimator: KLEstimator = "k1",
        kl_clamp: float | None = None,
        kl_in: Literal["reward", "loss"] = "reward",
        kl_ratio_weighting: bool = True,
        kl_target: float | None = None,
        kl_horizon: int = 10_000,
        epochs: int = 1,
        num_minibatches: int = 1,
        gradient_accumulation: int = 1,
        clip_range: float = 0.2,
        clip_range_high: float | None = None,
        policy_loss: Literal["clip", "cispo"] = "clip",
        rollout_correction: RolloutCorrection = "none",
        rollout_correction_min: float | None = None,
        rollout_correction_max: float | None = 3.0,
        cispo_max_weight: float = 5.0,
        cispo_min_weight: float | None = None,
        ratio_level: Literal["token", "sequence", "sequence_sum"] = "token",
        loss_aggregation: LossAggregation = "token_mean",
        ent_coef: float = 0.0,
        ptx_coef: float = 0.0,
        target_kl: float | None = None,
        max_grad_norm: float | None = 1.0,
        policy_lr: float = 1e-4,
        adam_eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_iterations: int = 0,
        lr_schedule: Schedule = "constant",
        nonfinite: NonFinite = "raise",
        environment: Callable[[], Environment] | None = None,
        max_turns: int = 4,
        max_episode_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        hp = self.hparams
        if hp.top_k or hp.top_p < 1.0:
            raise ValueError(
                "top_k/top_p: the losses and the KL use log-probs of the full distribution (at the temperature), "
                "so sampling from a truncated one would make every ratio and KL wrong; set top_k: 0, top_p: 1.0"
            )
        counts = {"samples_per_prompt": samples_per_prompt, "epochs": epochs, "num_minibatches": num_minibatches,
                  "gradient_accumulation": gradient_accumulation, "kl_horizon": kl_horizon, "max_turns": max_turns}
        for name, value in counts.items():
            checks.at_least(name, value)
        checks.at_least("warmup_iterations", warmup_iterations, minimum=0)
        for name, value in {"kl_coef": kl_coef, "clip_range": clip_range, "ent_coef": ent_coef, "ptx_coef": ptx_coef,
                            "weight_decay": weight_decay}.items():
            checks.non_negative(name, value)
        for name, value in {"clip_range_high": clip_range_high, "missing_eos_penalty": missing_eos_penalty}.items():
            checks.non_negative(name, value, optional=True)
        for name, value in {"reward_clip": reward_clip, "kl_target": kl_target, "target_kl": target_kl,
                            "max_grad_norm": max_grad_norm, "kl_clamp": kl_clamp}.items():
            checks.positive(name, value, optional=True)
        if clip_range_high is not None and clip_range_high < clip_range:
            raise ValueError(f"clip_range_high={clip_range_high} is below clip_range={clip_range}: the upper bound of "
                             "the clip would be tighter than the lower one; clip-higher (DAPO) raises it, e.g. "
                             "clip_range 0.2 with clip_range_high 0.28 (null = the same as clip_range)")
        checks.positive("policy_lr", policy_lr)
        checks.positive("max_episode_tokens", max_episode_tokens, optional=True)
        checks.positive("adam_eps", adam_eps)
        for index, weight in enumerate(reward_weights or []):
            checks.finite(f"reward_weights[{index}]", weight)
        checks.one_of("kl_estimator", kl_estimator, get_args(KLEstimator))
        checks.one_of("kl_in", kl_in, ("reward", "loss"))
        checks.one_of("ratio_level", ratio_level, ("token", "sequence", "sequence_sum"))
        checks.one_of("policy_loss", policy_loss, ("clip", "cispo"))
        checks.one_of("rollout_correction", rollout_correction, CORRECTIONS)
        checks.non_negative("rollout_correction_min", rollout_correction_min, optional=True)
        checks.positive("rollout_correction_max", rollout_correction_max, optional=True)
        checks.positive("cispo_max_weight", cispo_max_weight)
        checks.non_negative("cispo_min_weight", cispo_min_weight, optional=True)
        if cispo_min_weight is not None and cispo_min_weight >= cispo_max_weight:
            raise ValueError(f"cispo_min_weight={cispo_min_weight} must be below cispo_max_weight={cispo_max_weight}")
        checks.one_of("loss_aggregation", loss_aggregation, get_args(LossAggregation))
        checks.one_of("lr_schedule", lr_schedule, get_args(Schedule))
        checks.one_of("nonfinite", nonfinite, get_args(NonFinite))
        if mask_truncated_completions and checks.optional_str(hp.stop_token) is None:
            raise ValueError("mask_truncated_completions needs a stop_token: without one no response ever stops, "
                             "so every response would be masked and nothing would train")
        self.automatic_optimization = False
        self.rewards = RewardSet(reward if isinstance(reward, list | tuple) else [reward], reward_weights)
        self.kl_controller = (FixedKLController(kl_coef) if kl_target is None
                              else AdaptiveKLController(kl_coef, kl_target, kl_horizon))
        self.last_samples: Samples | None = None  # the latest rollout as text (see callbacks.CompletionsTable)
        self.environment = environment

    def build_model(self, empty: bool) -> SharedBase:
        model = super().build_model(empty)
        self.rewards.setup(model, self.tokenizer, normalize=self.hparams.reward_normalize)
        return model

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.environment is not None:
            self.setup_episodes()
        # The rollout's split into minibatches is known once the data module is: checked before the first
        # rollout, not after it (minutes on a real model).
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        batch_size = getattr(datamodule, "batch_size", None)
        if stage == "fit" and isinstance(batch_size, int):
            self.minibatch_sizes(batch_size * self.hparams.samples_per_prompt,
                                 f"data.init_args.batch_size={batch_size} prompts x samples_per_prompt="
                                 f"{self.hparams.samples_per_prompt}")
        # A reward function that cannot take TRL's keywords or the data's columns fails now, not after a rollout.
        for source in self.rewards.sources:
            source.check_columns(getattr(datamodule, "columns", []))
        ptx = getattr(datamodule, "ptx", None)
        if ptx is not None and ptx.train_set is not None:
            self.check_positions(ptx.longest(), "the longest pretraining (ptx) example",
                                 "lower data.init_args.ptx_max_length (longer examples are then skipped)")

    # ---- the iteration ------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        torch.manual_seed(derive_seed(self.hparams.seed, "train", self.iteration, self.global_rank))
        # This iteration's KL coefficient where the KL goes (the adaptive controller moves it after the iteration).
        reward_kl_coef, loss_kl_coef = self.kl_coef_in("reward"), self.kl_coef_in("loss")
        try:
            experience, stats = self.rollout(batch["prompts"], reward_kl_coef)  # 1. experience; 2. advantages
        except SkipIteration:
            self.skip_iteration()
            return
        rollout_seconds = time.perf_counter() - start
        stats.update(self.update(experience, batch.get("ptx"), loss_kl_coef))  # 3. update
        self.end_iteration(experience, stats, start, rollout_seconds)  # 4. bookkeeping

    def kl_coef_in(self, place: Literal["reward", "loss"]) -> float:
        """The current KL coefficient if the KL penalty goes into ``place`` (``kl_in``), else 0."""
        return self.kl_controller.value if self.hparams.kl_in == place else 0.0

    @torch.no_grad()
    def rollout(self, prompts: dict[str, Any], reward_kl_coef: float | None = None) -> tuple[Experience, Stats]:
        """Steps 1 and 2 on a batch of prompts: the experience with its advantages, and its statistics.
        ``reward_kl_coef``: the KL coefficient in the rewards; null = the current one (``kl_coef_in("reward")``)."""
        if reward_kl_coef is None:
            reward_kl_coef = self.kl_coef_in("reward")
        with self.rollout_gathered():  # a sharded base stays gathered for the whole rollout (sharded_rollout)
            experience, stats = self.make_experience(prompts)
        experience, advantage_stats = self.estimate_advantages(experience, reward_kl_coef)
        return experience, {**stats, **advantage_stats}

    # ---- 1. experience ------------------------------------------------------------------------------------

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps made on one rollout (before any target-KL stop)."""
        return self.hparams.epochs * self.hparams.num_minibatches

    @property
    def needs_reference(self) -> bool:
        """Whether the reference log-probs are computed: when a KL term (or the adaptive controller) needs them,
        or always with ``measure_kl``."""
        return self.measure_kl or self.kl_controller.value > 0 or self.hparams.kl_target is not None

    @torch.no_grad()
    def make_experience(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """Sample ``samples_per_prompt`` responses per prompt and run every scoring pass once."""
        group = self.hparams.samples_per_prompt
        episodes = turn_rewards = None
        with phase("rollout/generate"):
            if self.environment is None:
                input_ids, attention_mask, response_mask, sampler_logprobs = self.generate(
                    prompts["input_ids"], prompts["attention_mask"], group=group, with_logprobs=True,
                    seeds=self.row_seeds(f"train {self.iteration}", prompts.get("index"), group))
            else:  # response_mask: the policy's tokens; the environment's sit between them
                episodes = self.sample_episodes(prompts, group, f"train {self.iteration}")
                input_ids, attention_mask, response_mask = (episodes.input_ids, episodes.attention_mask,
                                                            episodes.policy_mask)
                turn_rewards, sampler_logprobs = episodes.turn_rewards, episodes.sampler_logprobs
        responses = input_ids[:, input_ids.shape[1] - response_mask.shape[1]:]
        # What reward sources read: every response token, or every token of an episode after its opening.
        read_mask = response_mask if episodes is None else self.episode_mask(episodes)
        logprobs = entropy = ref_logprobs = None
        kl_in_reward = self.needs_reference and self.hparams.kl_in == "reward"
        with phase("rollout/logprobs"):
            if self.steps_per_rollout > 1 or kl_in_reward:
                logprobs, entropy = self.response_logprobs(POLICY, input_ids, attention_mask, response_mask,
                                                           with_entropy=True)
            if self.needs_reference:
                ref_logprobs, _ = self.response_logprobs(REFERENCE, input_ids, attention_mask, response_mask)
        texts = [text for text in prompts["prompt"] for _ in range(group)]
        completions = self.decode(responses, read_mask)
        try:
            with phase("rollout/reward"):
                source_scores = self.score_responses(
                    input_ids, attention_mask, read_mask, completions,
                    prompts=[p for p in prompts.get("raw_prompt", prompts["prompt"]) for _ in range(group)],
                    columns={name: [v for v in column for _ in range(group)]
                             for name, column in prompts.get("columns", {}).items()})
        except ValueError as error:  # e.g. FunctionReward's refusal of a NaN, which names the row: add when
            raise ValueError(f"iteration {self.iteration + 1}: {error}") from error
        self.guard_scores(score_problems(source_scores, self.rewards.sources)[0])
        raw_scores = self.rewards.combine(source_scores)
        is_stopped = stopped(responses, response_mask, self.sampling.stop_token_ids)
        scores = self.process_scores(source_scores, is_stopped)
        if turn_rewards is not None:
            scores = scores + turn_rewards.sum(-1)
        bad = ~torch.isfinite(scores)
        self.guard_scores([f"the combined reward is non-finite for rows {listing(bad.nonzero().flatten().tolist())} "
                           f"of {bad.shape[0]} (reward_normalize statistics or reward_weights?)"] if bad.any() else [])
        experience = Experience(input_ids, attention_mask, response_mask, scores, logprobs, ref_logprobs,
                                group_size=group, turn_rewards=turn_rewards, sampler_logprobs=sampler_logprobs)
        kl = None if logprobs is None or ref_logprobs is None else sequence_kl(logprobs, ref_logprobs, response_mask)
        stats = self.experience_stats(experience, source_scores, raw_scores, is_stopped, entropy, kl)
        gold = None
        if self.gold_reward is not None:
            gold = [float(g) for g in self.gold_reward(texts, completions)]
            stats["objective/gold"] = torch.tensor(gold).mean()
        if episodes is not None:
            stats.update(episode_statistics(episodes.episodes))
            completions = self.transcripts(episodes)
        self.last_samples = Samples(self.iteration, texts, completions, raw_scores.tolist(),
                                    [0.0] * len(completions) if kl is None else kl.tolist(), gold)
        return experience, stats

    def guard_scores(self, problems: list[str]) -> None:
        """Stop on non-finite scores (``problems``, one line each, possibly from another rank): raise
        :class:`NonFiniteError`, or under ``nonfinite: skip`` raise :class:`SkipIteration`."""
        found = torch.tensor(float(bool(problems)), device=self.device)
        if self._trainer is not None and self.trainer.world_size > 1:  # every rank takes the same decision
            found = self.trainer.strategy.reduce(found, reduce_op="sum")
        if not bool(found > 0):
            return
        message = f"iteration {self.iteration + 1}: {'; '.join(problems) or 'non-finite reward on another rank'}"
        if self.nonfinite_policy != "skip":
            raise NonFiniteError(f"{message}; {SKIP_HINT}")
        log.warning("%s; the iteration's %d optimizer steps are skipped (nonfinite: skip)", message,
                    self.steps_per_rollout)
        raise SkipIteration(message)

    def skip_iteration(self) -> None:
        """Bookkeeping of an iteration not trained on: its optimizer steps counted as skipped, the learning-rate
        schedule advanced as after any iteration, the count logged."""
        self.skip_step(self.steps_per_rollout)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.log_dict({f"{self.metric_prefix}/skipped_steps": float(self.skipped_steps),
                       f"{self.metric_prefix}/iteration": float(self.iteration + 1)}, sync_dist=True)

    def score_responses(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                        completions: list[str], prompts: Sequence[Any],
                        columns: dict[str, list] | None = None) -> Tensor:
        """Scores ``[B, S]`` of sampled responses by every reward source (NaN where a source does not apply).

        ``prompts`` are the prompts as the dataset holds them (text or messages), ``columns`` its other columns.
        """
        return self.rewards.score(reward_inputs(input_ids, attention_mask, response_mask, completions, prompts,
                                                columns, self.tokenizer, self.sampling.stop_token_ids))

    def process_scores(self, source_scores: Tensor, is_stopped: Tensor) -> Tensor:
        """Sequence rewards ``[B]``: each source normalised (``reward_normalize``), weighted and summed, then a
        penalty for responses that never stop, then clipping."""
        hp = self.hparams
        scores = self.rewards.combine(self.rewards.normalize(source_scores) if hp.reward_normalize
                                      else source_scores)
        if hp.missing_eos_penalty is not None:
            scores = scores - hp.missing_eos_penalty * (~is_stopped).float()
        if hp.reward_clip is not None:
            scores = scores.clamp(-hp.reward_clip, hp.reward_clip)
        return scores

    def experience_stats(self, experience: Experience, source_scores: Tensor, raw_scores: Tensor,
                         is_stopped: Tensor, entropy: Tensor | None, kl: Tensor | None) -> Stats:
        """What the rollout shows: scores (per source too), KL (``kl``, per sequence), lengths, stop rate,
        entropy."""
        mask = experience.response_mask
        stats = {
            "objective/score": raw_scores.mean(),
            "objective/score_std": raw_scores.std() if raw_scores.numel() > 1 else torch.zeros(()),
            "objective/kl_coef": torch.tensor(self.kl_controller.value),
            "response/length": mask.sum(-1).float().mean(),
            "response/eos_frac": is_stopped.float().mean(),
        }
        if len(self.rewards.sources) > 1:
            stats.update({f"objective/{name}": value for name, value in self.rewards.statistics(source_scores).items()})
        if kl is not None:
            stats["objective/kl"] = kl.mean()
        if entropy is not None:
            stats["policy/entropy"] = masked_mean(entropy, mask)
        return stats

    # ---- 2. advantages ------------------------------------------------------------------------------------

    def estimate_advantages(self, experience: Experience, kl_coef: float) -> tuple[Experience, Stats]:
        """The experience with its advantages (and returns, with a critic), and statistics: the algorithm.
        ``kl_coef``: this iteration's coefficient of the KL penalty in the rewards (0 when it goes into the loss);
        the per-token KL is ``kl_penalty(experience.logprobs, experience.ref_logprobs, kl_estimator, kl_clamp)``."""
        raise NotImplementedError

    # ---- 3. update ----------------------------------------------------------------------------------------

    def update(self, experience: Experience, ptx: dict[str, Tensor] | None, kl_coef: float) -> Stats:
        """``epochs`` passes of minibatch updates; ``kl_coef``: the KL term's coefficient in the loss (0 = none).
        Returns each loss (``STEP_LOSSES``) as the mean over optimizer steps of what the step backpropagated,
        every other term as its mean over the micro-batches."""
        hp = self.hparams
        optimizer = self.optimizers()
        minibatch_size, micro_size = self.minibatch_sizes(experience.response_mask.shape[0])
        sums: Stats = defaultdict(lambda: torch.zeros((), device=self.device))
        counts: dict[str, int] = defaultdict(int)
        attempted, steps, epochs_run, early_stopped = 0, 0, 0, False
        while epochs_run < hp.epochs and not early_stopped:
            epochs_run += 1
            unit = self.rows_kept_together  # shuffled as units: a pair's rows stay side by side (online DPO)
            order = torch.randperm(experience.response_mask.shape[0] // unit, device=self.device)
            order = (order[:, None] * unit + torch.arange(unit, device=self.device)).flatten()
            for minibatch in order.split(minibatch_size):
                attempted += 1
                where = f"iteration {self.iteration + 1}, optimizer step {attempted} of {self.steps_per_rollout}"
                micros = [experience.select(rows) for rows in minibatch.split(micro_size)]
                normalisers = self.step_normalisers(micros)
                minibatch_kl = torch.zeros((), device=self.device)
                step_terms: list[Stats] = []
                for index, micro in enumerate(micros):
                    terms = self.micro_step(micro, normalisers, ptx if index == 0 else None, kl_coef)
                    self.guard_losses({name: value for name, value in terms.items() if name.startswith("loss/")},
                                      f"{where}, micro-batch {index + 1} of {len(micros)}")
                    step_terms.append({name: value.detach() for name, value in terms.items()})
                    minibatch_kl += terms["policy/approx_kl"].detach() / len(micros)
                if not self.guard_step(where):
                    continue  # nothing of a skipped step enters the statistics
                for terms in step_terms:
                    for name, value in terms.items():
                        sums[name] += value
                        counts[name] += name not in self.STEP_LOSSES
                steps += 1
                sums["grad_norm"] += self._gradient_norm()
                if hp.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm,
                                        gradient_clip_algorithm="norm")
                with phase("update/optimizer step"):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                # Every rank must take the same decision, or DDP would wait for a backward that never comes.
                if hp.target_kl is not None and self._all_mean(minibatch_kl) > hp.target_kl:
                    early_stopped = True
                    break
        stats = {name: total / (counts[name] or steps) for name, total in sums.items()}
        stats["skipped_steps"] = torch.tensor(float(self.skipped_steps))
        stats["policy/epochs"] = torch.tensor(float(epochs_run))
        stats["policy/early_stopped"] = torch.tensor(float(early_stopped))
        return stats

    def loss_mask(self, experience: Experience) -> Tensor:
        """``[B, R]`` tokens that carry loss: the responses, less those that never stopped when
        ``mask_truncated_completions`` is set."""
        if not self.hparams.mask_truncated_completions:
            return experience.response_mask
        is_stopped = stopped(experience.responses, experience.response_mask, self.sampling.stop_token_ids)
        return experience.response_mask & is_stopped[:, None]

    def step_normalisers(self, micros: Sequence[Experience]) -> dict[str, Tensor]:
        """Denominators of the step's losses, summed over its micro-batches and averaged over ranks (DDP
        averages gradients, so each rank divides by the global total / world size)."""
        hp = self.hparams
        policy = sum(loss_normaliser(self.loss_mask(m), hp.loss_aggregation, hp.max_new_tokens) for m in micros)
        return {"policy": self.mean_over_ranks(policy.float()).clamp(min=1e-8)}

    def losses(self, experience: Experience, ptx: dict[str, Tensor] | None = None,
               kl_coef: float | None = None) -> Stats:
        """Every term of the loss of ``experience`` taken as one optimizer step, differentiable, without a
        backward (``loss/total`` is what the update would backpropagate): for analysis and tests. ``kl_coef``:
        the KL term's coefficient in the loss; null = the current one (``kl_coef_in("loss")``)."""
        kl_coef = self.kl_coef_in("loss") if kl_coef is None else kl_coef
        total, terms = self.policy_losses(experience, self.step_normalisers([experience])["policy"], ptx, kl_coef)
        return {**terms, "loss/total": total}

    def micro_step(self, micro: Experience, normalisers: dict[str, Tensor], ptx: dict[str, Tensor] | None,
                   kl_coef: float) -> Stats:
        """Losses and backward of one micro-batch (``kl_coef``: the KL term's coefficient in the loss)."""
        total, terms = self.policy_losses(micro, normalisers["policy"], ptx, kl_coef)
        self.manual_backward(total)
        return {**terms, "loss/total": total.detach()}

    def policy_losses(self, micro: Experience, normaliser: Tensor, ptx: dict[str, Tensor] | None,
                      kl_coef: float) -> tuple[Tensor, Stats]:
        """``(policy part of the loss, its terms)``: clipped surrogate, + ``kl_coef`` x KL term, - entropy bonus,
        aggregated over the step (``normaliser``); + PPO-ptx."""
        hp = self.hparams
        mask, loss_mask = micro.response_mask, self.loss_mask(micro)
        with phase("update/policy forward"):
            logprobs, entropy = self.response_logprobs(
                POLICY, micro.input_ids, micro.attention_mask, mask,
                with_entropy=bool(hp.ent_coef) or micro.logprobs is None, entropy_grad=bool(hp.ent_coef))
        # One optimizer step per rollout: the policy has not moved since sampling, so its own pass, detached,
        # gives the old log-probs (ratio 1 in value, the policy gradient in gradient).
        old_logprobs = logprobs.detach() if micro.logprobs is None else micro.logprobs
        if hp.policy_loss == "cispo":
            surrogate = cispo_surrogate(logprobs, old_logprobs, micro.advantages, mask, hp.cispo_max_weight,
                                        hp.cispo_min_weight, hp.ratio_level)
        else:
            clip_high = hp.clip_range if hp.clip_range_high is None else hp.clip_range_high
            surrogate = clipped_surrogate(logprobs, old_logprobs, micro.advantages, mask, hp.clip_range,
                                          clip_high, hp.ratio_level)
        per_token = surrogate.loss
        terms: Stats = {}
        if micro.sampler_logprobs is not None:  # the trainer's log-probs at sampling time against the sampler's
            mismatch = mismatch_statistics(old_logprobs, micro.sampler_logprobs, mask)
            terms.update({f"rollout/mismatch_{name}": value for name, value in mismatch.items()})
            if hp.rollout_correction != "none":
                weights = correction_weights(old_logprobs, micro.sampler_logprobs, mask, hp.rollout_correction,
                                             hp.rollout_correction_min, hp.rollout_correction_max)
                per_token = per_token * weights
                terms["rollout/correction_weight"] = masked_mean(weights, mask)
                terms["rollout/corrected_out"] = masked_mean((weights == 0).float(), mask)
        log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
        approx_kl = torch.expm1(log_ratio.detach()) - log_ratio.detach()
        terms |= {
            "policy/approx_kl": masked_mean(approx_kl, mask),
            "policy/clipfrac": masked_mean((surrogate.clipped_low | surrogate.clipped_high).float(), mask),
            "policy/clipfrac_low": masked_mean(surrogate.clipped_low.float(), mask),
            "policy/clipfrac_high": masked_mean(surrogate.clipped_high.float(), mask),
            "policy/ratio": masked_mean(surrogate.ratio, mask),
        }
        if micro.logprobs is None:
            terms["policy/entropy"] = masked_mean(entropy.detach(), mask)
            if micro.ref_logprobs is not None:
                terms["objective/kl"] = sequence_kl(logprobs.detach(), micro.ref_logprobs, mask).mean()
        terms["loss/policy"] = aggregate_loss(per_token, loss_mask, hp.loss_aggregation, normaliser)
        if kl_coef > 0:
            # Padding gets the reference's own log-prob (KL 0 there): garbage could overflow k3's exp and turn
            # the masked-out zero gradient into NaN.
            kl = kl_penalty(torch.where(mask, logprobs, micro.ref_logprobs), micro.ref_logprobs, hp.kl_estimator,
                            hp.kl_clamp)
            if hp.kl_ratio_weighting:  # by the surrogate's own ratio: per token, or per response (GSPO)
                kl = kl * torch.exp(log_importance_ratio(logprobs, old_logprobs, mask, hp.ratio_level))
            per_token = per_token + kl_coef * kl
            terms["loss/kl"] = masked_mean(kl.detach(), mask)
        if hp.ent_coef:
            per_token = per_token - hp.ent_coef * entropy
            terms["loss/entropy"] = masked_mean(entropy.detach(), mask)
        total = aggregate_loss(per_token, loss_mask, hp.loss_aggregation, normaliser)
        if hp.ptx_coef and ptx is not None:
            terms["loss/ptx"] = self.ptx_loss(ptx)
            total = total + hp.ptx_coef * terms["loss/ptx"]
        return total, terms

    def ptx_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """Next-token loss of the policy on pretraining/SFT text (the PPO-ptx term of InstructGPT)."""
        with self.model.role(POLICY):
            logits = self.model.next_token_logits(batch["input_ids"], batch["attention_mask"]).float()
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX)

    def minibatch_sizes(self, batch_size: int, origin: str | None = None) -> tuple[int, int]:
        """``(minibatch size, micro-batch size)`` of a rollout of ``batch_size`` responses (``origin``: where that
        number comes from, for the message)."""
        hp = self.hparams
        unit = self.rows_kept_together
        if (batch_size % hp.num_minibatches or (batch_size // hp.num_minibatches) % hp.gradient_accumulation
                or (batch_size // hp.num_minibatches // hp.gradient_accumulation) % unit):
            raise ValueError(
                f"the rollout batch of {batch_size} responses{f' ({origin})' if origin else ''} must split into "
                f"num_minibatches={hp.num_minibatches} "
                f"minibatches of gradient_accumulation={hp.gradient_accumulation} equal micro-batches"
                f"{f' of whole groups of {unit} rows' if unit > 1 else ''}; "
                "change data.init_args.batch_size, samples_per_prompt or these two"
            )
        minibatch_size = batch_size // hp.num_minibatches
        return minibatch_size, minibatch_size // hp.gradient_accumulation

    def _gradient_norm(self) -> Tensor:
        """The 2-norm of every gradient together (of the whole gradients: sharded ones are combined over ranks)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        return full_tensor(torch.nn.utils.get_total_norm(grads))

    def _all_mean(self, value: Tensor) -> float:
        return float(self.mean_over_ranks(value))

    # ---- 4. the iteration's bookkeeping -------------------------------------------------------------------

    def end_iteration(self, experience: Experience, stats: Stats, start: float, rollout_seconds: float) -> None:
        """Learning-rate and KL-coefficient updates, timings, and logging of every statistic."""
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        if "objective/kl" in stats:
            world_samples = experience.response_mask.shape[0] * self.trainer.world_size
            self.kl_controller.update(self._all_mean(stats["objective/kl"]), world_samples)
        seconds = time.perf_counter() - start
        stats.update({
            "time/rollout": torch.tensor(rollout_seconds),
            "time/update": torch.tensor(seconds - rollout_seconds),
            "time/iteration": torch.tensor(seconds),
            "throughput/tokens_per_second": experience.response_mask.sum().float() / seconds,
            "iteration": torch.tensor(float(self.iteration + 1)),
        })
        for group in self.optimizers().param_groups:
            stats[f"lr/{group['name']}"] = torch.tensor(group["lr"])
        prefix = self.metric_prefix
        self.log_dict({f"{prefix}/{name}": value.float() for name, value in stats.items()}, sync_dist=True,
                      batch_size=experience.response_mask.shape[0])
        self.log_dict({"iteration": stats["iteration"], "reward": stats["objective/score"],
                       **({"kl": stats["objective/kl"]} if "objective/kl" in stats else {}),
                       **({"gold": stats["objective/gold"]} if "objective/gold" in stats else {})},
                      prog_bar=True, logger=False, sync_dist=True)

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups, each with a ``name`` (its learning rate is logged as ``lr/<name>``)."""
        return [{"name": POLICY, "params": self.adapter_parameters(POLICY), "lr": self.hparams.policy_lr}]

    def configure_optimizers(self):
        hp = self.hparams
        # The schedule's total is the Trainer's estimate: training batches = iterations when max_steps is unset.
        return self.configure_adamw(self.parameter_groups(), hp.weight_decay, hp.warmup_iterations,
                                    hp.lr_schedule, eps=hp.adam_eps)

    # ---- validation, checkpoints --------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if self.environment is not None:
            self.evaluate_episodes(batch, batch_idx)
            return
        self.evaluate_samples(batch["input_ids"], batch["attention_mask"], batch["prompt"], batch_idx,
                              raw_prompts=batch.get("raw_prompt"), columns=batch.get("columns"),
                              indices=batch.get("index"))

    def evaluate_extra(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                       prompts: Sequence[str], texts: list[str], raw_prompts: Sequence[Any] | None = None,
                       columns: dict[str, list] | None = None) -> dict[str, Tensor]:
        scores = self.score_responses(input_ids, attention_mask, response_mask, texts,
                                      prompts=raw_prompts if raw_prompts is not None else prompts, columns=columns)
        problems, bad = score_problems(scores, self.rewards.sources)
        if problems:  # no optimizer step depends on it, but a NaN validation score must not pass unnoticed
            message = f"validation after iteration {self.iteration}: {'; '.join(problems)}"
            if self.nonfinite_policy != "skip":
                raise NonFiniteError(f"{message}; {SKIP_HINT}")
            log.warning("%s; those rows are left out of %s/val/score", message, self.metric_prefix)
            scores = scores[~bad]
        return {"score": self.rewards.combine(scores)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["kl_controller"] = self.kl_controller.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.kl_controller.load_state_dict(checkpoint["kl_controller"])
