"""The update's statistics over its optimizer steps (``OnlineRL.update``), the gradient norm they log, and the
rollout's rows shuffled into its minibatches."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from rlhf_lightning.models.sharding import full_tensor

Stats = dict[str, Tensor]


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
