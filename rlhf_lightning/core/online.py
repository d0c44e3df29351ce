"""The on-policy loop that PPO, GRPO, RLOO, REINFORCE++, on-policy distillation and online DPO share.

One ``training_step`` is one iteration on a batch of prompts, five steps read top to bottom:

1. **collect** experience (:meth:`collect_experience`): ``samples_per_prompt`` responses (or episodes) per prompt
   and every pass over them made once (:meth:`collect`): the rollout's and the reference's log-probs when the
   :class:`~rlhf_lightning.core.pass_plan.PassPlan` (:attr:`pass_plan`, made once at setup) says so, the reward
   sources' scores; then the algorithm's own passes (:meth:`extend_experience`: PPO's values, a teacher's
   log-probs). When the plan reuses the first update pass, that pass is made next (:meth:`early_first_pass`, timed
   as the update's) and gives the rollout's log-probs; then the statistics of the policy at sampling time
   (:meth:`sampling_statistics`);
2. **shape the rewards** (:meth:`shape_rewards`): the scores, an episode's turn rewards and, as the plan says, the
   per-token KL computed once;
3. **the algorithm** (:meth:`prepare_update`): advantages (and returns), or online DPO's ordered pairs;
4. **update** (:meth:`update`): ``epochs`` passes over shuffled minibatches of micro-batches of the algorithm's
   :meth:`loss` (:meth:`micro_batches`: equal ones, or packed by ``micro_batch_tokens``, each cut to the columns its
   own rows need; the first update pass, when made early, handed to the first step as a value); gradient clipping,
   optimizer step, optional target-KL stop;
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

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from rlhf_lightning.core.collect import ExperienceCollector, SkipIteration, Stats
from rlhf_lightning.core.experience import Experience, FirstPass
from rlhf_lightning.core.micro_batches import Extent, UpdateSettings, micro_batch_parts, minibatch_sizes
from rlhf_lightning.core.pass_plan import PassSettings
from rlhf_lightning.core.policy import POLICY, PolicyModule
from rlhf_lightning.core.update_statistics import UpdateStatistics, gradient_norm, shuffled_minibatches
from rlhf_lightning.utils import compatibility
from rlhf_lightning.utils.flops import TokenCounts
from rlhf_lightning.utils.optim import OptimizerSettings
from rlhf_lightning.utils.timing import Stopwatch, phase

log = logging.getLogger(__name__)


class OnlineRL(ExperienceCollector):
    """The on-policy loop: collect, shape the rewards, the algorithm's hook, update, log.

    A new algorithm on it defines :meth:`prepare_update` and :meth:`loss` (see
    :class:`~rlhf_lightning.stages.online_dpo.OnlineDPO`); one with a policy-gradient loss subclasses
    :class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` instead and defines its advantages.

    Args:
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

    def __init__(
        self,
        *args: Any,
        update: UpdateSettings = default_update,
        optimizer: OptimizerSettings = PolicyModule.default_optimizer,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.sampling.top_k or self.sampling.top_p < 1.0:
            raise ValueError(
                "sampling.top_k/top_p: the losses and the KL use log-probs of the full distribution (at the "
                "temperature), so sampling from a truncated one would make every ratio and KL wrong; set "
                "sampling.top_k: 0, sampling.top_p: 1.0"
            )
        self.update_settings: UpdateSettings = self.keep_group("update", update, self.default_update)
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)
        self.automatic_optimization = False
        self._iteration_tokens = TokenCounts()  # what the last iteration processed (tokens_processed)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        compatibility.renamed_hooks(cls)  # an old name the loop no longer reads: refused in one line

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # The rollout's split into minibatches is known once the data module is: checked before the first
        # rollout, not after it (minutes on a real model).
        datamodule = self.datamodule
        batch_size = getattr(datamodule, "batch_size", None)
        if stage == "fit" and isinstance(batch_size, int):
            self.minibatch_sizes(batch_size * self.hparams.samples_per_prompt,
                                 f"data.init_args.batch_size={batch_size} prompts x samples_per_prompt="
                                 f"{self.hparams.samples_per_prompt}")
        no_text = getattr(datamodule, "ptx", None) is None  # pretraining text and a loss on it come together
        if stage == "fit" and datamodule is not None and no_text != (self.ptx_coef == 0):
            raise ValueError(f"loss.ptx_coef={self.ptx_coef} needs pretraining text: set data.init_args.ptx_dataset"
                             if no_text
                             else f"data.init_args.ptx_dataset is set, but {type(self).__name__} has no pretraining "
                             "loss on it (loss.ptx_coef 0): its batches would never be trained on; drop it")

    @property
    def ptx_coef(self) -> float:
        """Weight of a pretraining loss on the data module's ``ptx`` batches: none in the loop itself
        (:class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` has ``loss.ptx_coef``)."""
        return 0.0

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps made on one rollout (before any target-KL stop)."""
        return self.update_settings.steps_per_rollout

    def pass_settings(self) -> PassSettings:
        """What decides which passes an iteration runs (:func:`~rlhf_lightning.core.pass_plan.plan_passes`): the
        update's shape here; an algorithm adds its KL (``kl.added_to``, whether it is charged or measured)."""
        return PassSettings(self.steps_per_rollout, whole_first_step=self.update_settings.whole_first_step)

    # ---- the iteration ------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        watch = Stopwatch()  # time/rollout: its laps; time/update: the rest (the first update pass included)
        self._iteration_tokens = TokenCounts()  # an iteration skipped processed nothing worth a rate
        self.sampler.seeds.start_iteration(self.iteration, self.global_rank)
        try:
            with watch.lap("rollout"):
                experience, stats = self.collect_experience(batch["prompts"])  # 1. sampling, every pass once
        except SkipIteration as skipped:
            self.skip_iteration(str(skipped))
        else:
            experience, first_pass = self.early_first_pass(experience)  # the update's, when the plan reuses it
            with watch.lap("rollout"), torch.no_grad():
                stats |= self.sampling_statistics(experience)  # the policy at sampling time: entropy, KL
                rewards, shaped = self.shape_rewards(experience)  # 2. rewards, the per-token KL computed once
                experience, prepared = self.prepare_update(experience, rewards)  # 3. the algorithm
            trained = self.update(experience, batch.get("ptx"), first_pass)  # 4. update
            self.end_iteration(experience, {**stats, **shaped, **prepared, **trained}, watch)  # 5. log
        # The row's trainer/global_step: the optimizer steps once the iteration is done (skipped or not), in
        # agreement with <prefix>/iteration, which counts it done (Lightning's logging step would count iterations).
        self.log("trainer/global_step", float(self.global_step))

    def collect_and_prepare(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """Steps 1 to 3 of :meth:`training_step` on a batch of prompts, for analysis and tests: the experience the
        update would train on, and the statistics logged of it. A first update pass the plan reuses is made (its
        log-probs are the rollout's) and let go: an update after this call makes its own."""
        experience, stats = self.collect_experience(prompts)
        experience, _ = self.early_first_pass(experience)
        with torch.no_grad():
            stats |= self.sampling_statistics(experience)
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

    def skip_iteration(self, message: str) -> None:
        """Bookkeeping of an iteration not trained on (``optimizer.nonfinite: skip``): its optimizer steps counted as skipped,
        the learning-rate schedule advanced as after any iteration, the count logged."""
        log.warning("%s; the iteration's %d optimizer steps are skipped (optimizer.nonfinite: skip)", message,
                    self.steps_per_rollout)
        self.skip_step(self.steps_per_rollout)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.log_dict({f"{self.metric_prefix}/skipped_steps": float(self.skipped_steps),
                       f"{self.metric_prefix}/iteration": float(self.iteration + 1)}, sync_dist=True)

    # ---- 4. update ----------------------------------------------------------------------------------------

    def update(self, experience: Experience, ptx: dict[str, Tensor] | None, first_pass: FirstPass | None = None
               ) -> Stats:
        """``epochs`` passes of minibatch updates; ``first_pass``: the first optimizer step's forward pass made before
        the rewards (:meth:`early_first_pass`), handed to that step. Returns the statistics of
        :class:`~rlhf_lightning.core.update_statistics.UpdateStatistics`."""
        settings = self.update_settings
        optimizer = self.optimizers()
        minibatch_size, _ = self.minibatch_sizes(experience.response_mask.shape[0])
        extents = list(zip(*(columns.tolist() for columns in experience.row_extents()), strict=True))
        statistics = UpdateStatistics(self.STEP_LOSSES, self.device)
        attempted, epochs_run, early_stopped, sync_seconds = 0, 0, False, 0.0
        while epochs_run < settings.epochs and not early_stopped:
            epochs_run += 1
            for minibatch in shuffled_minibatches(experience.response_mask.shape[0], minibatch_size,
                                                  self.rows_kept_together, self.device):
                attempted += 1
                where = f"iteration {self.iteration + 1}, optimizer step {attempted} of {self.steps_per_rollout}"
                micros = self.micro_batches(experience, minibatch.tolist(), extents)
                if first_pass is not None:  # one micro-batch of every row (the plan reuses no other), used once
                    (micro,) = micros
                    micros, first_pass = [first_pass.rows_of(micro, minibatch.tolist())], None
                shares = [micro.response_mask.shape[0] / minibatch.shape[0] for micro in micros]
                normalisers = self.step_normalisers(micros)
                minibatch_kl = torch.zeros((), device=self.device)
                step_terms: list[Stats] = []
                for index, micro in enumerate(micros):
                    terms = self.micro_step(micro, normalisers, ptx if index == 0 else None)
                    self.guard_losses({name: value for name, value in terms.items() if name.startswith("loss/")},
                                      f"{where}, micro-batch {index + 1} of {len(micros)}")
                    step_terms.append({name: value.detach() for name, value in terms.items()})
                    minibatch_kl += terms["policy/approx_kl"].detach() * shares[index]
                if not self.guard_step(where):
                    continue  # nothing of a skipped step enters the statistics
                statistics.add_step(step_terms, shares, gradient_norm(self.parameters(), self.device))
                if settings.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=settings.max_grad_norm,
                                        gradient_clip_algorithm="norm")
                with phase("update/optimizer step"):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync_seconds += self.sampler.sync_roles(self.model, self.sampled_roles, self.trainer.global_step)
                # Every rank must take the same decision, or DDP would wait for a backward that never comes.
                if settings.target_kl is not None and float(self.ranks.mean(minibatch_kl)) > settings.target_kl:
                    early_stopped = True
                    break
        return {**statistics.means(), "skipped_steps": torch.tensor(float(self.skipped_steps)),
                "time/engine_sync": torch.tensor(sync_seconds),
                "policy/epochs": torch.tensor(float(epochs_run)),
                "policy/early_stopped": torch.tensor(float(early_stopped))}

    def micro_batches(self, experience: Experience, rows: list[int], extents: list[Extent]) -> list[Experience]:
        """A minibatch's micro-batches (its ``rows`` of ``experience``, whose rows need the columns ``extents``), each
        cut to the columns its own rows need: ``gradient_accumulation`` equal parts, or packed by
        ``micro_batch_tokens``, as many on every rank (each backward pass is a collective under DDP and FSDP2)."""
        settings = self.update_settings
        needed = [extents[row] for row in rows]
        micros = []
        for part in micro_batch_parts(needed, settings.gradient_accumulation, settings.micro_batch_tokens,
                                      self.rows_kept_together, self.ranks.most):
            micro = experience.select(torch.tensor([rows[p] for p in part], device=self.device))
            micros.append(micro.cut(max(needed[p][0] for p in part), max(needed[p][1] for p in part)))
        return micros

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

    def minibatch_sizes(self, batch_size: int, origin: str | None = None) -> tuple[int, int]:
        """``(minibatch size, micro-batch size)`` of a rollout of ``batch_size`` responses (``origin``: where that
        number comes from, for the message)."""
        settings = self.update_settings
        return minibatch_sizes(batch_size, settings.num_minibatches, settings.gradient_accumulation,
                               self.rows_kept_together, origin)

    # ---- 5. log -------------------------------------------------------------------------------------------

    def end_iteration(self, experience: Experience, stats: Stats, watch: Stopwatch) -> None:
        """The learning-rate schedule's step, timings (``time/rollout``: steps 1 to 3 but the first update pass;
        ``time/update``: the rest), and logging of every statistic."""
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        seconds, rollout_seconds = watch.elapsed(), watch.seconds["rollout"]
        stats.update({
            "time/rollout": torch.tensor(rollout_seconds),
            "time/update": torch.tensor(seconds - rollout_seconds),
            "time/iteration": torch.tensor(seconds),
            "throughput/tokens_per_second": experience.response_mask.sum().float() / seconds,
            "iteration": torch.tensor(float(self.iteration + 1)),
        })
        for group in self.optimizers().param_groups:
            stats[f"lr/{group['name']}"] = torch.tensor(group["lr"])
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
        return [{"name": POLICY, "params": self.adapter_parameters(POLICY), "lr": self.optimizer_settings.lr}]

    def configure_optimizers(self):
        # The schedule's total is the Trainer's estimate: training batches = iterations when max_steps is unset.
        return self.configure_adamw(self.parameter_groups(), self.optimizer_settings)


def iteration_tokens(experience: Experience, epochs: int) -> TokenCounts:
    """What an iteration processed: each row's prompt tokens and the tokens the policy drew (an episode's policy
    turns), and, for the update, the prompt and response-side tokens (an episode's tool and environment tokens
    included) once per epoch run."""
    prompts = experience.attention_mask[:, :experience.prompt_length].sum(-1)
    context = int(experience.attention_mask[:, experience.prompt_length:].sum())
    return TokenCounts(epochs * int(prompts.sum()), epochs * context, tuple(prompts.tolist()),
                       tuple(experience.response_mask.sum(-1).tolist()), experience.group_size)
