"""The optimizer and learning-rate schedule shared by the stages, and their settings (one group of arguments)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from rlhf_lightning.utils import checks
from rlhf_lightning.utils.nonfinite import NonFinite

Schedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and its learning-rate schedule: the ``optimizer`` argument of every module.

    Args:
        lr: learning rate (of the policy adapter in the online algorithms; PPO's critic has ``critic.lr``).
        weight_decay: AdamW's decoupled weight decay (never applied to biases and norms).
        warmup: length of the linear warm-up: iterations in the online algorithms, optimizer steps in SFT, the
            reward models, DPO and KTO.
        schedule: decay after warm-up, to 0 at the run's end: ``constant`` (none), ``linear`` or ``cosine``.
        adam_eps: Adam's epsilon (lm-human-preferences used 1e-5).
        nonfinite: what a NaN or infinite reward score, loss or gradient does: ``raise`` stops the run with a
            message naming the step and the reward source and rows, the loss term or the parameters; ``skip``
            skips the optimizer step (all of an iteration's steps for a bad score) and counts it in
            ``<prefix>/skipped_steps``. Either way nothing non-finite is trained on or written.
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup: int = 0
    schedule: Schedule = "constant"
    adam_eps: float = 1e-8
    nonfinite: NonFinite = "raise"

    def check(self, name: str = "optimizer") -> OptimizerSettings:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        checks.positive(f"{name}.lr", self.lr)
        checks.non_negative(f"{name}.weight_decay", self.weight_decay)
        checks.at_least(f"{name}.warmup", self.warmup, minimum=0)
        checks.one_of(f"{name}.schedule", self.schedule, get_args(Schedule))
        checks.positive(f"{name}.adam_eps", self.adam_eps)
        checks.one_of(f"{name}.nonfinite", self.nonfinite, get_args(NonFinite))
        return self


def adamw(
    parameter_groups: Iterable[dict], weight_decay: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over trainable parameters only, with weight decay kept off biases and norms.

    ``parameter_groups`` are dicts with ``params`` (modules or parameters) and ``lr``; frozen parameters are
    left out, so optimizer state exists for adapters and heads only.
    """
    groups = []
    for group in parameter_groups:
        decay, no_decay = [], []
        for parameter in _parameters(group["params"]):
            if parameter.requires_grad:
                (no_decay if parameter.ndim < 2 else decay).append(parameter)
        groups.append({**group, "params": decay, "weight_decay": weight_decay})
        groups.append({**group, "params": no_decay, "weight_decay": 0.0})
    groups = [group for group in groups if group["params"]]
    if not groups:
        raise ValueError("nothing to optimise: no parameter requires grad")
    return torch.optim.AdamW(groups, betas=betas, eps=eps)


def _parameters(params: nn.Module | Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return list(params.parameters()) if isinstance(params, nn.Module) else list(params)


def lr_lambda(schedule: Schedule, warmup_steps: int, total_steps: int | Callable[[], int]):
    """Multiplier of the base learning rate at each step: linear warm-up, then constant/linear/cosine decay.

    ``total_steps`` may be a function, called only once a decaying schedule first needs it (after warm-up).

    Kept rather than transformers' ``get_{linear,cosine}_schedule_with_warmup``: their warm-up starts at a
    learning rate of 0 (``step / warmup``, so the first optimizer step changes nothing), ours at
    ``1 / (warmup + 1)``, and every published figure of this project was trained with ours; and they need the
    total when built, where ours asks the Trainer's estimate only if and when a decay needs it. The decays
    after warm-up are theirs (``1 - progress``; ``(1 + cos(pi * progress)) / 2``).
    """
    resolved: list[int] = []

    def total() -> int:
        if not resolved:
            resolved.append(total_steps() if callable(total_steps) else total_steps)
        return resolved[0]

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant" or step == warmup_steps or total() <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total() - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
