"""The online loop's fourth step, the update (:class:`PolicyUpdate`): ``update.epochs`` passes over the rollout in
shuffled minibatches, one optimizer step each, every minibatch split into micro-batches (equal parts, or packed by
``update.micro_batch_tokens``) whose backward passes add up to the step's gradient.

The update knows no loss: each micro-batch goes to the module's ``micro_step`` (its loss and backward), normalised
by the module's ``step_normalisers`` of the whole step. Around the optimizer step: the non-finite guards, gradient
clipping, the engine's sync of the sampled adapters and the early stop on ``update.target_kl``. Then what the
update logs (:class:`UpdateStatistics`: its losses, terms and gradient norm over its optimizer steps) and what the
iteration logs of its time and tokens (:func:`iteration_statistics`, :func:`iteration_tokens`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.core.experience import Experience, FirstPass
from rlhf_lightning.core.micro_batches import Extent, UpdateSettings, micro_batch_parts, minibatch_sizes
from rlhf_lightning.models.sharding import full_tensor
from rlhf_lightning.utils.flops import TokenCounts
from rlhf_lightning.utils.timing import Stopwatch, phase

log = logging.getLogger(__name__)

OnlineModule = Any  # the online module served (rlhf_lightning.core.online.OnlineRL, which imports this module)

Stats = dict[str, Tensor]


class PolicyUpdate:
    """Step 4 of the online loop, held by the module as ``updater``: the rollout's minibatches and micro-batches,
    and the optimizer steps on them.

    Args:
        settings: the module's ``update`` group (:class:`~rlhf_lightning.core.micro_batches.UpdateSettings`).
        rows_kept_together: consecutive rows that minibatches and micro-batches never split (a pair of online DPO).
    """

    def __init__(self, settings: UpdateSettings, rows_kept_together: int = 1) -> None:
        self.settings = settings
        self.rows_kept_together = rows_kept_together

    def minibatch_sizes(self, batch_size: int, origin: str | None = None) -> tuple[int, int]:
        """``(minibatch size, micro-batch size)`` of a rollout of ``batch_size`` responses (``origin``: where that
        number comes from, for the message)."""
        settings = self.settings
        return minibatch_sizes(batch_size, settings.num_minibatches, settings.gradient_accumulation,
                               self.rows_kept_together, origin)

    def check_batch_size(self, datamodule: Any, samples_per_prompt: int) -> None:
        """Refuse, before the first rollout (minutes on a real model), a rollout of the data module's
        ``batch_size`` prompts that the minibatches and micro-batches cannot split."""
        batch_size = getattr(datamodule, "batch_size", None)
        if isinstance(batch_size, int):
            self.minibatch_sizes(batch_size * samples_per_prompt, f"data.init_args.batch_size={batch_size} prompts "
                                 f"x samples_per_prompt={samples_per_prompt}")

    def check_data(self, datamodule: Any, samples_per_prompt: int, ptx_coef: float, module_name: str) -> None:
        """Before the first rollout of a fit: :meth:`check_batch_size`, and pretraining text given with a loss on it
        (``ptx_coef``, of the module named ``module_name``), never one without the other."""
        self.check_batch_size(datamodule, samples_per_prompt)
        no_text = getattr(datamodule, "ptx", None) is None
        if datamodule is not None and no_text != (ptx_coef == 0):
            raise ValueError(f"loss.ptx_coef={ptx_coef} needs pretraining text: set data.init_args.ptx_dataset"
                             if no_text
                             else f"data.init_args.ptx_dataset is set, but {module_name} has no pretraining loss on "
                             "it (loss.ptx_coef 0): its batches would never be trained on; drop it")

    def skip(self, module: OnlineModule, message: str) -> None:
        """Bookkeeping of an iteration not trained on (``optimizer.nonfinite: skip``): its optimizer steps counted as
        skipped, the learning-rate schedule advanced as after any iteration, the count logged."""
        steps = self.settings.steps_per_rollout
        log.warning("%s; the iteration's %d optimizer steps are skipped (optimizer.nonfinite: skip)", message, steps)
        module.skip_step(steps)
        scheduler = module.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        module.log_dict({f"{module.metric_prefix}/skipped_steps": float(module.skipped_steps),
                         f"{module.metric_prefix}/iteration": float(module.iteration + 1)}, sync_dist=True)

    def micro_batches(self, experience: Experience, rows: list[int], extents: list[Extent],
                      most: Callable[[int], int]) -> list[Experience]:
        """A minibatch's micro-batches (its ``rows`` of ``experience``, whose rows need the columns ``extents``), each
        cut to the columns its own rows need: ``gradient_accumulation`` equal parts, or packed by
        ``micro_batch_tokens``; ``most(count)``: the most micro-batches any rank has (each backward pass is a
        collective under DDP and FSDP2, so every rank runs as many: the module's ``ranks.most``)."""
        settings = self.settings
        needed = [extents[row] for row in rows]
        micros = []
        for part in micro_batch_parts(needed, settings.gradient_accumulation, settings.micro_batch_tokens,
                                      self.rows_kept_together, most):
            micro = experience.select(torch.tensor([rows[p] for p in part], device=experience.input_ids.device))
            micros.append(micro.cut(max(needed[p][0] for p in part), max(needed[p][1] for p in part)))
        return micros

    def run(self, module: OnlineModule, experience: Experience, ptx: dict[str, Tensor] | None,
            first_pass: FirstPass | None = None) -> Stats:
        """``epochs`` passes of minibatch updates of ``module``'s policy on ``experience`` (``ptx``: a batch of
        pretraining text for the first micro-batch of each step; ``first_pass``: the first optimizer step's forward
        pass made before the rewards, handed to that step). Returns the statistics of
        :class:`UpdateStatistics`, the epochs run and the early stop."""
        settings, device = self.settings, module.device
        optimizer = module.optimizers()
        minibatch_size, _ = self.minibatch_sizes(experience.response_mask.shape[0])
        extents = list(zip(*(columns.tolist() for columns in experience.row_extents()), strict=True))
        statistics = UpdateStatistics(module.STEP_LOSSES, device)
        attempted, epochs_run, early_stopped, sync_seconds = 0, 0, False, 0.0
        while epochs_run < settings.epochs and not early_stopped:
            epochs_run += 1
            for minibatch in shuffled_minibatches(experience.response_mask.shape[0], minibatch_size,
                                                  self.rows_kept_together, device):
                attempted += 1
                where = f"iteration {module.iteration + 1}, optimizer step {attempted} of {settings.steps_per_rollout}"
                micros = self.micro_batches(experience, minibatch.tolist(), extents, module.ranks.most)
                if first_pass is not None:  # one micro-batch of every row (the plan reuses no other), used once
                    (micro,) = micros
                    micros, first_pass = [first_pass.rows_of(micro, minibatch.tolist())], None
                shares = [micro.response_mask.shape[0] / minibatch.shape[0] for micro in micros]
                normalisers = module.step_normalisers(micros)
                minibatch_kl = torch.zeros((), device=device)
                step_terms: list[Stats] = []
                for index, micro in enumerate(micros):
                    terms = module.micro_step(micro, normalisers, ptx if index == 0 else None)
                    module.guard_losses({name: value for name, value in terms.items() if name.startswith("loss/")},
                                        f"{where}, micro-batch {index + 1} of {len(micros)}")
                    step_terms.append({name: value.detach() for name, value in terms.items()})
                    minibatch_kl += terms["policy/approx_kl"].detach() * shares[index]
                if not module.guard_step(where):
                    continue  # nothing of a skipped step enters the statistics
                statistics.add_step(step_terms, shares, gradient_norm(module.parameters(), device))
                if settings.max_grad_norm is not None:
                    module.clip_gradients(optimizer, gradient_clip_val=settings.max_grad_norm,
                                          gradient_clip_algorithm="norm")
                with phase("update/optimizer step"):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync_seconds += module.policy.sampler.sync_roles(module.model, module.sampled_roles,
                                                          module.trainer.global_step)
                # Every rank must take the same decision, or DDP would wait for a backward that never comes.
                if settings.target_kl is not None and float(module.ranks.mean(minibatch_kl)) > settings.target_kl:
                    early_stopped = True
                    break
        return {**statistics.means(), "skipped_steps": torch.tensor(float(module.skipped_steps)),
                "time/engine_sync": torch.tensor(sync_seconds),
                "policy/epochs": torch.tensor(float(epochs_run)),
                "policy/early_stopped": torch.tensor(float(early_stopped))}


def shuffled_minibatches(rows: int, size: int, unit: int, device: torch.device) -> tuple[Tensor, ...]:
    """The positions ``0 .. rows - 1`` in a random order, as minibatches of ``size``: shuffled as units of ``unit``
    consecutive rows, which stay side by side (a pair of online DPO)."""
    order = torch.randperm(rows // unit, device=device)
    order = (order[:, None] * unit + torch.arange(unit, device=device)).flatten()
    return order.split(size)


def gradient_norm(parameters: Iterable[torch.nn.Parameter], device: torch.device) -> Tensor:
    """The 2-norm of every gradient of ``parameters`` together (of the whole gradients: sharded ones are combined
    over ranks); 0 without any."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    return full_tensor(torch.nn.utils.get_total_norm(grads))


class UpdateStatistics:
    """Sums of the terms of the optimizer steps an update takes, and their means (:meth:`means`).

    Each loss of ``step_losses`` is a part of its optimizer step's loss (normalised over the whole step), so its
    micro-batch parts add up to what the step backpropagated and its mean is over steps; every other term is a
    mean over micro-batches, each weighted by its share of its minibatch's rows (equal micro-batches weigh alike).
    """

    def __init__(self, step_losses: frozenset[str], device: torch.device) -> None:
        self.step_losses = step_losses
        self.sums: Stats = defaultdict(lambda: torch.zeros((), device=device))
        self.counts: dict[str, float] = defaultdict(float)
        self.steps = 0

    def add_step(self, step_terms: Sequence[Stats], shares: Sequence[float], grad_norm: Tensor) -> None:
        """One optimizer step taken: its micro-batches' detached terms, their shares of the minibatch's rows, and
        the gradient's norm before clipping."""
        for terms, share in zip(step_terms, shares, strict=True):
            for name, value in terms.items():
                if name in self.step_losses:  # parts of the step's loss: their sum is the step's
                    self.sums[name] += value
                else:  # each micro-batch's term weighs as its share of the minibatch's rows
                    self.sums[name] += value * share
                    self.counts[name] += share
        self.steps += 1
        self.sums["grad_norm"] += grad_norm

    def means(self) -> Stats:
        """Every term's mean over the steps taken (nothing of a skipped step enters them)."""
        return {name: total / (self.counts[name] or self.steps) for name, total in self.sums.items()}


def iteration_statistics(experience: Experience, watch: Stopwatch, iteration: int,
                         param_groups: Sequence[dict]) -> Stats:
    """An iteration's timings (``time/rollout``: steps 1 to 3 but the first update pass; ``time/update``: the rest),
    its throughput of response tokens, its number (``iteration``, this one included) and each parameter group's
    learning rate (``lr/<name>``)."""
    seconds, rollout_seconds = watch.elapsed(), watch.seconds["rollout"]
    stats = {
        "time/rollout": torch.tensor(rollout_seconds),
        "time/update": torch.tensor(seconds - rollout_seconds),
        "time/iteration": torch.tensor(seconds),
        "throughput/tokens_per_second": experience.response_mask.sum().float() / seconds,
        "iteration": torch.tensor(float(iteration + 1)),
    }
    for group in param_groups:
        stats[f"lr/{group['name']}"] = torch.tensor(group["lr"])
    return stats


def iteration_tokens(experience: Experience, epochs: int) -> TokenCounts:
    """What an iteration processed: each row's prompt tokens and the tokens the policy drew (an episode's policy
    turns), and, for the update, the prompt and response-side tokens (an episode's tool and environment tokens
    included) once per epoch run."""
    prompts = experience.attention_mask[:, :experience.prompt_length].sum(-1)
    context = int(experience.attention_mask[:, experience.prompt_length:].sum())
    return TokenCounts(epochs * int(prompts.sum()), epochs * context, tuple(prompts.tolist()),
                       tuple(experience.response_mask.sum(-1).tolist()), experience.group_size)
