"""The on-policy loop that PPO, GRPO, RLOO, REINFORCE++, on-policy distillation and online DPO share.

One ``training_step`` is one iteration on a batch of prompts, five steps read top to bottom:

1. **collect** experience (:meth:`collect_experience`): the module's ``collector``
   (:class:`~rlhf_lightning.core.collect.Collector`) draws ``samples_per_prompt`` responses (or episodes) per prompt
   and makes every pass over them once: the rollout's and the reference's log-probs when the
   :class:`~rlhf_lightning.core.pass_plan.PassPlan` (:attr:`pass_plan`, made once at setup) says so, the reward
   sources' scores; then the algorithm's own passes (:meth:`extend_experience`: PPO's values, a teacher's
   log-probs). When the plan reuses the first update pass, the collector has it made next (the module's
   :meth:`first_update_pass`, timed as the update's) and it gives the rollout's log-probs; then the statistics of
   the policy at sampling time;
2. **shape the rewards** (:meth:`shape_rewards`): the scores, an episode's turn rewards and, as the plan says, the
   per-token KL computed once;
3. **the algorithm** (:meth:`prepare_update`): advantages (and returns), or online DPO's ordered pairs;
4. **update**: the module's ``updater`` (:class:`~rlhf_lightning.core.update.PolicyUpdate`) runs ``epochs`` passes
   over shuffled minibatches of micro-batches (equal ones, or packed by ``micro_batch_tokens``, each cut to the
   columns its own rows need; the first update pass, when made early, handed to the first step as a value), each
   micro-batch's loss and backward in the module's :meth:`micro_step` (the algorithm's :meth:`loss`); gradient
   clipping, optimizer step, optional target-KL stop;
5. **log** every statistic (:meth:`end_iteration`).

The loop knows no algorithm: :class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` adds the registered
policy losses, the KL penalty, the entropy bonus and PPO-ptx, and its algorithms define :meth:`estimate_advantages`.
Experience is never modified during the update. The loss of an optimizer step is normalised over the whole step
(every micro-batch and rank, :meth:`step_normalisers`), so micro-batches of unequal token counts weigh what they
would in one batch.

Manual optimization: ``trainer.global_step`` counts optimizer steps (iterations x epochs x num_minibatches, fewer
when ``target_kl`` stops the epochs early). Metrics are logged per iteration (training batch); every row, training
and validation, carries the x-axis ``<prefix>/iteration`` (iterations done, this one included) and, as
``trainer/global_step``, the optimizer steps taken by then, so that the two agree on every row. A training row's
rollout statistics are those of the policy the iteration started from (iteration - 1 updates). Bound a run with
``trainer.max_epochs`` over the prompt set or ``trainer.limit_train_batches``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.core.collect import Collector, SkipIteration, Stats
from rlhf_lightning.core.experience import Experience, FirstPass, Samples
from rlhf_lightning.core.micro_batches import UpdateSettings
from rlhf_lightning.core.pass_plan import PassPlan, PassSettings, plan_passes
from rlhf_lightning.core.policy import POLICY, Policy, hold_policy
from rlhf_lightning.core.stage import StageModule
from rlhf_lightning.core.update import PolicyUpdate, iteration_statistics, iteration_tokens
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.combine import RewardSet, RewardShaping
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.rollout.ahead import Asynchronous
from rlhf_lightning.rollout.rollouts import Rollout
from rlhf_lightning.rollout.settings import Episodes
from rlhf_lightning.utils import checks, compatibility
from rlhf_lightning.utils.flops import TokenCounts
from rlhf_lightning.utils.optim import OptimizerSettings
from rlhf_lightning.utils.timing import Stopwatch


class OnlineRL(StageModule):
    """The on-policy loop: collect, shape the rewards, the algorithm's hook, update, log.

    A new algorithm on it defines :meth:`prepare_update` and :meth:`loss` (see
    :class:`~rlhf_lightning.stages.online_dpo.OnlineDPO`); one with a policy-gradient loss subclasses
    :class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` instead and defines its advantages. Its parts: the
    ``policy`` (:class:`~rlhf_lightning.core.policy.Policy`, which takes and documents ``base``, ``sampling``,
    ``engine`` and the other arguments not listed here), step 1's ``collector``
    (:class:`~rlhf_lightning.core.collect.Collector`), step 4's ``updater`` and the evaluation ``held_out``.

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
        update: how the policy trains on each rollout (``epochs``, ``num_minibatches``, ``gradient_accumulation``,
            ``micro_batch_tokens``, ``target_kl``, ``max_grad_norm``: see
            :class:`~rlhf_lightning.core.micro_batches.UpdateSettings`); each algorithm has its own defaults
            (``default_update``), which a config's fields override one by one.
        optimizer: AdamW and its schedule for the policy adapter (``lr``, ``weight_decay``, ``warmup`` in
            iterations, ``schedule`` over the run's iterations, ``adam_eps``, ``nonfinite``: see
            :class:`~rlhf_lightning.utils.optim.OptimizerSettings`).
    """

    metric_prefix = "online"
    # Losses normalised over the whole optimizer step: their micro-batch parts add up to the step's loss.
    STEP_LOSSES = frozenset({"loss/policy", "loss/total"})
    # Consecutive rows that minibatches and micro-batches never split (a pair of online DPO).
    rows_kept_together = 1
    default_update = UpdateSettings()  # one pass, one minibatch, gradients clipped at 1.0
    exported_roles: tuple[str, ...] = (POLICY,)  # adapters written by ``export`` when the fit ends
    sampled_roles: tuple[str, ...] = (POLICY,)  # adapters the engine samples from: synced after each optimizer step
    # A reward source that scores steps (ProcessReward): each step's score at its step's last token (PPO, whose
    # critic can credit tokens), or the reduction of its steps' scores as the response's (the critic-free family).
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
        update: UpdateSettings = default_update,
        optimizer: OptimizerSettings = StageModule.default_optimizer,
        **kwargs: Any,
    ) -> None:
        policy = Policy(*args, **kwargs)
        super().__init__(policy.base)
        hold_policy(self, policy, inspect.currentframe())  # self.policy, self.sampling, self.held_out
        policy.refuse_truncated_sampling()  # the loop trains on its own samples
        self.asynchronous: Asynchronous = self.keep_group("asynchronous", asynchronous, Asynchronous())
        self.asynchronous.prepare(policy.engine)  # an engine that cannot draw ahead is refused here
        checks.at_least("samples_per_prompt", samples_per_prompt)
        self.episodes: Episodes = self.keep_group("episodes", episodes, Episodes())
        policy.use_episodes(self.episodes)
        sources = list(reward) if isinstance(reward, list | tuple) else [reward]
        self.episodes.check_sources(sources)
        self.rewards = RewardSet(sources, self.keep_group("reward_shaping", reward_shaping, RewardShaping()))
        self.share_prompt = share_prompt
        self.collector = Collector(self.rewards, samples_per_prompt, self.asynchronous)
        self.update_settings: UpdateSettings = self.keep_group("update", update, self.default_update)
        self.updater = PolicyUpdate(self.update_settings, self.rows_kept_together)
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)
        self.automatic_optimization = False
        self._iteration_tokens = TokenCounts()  # what the last iteration processed (tokens_processed)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        compatibility.renamed_hooks(cls)  # an old name the loop no longer reads: refused in one line

    def build_model(self, empty: bool) -> SharedBase:
        model = self.policy.build(self.load_base(empty=empty))
        model.share_prompt = self.share_prompt
        self.rewards.setup(model, self.tokenizer)
        return model

    @property
    def iteration(self) -> int:
        """Training batches completed before the current one (across epochs); 0 outside a fit."""
        return 0 if self._trainer is None else self.trainer.fit_loop.epoch_loop.total_batch_idx

    def setup(self, stage: str) -> None:
        self.policy.prepare(self._trainer)  # the engine's refusal, before the model is built
        super().setup(stage)
        self.collector.plan = plan_passes(self.pass_settings())  # the hyper-parameters are final
        self.policy.rollouts  # noqa: B018 (an environment or chat template that cannot run episodes fails here)
        datamodule = self.datamodule
        self.collector.check_sources(datamodule)
        if stage == "fit":  # before the first rollout, not after it
            self.updater.check_data(datamodule, self.hparams.samples_per_prompt, self.ptx_coef, type(self).__name__)

    @property
    def pass_plan(self) -> PassPlan:
        """Which passes every iteration runs, from :meth:`pass_settings`: made once, at setup (outside a fit, on
        first use), and kept by the collector."""
        if self.collector.plan is None:
            self.collector.plan = plan_passes(self.pass_settings())
        return self.collector.plan

    @property
    def last_samples(self) -> Samples | None:
        """The latest training rollout as text (prompts, responses, scores, KL, gold): what
        :class:`~rlhf_lightning.callbacks.CompletionsTable` logs."""
        return self.collector.last_samples

    @property
    def ptx_coef(self) -> float:
        """Weight of a pretraining loss on the data module's ``ptx`` batches: none in the loop itself
        (:class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` has ``loss.ptx_coef``)."""
        return 0.0

    def pass_settings(self) -> PassSettings:
        """What decides which passes an iteration runs (:func:`~rlhf_lightning.core.pass_plan.plan_passes`): the
        update's shape here; an algorithm adds its KL (``kl.added_to``, whether it is charged or measured)."""
        update = self.update_settings
        return PassSettings(update.steps_per_rollout, whole_first_step=update.whole_first_step)

    # ---- the iteration ------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        watch = Stopwatch()  # time/rollout: its laps; time/update: the rest (the first update pass included)
        self._iteration_tokens = TokenCounts()  # an iteration skipped processed nothing worth a rate
        self.policy.sampler.seeds.start_iteration(self.iteration, self.global_rank)
        try:
            with watch.lap("rollout"):
                experience, stats = self.collect_experience(batch["prompts"])  # 1. sampling, every pass once
        except SkipIteration as skipped:
            self.updater.skip(self, str(skipped))
        else:
            experience, first_pass = self.collector.early_first_pass(self, experience)  # when the plan reuses it
            with watch.lap("rollout"), torch.no_grad():
                stats |= self.collector.sampling_statistics(experience)  # the policy at sampling time: entropy, KL
                rewards, shaped = self.shape_rewards(experience)  # 2. rewards, the per-token KL computed once
                experience, prepared = self.prepare_update(experience, rewards)  # 3. the algorithm
            trained = self.updater.run(self, experience, batch.get("ptx"), first_pass)  # 4. update
            self.end_iteration(experience, {**stats, **shaped, **prepared, **trained}, watch)  # 5. log
        # The row's trainer/global_step: the optimizer steps once the iteration is done (skipped or not), in
        # agreement with <prefix>/iteration, which counts it done (Lightning's logging step would count iterations).
        self.log("trainer/global_step", float(self.global_step))

    def collect_experience(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """Step 1, without gradients and in the sharded base's gathered scope (gathered once for every pass): the
        collector's rollout, passes and scores, then the algorithm's own passes (:meth:`extend_experience`)."""
        self.policy.check_built()
        with torch.no_grad(), self.policy.sampler.gathered_base(self.model):
            experience, stats = self.collector.collect(self, prompts)
            return self.extend_experience(experience), stats

    def extend_experience(self, experience: Experience) -> Experience:
        """The algorithm's own passes over the rollout (PPO's values, a teacher's log-probs), in the rollout's
        gathered scope and without gradients; returns the experience extended (a subclass of
        :class:`Experience`). None here."""
        return experience

    def first_update_pass(self, experience: Experience) -> FirstPass:
        """The policy's forward pass of the first optimizer step on the whole rollout, with gradients, for a loss
        that takes it (``PassSettings.reusable_first_pass``; the collector makes it early when the plan says so)."""
        raise NotImplementedError(f"{type(self).__name__} has no first update pass to reuse")

    def collect_and_prepare(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """Steps 1 to 3 of :meth:`training_step` on a batch of prompts, for analysis and tests: the experience the
        update would train on, and the statistics logged of it. A first update pass the plan reuses is made (its
        log-probs are the rollout's) and let go: an update after this call makes its own."""
        experience, stats = self.collect_experience(prompts)
        experience, _ = self.collector.early_first_pass(self, experience)
        with torch.no_grad():
            stats |= self.collector.sampling_statistics(experience)
            rewards, shaped = self.shape_rewards(experience)
            experience, prepared = self.prepare_update(experience, rewards)
        return experience, {**stats, **shaped, **prepared}

    def shape_rewards(self, experience: Experience) -> tuple[ShapedRewards, Stats]:
        """Step 2: the rollout's rewards (the sources' scores; an episode's turn rewards and a process reward model's
        step rewards at their tokens), and statistics. :class:`~rlhf_lightning.core.policy_gradient.PolicyGradient`
        adds the KL penalty."""
        dense = [rewards for rewards in (experience.turn_rewards, experience.step_rewards) if rewards is not None]
        return ShapedRewards(experience.scores, experience.response_mask, dense=sum(dense) if dense else None), {}

    def prepare_update(self, experience: Experience, rewards: ShapedRewards) -> tuple[Experience, Stats]:
        """Step 3, the algorithm: the experience as the update trains on it (with advantages, or ordered pairs),
        and statistics."""
        raise NotImplementedError

    # ---- held-out prompts ---------------------------------------------------------------------------------

    def check_lengths(self, datamodule: Any) -> None:
        self.policy.check_reach(datamodule)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.held_out.evaluate(batch, batch_idx)

    def evaluate_extra(self, rollout: Rollout, prompts: dict[str, Any], texts: list[str]) -> dict[str, Tensor]:
        """More per-sample values of a held-out rollout (name them in ``validation_metrics``), added by ``held_out``:
        its ``score`` and the values of its reward sources and episodes
        (:meth:`Collector.held_out_values <rlhf_lightning.core.collect.Collector.held_out_values>`)."""
        return self.collector.held_out_values(self, rollout, prompts, texts)

    def on_validation_epoch_start(self) -> None:
        self.held_out.start()

    def on_validation_epoch_end(self) -> None:
        self.held_out.log()
        super().on_validation_epoch_end()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        self.collector.save(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.collector.load(self, checkpoint)

    def teardown(self, stage: str) -> None:
        self.collector.close()
        self.policy.close()
        super().teardown(stage)

    # ---- 4. update ----------------------------------------------------------------------------------------

    def step_normalisers(self, micros: Sequence[Experience]) -> dict[str, Tensor]:
        """Denominators of the optimizer step's losses, summed over its micro-batches and averaged over ranks
        (DDP averages gradients, so each rank divides by the global total / world size): here ``policy``, the
        step's response tokens (a token mean)."""
        tokens = sum(micro.response_mask.sum().float() for micro in micros)
        return {"policy": self.ranks.mean(tokens).clamp(min=1e-8)}

    def loss(self, micro: Experience, normalisers: dict[str, Tensor],
             ptx: dict[str, Tensor] | None) -> tuple[Tensor, Stats]:
        """``(the micro-batch's part of the optimizer step's loss, its terms)``: the terms name every loss
        ``loss/<name>`` and must hold ``policy/approx_kl`` (the approximate KL to the sampling policy that
        ``target_kl`` reads)."""
        raise NotImplementedError

    def micro_step(self, micro: Experience, normalisers: dict[str, Tensor], ptx: dict[str, Tensor] | None) -> Stats:
        """The loss and backward of one micro-batch."""
        total, terms = self.loss(micro, normalisers, ptx)
        self.manual_backward(total)
        return {**terms, "loss/total": total.detach()}

    def losses(self, experience: Experience, ptx: dict[str, Tensor] | None = None) -> Stats:
        """Every term of the loss of ``experience`` taken as one optimizer step, differentiable, without a backward
        (``loss/total`` is what the update would backpropagate): for analysis and tests."""
        total, terms = self.loss(experience, self.step_normalisers([experience]), ptx)
        return {**terms, "loss/total": total}

    # ---- 5. log -------------------------------------------------------------------------------------------

    def end_iteration(self, experience: Experience, stats: Stats, watch: Stopwatch) -> None:
        """The learning-rate schedule's step, timings (``time/rollout``: steps 1 to 3 but the first update pass;
        ``time/update``: the rest), and logging of every statistic."""
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        stats.update(iteration_statistics(experience, watch, self.iteration, self.optimizers().param_groups))
        self._iteration_tokens = iteration_tokens(experience, int(stats["policy/epochs"]))
        prefix = self.metric_prefix
        self.log_dict({f"{prefix}/{name}": value.float() for name, value in stats.items()}, sync_dist=True,
                      batch_size=experience.response_mask.shape[0])
        self.log_dict({"iteration": stats["iteration"], "reward": stats["objective/score"],
                       **({"kl": stats["objective/kl"]} if "objective/kl" in stats else {}),
                       **({"gold": stats["objective/gold"]} if "objective/gold" in stats else {})},
                      prog_bar=True, logger=False, sync_dist=True)

    def tokens_processed(self, batch: Any) -> TokenCounts:
        """The last iteration's tokens (:func:`iteration_tokens`), for the throughput figures; none when it was
        skipped."""
        return self._iteration_tokens

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups, each with a ``name`` (its learning rate is logged as ``lr/<name>``)."""
        return [{"name": POLICY, "params": self.model.adapter_parameters(POLICY), "lr": self.optimizer_settings.lr}]

    def configure_optimizers(self):
        # The schedule's total is the Trainer's estimate: training batches = iterations when max_steps is unset.
        return self.configure_adamw(self.parameter_groups(), self.optimizer_settings)

