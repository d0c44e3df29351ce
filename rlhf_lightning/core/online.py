"""The on-policy loop that PPO, GRPO, RLOO, REINFORCE++, on-policy distillation and online DPO share.

One ``training_step`` is one iteration on a batch of prompts, five steps read top to bottom:

1. **collect** experience (:meth:`collect`): ``samples_per_prompt`` responses (or episodes) per prompt and every
   pass over them made once: old and reference log-probs when needed, the reward sources' scores; then the
   algorithm's own passes (:meth:`extend_experience`: PPO's values, a teacher's log-probs);
2. **shape the rewards** (:meth:`shape_rewards`): the scores, an episode's turn rewards and, with a KL penalty, the
   per-token KL computed once;
3. **the algorithm** (:meth:`prepare_update`): advantages (and returns), or online DPO's ordered pairs;
4. **update** (:meth:`update`): ``epochs`` passes over shuffled minibatches of micro-batches of the algorithm's
   :meth:`loss` (:meth:`micro_batches`: equal ones, or packed by ``micro_batch_tokens``, each cut to the columns its
   own rows need); gradient clipping, optimizer step, optional target-KL stop;
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
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, get_args

import torch
from torch import Tensor

from rlhf_lightning.core.collect import ExperienceCollector, SkipIteration, Stats
from rlhf_lightning.core.experience import Experience, ShapedRewards
from rlhf_lightning.core.micro_batches import Extent, pack_by_tokens, split_to_count
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.models.sharding import full_tensor
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.nonfinite import NonFinite
from rlhf_lightning.utils.optim import Schedule
from rlhf_lightning.utils.timing import phase

log = logging.getLogger(__name__)


class OnlineRL(ExperienceCollector):
    """The on-policy loop: collect, shape the rewards, the algorithm's hook, update, log.

    A new algorithm on it defines :meth:`prepare_update` and :meth:`loss` (see
    :class:`~rlhf_lightning.stages.online_dpo.OnlineDPO`); one with a policy-gradient loss subclasses
    :class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` instead and defines its advantages.

    Args:
        epochs: passes over each rollout batch.
        num_minibatches: minibatches, hence optimizer steps, per pass.
        gradient_accumulation: micro-batches per minibatch (less memory; same result).
        micro_batch_tokens: instead of ``gradient_accumulation`` equal micro-batches, pack each minibatch's rows,
            longest first, into micro-batches of at most this many tokens, padding included (a longer row alone);
            same result; null = off.
        target_kl: stop an iteration's epochs once a minibatch's approximate KL to the sampling policy exceeds
            this; null = never.
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
    """

    metric_prefix = "online"
    # Compute the reference's and the rollout's log-probs, hence log the samples' KL, whatever else needs them (PPO and
    # online DPO always do; the critic-free algorithms skip the reference pass at kl_coef 0, as TRL's GRPO does).
    measure_kl = False
    # Losses normalised over the whole optimizer step: their micro-batch parts add up to the step's loss.
    STEP_LOSSES = frozenset({"loss/policy", "loss/total"})
    # Consecutive rows that minibatches and micro-batches never split (a pair of online DPO).
    rows_kept_together = 1

    def __init__(
        self,
        *args: Any,
        epochs: int = 1,
        num_minibatches: int = 1,
        gradient_accumulation: int = 1,
        micro_batch_tokens: int | None = None,
        target_kl: float | None = None,
        max_grad_norm: float | None = 1.0,
        policy_lr: float = 1e-4,
        adam_eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_iterations: int = 0,
        lr_schedule: Schedule = "constant",
        nonfinite: NonFinite = "raise",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        hp = self.hparams
        if hp.top_k or hp.top_p < 1.0:
            raise ValueError(
                "top_k/top_p: the losses and the KL use log-probs of the full distribution (at the temperature), "
                "so sampling from a truncated one would make every ratio and KL wrong; set top_k: 0, top_p: 1.0"
            )
        for name, value in {"epochs": epochs, "num_minibatches": num_minibatches,
                            "gradient_accumulation": gradient_accumulation}.items():
            checks.at_least(name, value)
        checks.at_least("micro_batch_tokens", micro_batch_tokens, optional=True)
        if micro_batch_tokens is not None and gradient_accumulation != 1:
            raise ValueError(f"micro_batch_tokens={micro_batch_tokens} and gradient_accumulation="
                             f"{gradient_accumulation} both split each minibatch into micro-batches: by tokens, or "
                             "into equal parts; set gradient_accumulation: 1 or micro_batch_tokens: null")
        checks.at_least("warmup_iterations", warmup_iterations, minimum=0)
        checks.non_negative("weight_decay", weight_decay)
        for name, value in {"target_kl": target_kl, "max_grad_norm": max_grad_norm}.items():
            checks.positive(name, value, optional=True)
        checks.positive("policy_lr", policy_lr)
        checks.positive("adam_eps", adam_eps)
        checks.one_of("lr_schedule", lr_schedule, get_args(Schedule))
        checks.one_of("nonfinite", nonfinite, get_args(NonFinite))
        self.automatic_optimization = False

    def setup(self, stage: str) -> None:
        super().setup(stage)
        # The rollout's split into minibatches is known once the data module is: checked before the first
        # rollout, not after it (minutes on a real model).
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        batch_size = getattr(datamodule, "batch_size", None)
        if stage == "fit" and isinstance(batch_size, int):
            self.minibatch_sizes(batch_size * self.hparams.samples_per_prompt,
                                 f"data.init_args.batch_size={batch_size} prompts x samples_per_prompt="
                                 f"{self.hparams.samples_per_prompt}")
        no_text = getattr(datamodule, "ptx", None) is None  # pretraining text and a loss on it come together
        if stage == "fit" and datamodule is not None and no_text != (self.ptx_coef == 0):
            raise ValueError(f"ptx_coef={self.ptx_coef} needs pretraining text: set data.init_args.ptx_dataset" if no_text
                             else f"data.init_args.ptx_dataset is set, but {type(self).__name__} has no pretraining "
                             "loss on it (ptx_coef 0): its batches would never be trained on; drop it")

    @property
    def ptx_coef(self) -> float:
        """Weight of a pretraining loss on the data module's ``ptx`` batches: none in the loop itself
        (:class:`~rlhf_lightning.core.policy_gradient.PolicyGradient` has ``ptx_coef``)."""
        return 0.0

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps made on one rollout (before any target-KL stop)."""
        return self.hparams.epochs * self.hparams.num_minibatches

    @property
    def needs_logprobs(self) -> bool:
        """The rollout's log-probs are needed when the update makes more than one optimizer step (the first one's
        own pass, detached, gives them otherwise: the policy has not moved since sampling), or to measure the KL."""
        return self.steps_per_rollout > 1 or self.measure_kl

    @property
    def needs_reference(self) -> bool:
        """The reference's log-probs: with ``measure_kl``."""
        return self.measure_kl

    # ---- the iteration ------------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        start = time.perf_counter()
        self.sampler.seeds.start_iteration(self.iteration, self.global_rank)
        try:
            experience, stats = self.rollout(batch["prompts"])  # steps 1 to 3
        except SkipIteration as skipped:
            self.skip_iteration(str(skipped))
        else:
            rollout_seconds = time.perf_counter() - start
            stats.update(self.update(experience, batch.get("ptx")))  # 4. update
            self.end_iteration(experience, stats, start, rollout_seconds)  # 5. log
        # The row's trainer/global_step: the optimizer steps once the iteration is done (skipped or not), in
        # agreement with <prefix>/iteration, which counts it done (Lightning's logging step would count iterations).
        self.log("trainer/global_step", float(self.global_step))

    def rollout(self, prompts: dict[str, Any]) -> tuple[Experience, Stats]:
        """Steps 1 to 3 on a batch of prompts: the experience ready for the update, and its statistics."""
        self.check_built()
        # a sharded base gathered once for every pass of the rollout
        with torch.no_grad(), self.sampler.gathered(self.model):
            experience, stats = self.collect(prompts)  # 1. experience, every pass made once
            experience = self.extend_experience(experience)  # and the algorithm's own passes
        experience, pass_stats = self.first_update_pass(experience)  # with gradients, for the first step
        with torch.no_grad():
            rewards, reward_stats = self.shape_rewards(experience)  # 2. rewards, the per-token KL computed once
            experience, update_stats = self.prepare_update(experience, rewards)  # 3. the algorithm
        return experience, {**stats, **pass_stats, **reward_stats, **update_stats}

    def first_update_pass(self, experience: Experience) -> tuple[Experience, Stats]:
        """The update's first forward pass made before the rewards, where it also gives what they read (see
        :meth:`~rlhf_lightning.core.policy_gradient.PolicyGradient.first_update_pass`); none here."""
        return experience, {}

    def extend_experience(self, experience: Experience) -> Experience:
        """The algorithm's own passes over the rollout (PPO's values, a teacher's log-probs), in the rollout's
        gathered scope and without gradients; returns the experience extended (a subclass of
        :class:`Experience`). None here."""
        return experience

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
        """Bookkeeping of an iteration not trained on (``nonfinite: skip``): its optimizer steps counted as skipped,
        the learning-rate schedule advanced as after any iteration, the count logged."""
        log.warning("%s; the iteration's %d optimizer steps are skipped (nonfinite: skip)", message,
                    self.steps_per_rollout)
        self.skip_step(self.steps_per_rollout)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.log_dict({f"{self.metric_prefix}/skipped_steps": float(self.skipped_steps),
                       f"{self.metric_prefix}/iteration": float(self.iteration + 1)}, sync_dist=True)

    # ---- 4. update ----------------------------------------------------------------------------------------

    def update(self, experience: Experience, ptx: dict[str, Tensor] | None) -> Stats:
        """``epochs`` passes of minibatch updates. Returns each loss (``STEP_LOSSES``) as the mean over optimizer
        steps of what the step backpropagated, every other term as its mean over the micro-batches, each weighted
        by its share of its minibatch's rows (equal micro-batches weigh alike)."""
        hp = self.hparams
        optimizer = self.optimizers()
        minibatch_size, _ = self.minibatch_sizes(experience.response_mask.shape[0])
        extents = list(zip(*(columns.tolist() for columns in experience.row_extents()), strict=True))
        sums: Stats = defaultdict(lambda: torch.zeros((), device=self.device))
        counts: dict[str, float] = defaultdict(float)
        attempted, steps, epochs_run, early_stopped = 0, 0, 0, False
        while epochs_run < hp.epochs and not early_stopped:
            epochs_run += 1
            unit = self.rows_kept_together  # shuffled as units: a pair's rows stay side by side (online DPO)
            order = torch.randperm(experience.response_mask.shape[0] // unit, device=self.device)
            order = (order[:, None] * unit + torch.arange(unit, device=self.device)).flatten()
            for minibatch in order.split(minibatch_size):
                attempted += 1
                where = f"iteration {self.iteration + 1}, optimizer step {attempted} of {self.steps_per_rollout}"
                micros = self.micro_batches(experience, minibatch.tolist(), extents)
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
                for terms, share in zip(step_terms, shares, strict=True):
                    for name, value in terms.items():
                        if name in self.STEP_LOSSES:  # parts of the step's loss: their sum is the step's
                            sums[name] += value
                        else:  # each micro-batch's term weighs as its share of the minibatch's rows
                            sums[name] += value * share
                            counts[name] += share
                steps += 1
                sums["grad_norm"] += self._gradient_norm()
                if hp.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm,
                                        gradient_clip_algorithm="norm")
                with phase("update/optimizer step"):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                # Every rank must take the same decision, or DDP would wait for a backward that never comes.
                if hp.target_kl is not None and float(self.mean_over_ranks(minibatch_kl)) > hp.target_kl:
                    early_stopped = True
                    break
        stats = {name: total / (counts[name] or steps) for name, total in sums.items()}
        stats["skipped_steps"] = torch.tensor(float(self.skipped_steps))
        stats["policy/epochs"] = torch.tensor(float(epochs_run))
        stats["policy/early_stopped"] = torch.tensor(float(early_stopped))
        return stats

    def micro_batches(self, experience: Experience, rows: list[int], extents: list[Extent]) -> list[Experience]:
        """A minibatch's micro-batches (its ``rows`` of ``experience``, whose rows need the columns ``extents``), each
        cut to the columns its own rows need: ``gradient_accumulation`` equal parts, or packed by
        ``micro_batch_tokens``, as many on every rank (each backward pass is a collective under DDP and FSDP2)."""
        hp, unit = self.hparams, self.rows_kept_together
        needed = [extents[row] for row in rows]
        if hp.micro_batch_tokens is None:
            size = len(rows) // hp.gradient_accumulation
            parts = [list(range(start, start + size)) for start in range(0, len(rows), size)]
        else:
            parts = pack_by_tokens(needed, hp.micro_batch_tokens, unit)
            parts = split_to_count(parts, needed, self.most_over_ranks(len(parts)), unit)
        micros = []
        for part in parts:
            micro = experience.select(torch.tensor([rows[p] for p in part], device=self.device))
            micros.append(micro.cut(max(needed[p][0] for p in part), max(needed[p][1] for p in part)))
        return micros

    def most_over_ranks(self, count: int) -> int:
        """The largest ``count`` of any rank of a distributed fit (``count`` outside one)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return count
        return int(self.trainer.strategy.reduce(torch.tensor(count, device=self.device), reduce_op="max"))

    def step_normalisers(self, micros: Sequence[Experience]) -> dict[str, Tensor]:
        """Denominators of the optimizer step's losses, summed over its micro-batches and averaged over ranks
        (DDP averages gradients, so each rank divides by the global total / world size): here ``policy``, the
        step's response tokens (a token mean)."""
        tokens = sum(micro.response_mask.sum().float() for micro in micros)
        return {"policy": self.mean_over_ranks(tokens).clamp(min=1e-8)}

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

    # ---- 5. log -------------------------------------------------------------------------------------------

    def end_iteration(self, experience: Experience, stats: Stats, start: float, rollout_seconds: float) -> None:
        """The learning-rate schedule's step, timings, and logging of every statistic."""
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
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
