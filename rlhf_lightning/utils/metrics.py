"""torchmetrics metrics that aggregate correctly over batches and devices."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class PairwiseAccuracy(Metric):
    """Fraction of pairs whose preferred item scores higher; a tie counts as half right."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preferred: Tensor, other: Tensor) -> None:
        self.correct += (preferred > other).sum() + 0.5 * (preferred == other).sum()
        self.total += preferred.numel()

    def compute(self) -> Tensor:
        return (self.correct / self.total.clamp(min=1)).float()


class MeanStd(Metric):
    """Mean and (unbiased) standard deviation of every value seen."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("count", "total", "total_squares"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor) -> None:
        values = values.detach().double()
        self.count += values.numel()
        self.total += values.sum()
        self.total_squares += (values**2).sum()

    def compute(self) -> tuple[Tensor, Tensor]:
        count = self.count.clamp(min=1)
        mean = self.total / count
        variance = (self.total_squares - count * mean**2) / (count - 1).clamp(min=1)
        return mean.float(), variance.clamp(min=0).sqrt().float()


def reset_metrics(*metrics: Metric) -> None:
    """Reset metrics to fresh, normal tensors even inside ``torch.inference_mode`` (where Lightning runs
    ``validate``): states created there could not be updated later under plain ``no_grad`` during ``fit``."""
    with torch.inference_mode(False):
        for metric in metrics:
            metric.reset()


class GroupMeans(Metric):
    """The mean of the values of each of ``groups`` groups (a value's group is its index), summed over batches and
    devices; :meth:`compute` gives ``(means [G], counts [G])``, a group that saw no value has count 0 (and mean 0)."""

    full_state_update = False

    def __init__(self, groups: int, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("total", "count"):
            self.add_state(name, default=torch.zeros(groups, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor, groups: Tensor) -> None:
        groups = groups.to(self.total.device)
        self.total.index_add_(0, groups, values.detach().double().to(self.total.device))
        self.count.index_add_(0, groups, torch.ones_like(self.count[groups]))

    def compute(self) -> tuple[Tensor, Tensor]:
        return (self.total / self.count.clamp(min=1)).float(), self.count
