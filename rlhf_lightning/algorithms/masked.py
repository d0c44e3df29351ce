"""Statistics over the valid (unpadded) entries of a tensor.

``mask`` marks valid entries with ``True`` (or 1). Padded entries may hold anything, even inf or NaN:
they are selected away with ``torch.where`` rather than multiplied by zero, because ``inf * 0`` is NaN.

Statistics over a whole batch take ``over_ranks``, a function that sums a tensor over the data-parallel ranks: in
a distributed fit each rank holds part of the batch, and the mean and variance are then those of the global batch
(each rank sums its part, the sums are added), the same as one process holding all of it. None = this process's
values alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Dim = int | tuple[int, ...] | None
SumOverRanks = Callable[[Tensor], Tensor]


def total(value: Tensor, over_ranks: SumOverRanks | None) -> Tensor:
    """``value`` summed over ranks (itself with ``over_ranks`` None)."""
    return value if over_ranks is None else over_ranks(value)


def _valid(values: Tensor, mask: Tensor) -> Tensor:
    """Bool mask broadcast to the shape of ``values``, so counts match the entries summed."""
    return mask.bool().expand_as(values)


def masked_sum(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of ``values`` over valid entries: sum_i values_i * [mask_i].

    Shapes: ``values`` and ``mask`` alike (``mask`` may broadcast to ``values``); the result is 0-dim when
    ``dim`` is None, else ``values`` with ``dim`` reduced.
    """
    selected = torch.where(_valid(values, mask), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: Dim = None, over_ranks: SumOverRanks | None = None) -> Tensor:
    """Mean over valid entries: masked_sum(values) / count(valid) (both summed over ranks with ``over_ranks``,
    for ``dim`` None only).

    Where there is no valid entry the mean is undefined; it is returned as 0 (never NaN), which also keeps
    gradients finite. Shapes as in :func:`masked_sum`.
    """
    if over_ranks is not None and dim is not None:
        raise ValueError("over_ranks applies to the mean over every entry (dim=None)")
    valid = _valid(values, mask)
    count = valid.sum() if dim is None else valid.sum(dim)
    summed = total(masked_sum(values, valid, dim), over_ranks)
    count = total(count.to(summed.dtype), over_ranks)
    # The sum is 0 where the count is 0, so dividing by max(count, 1) yields the documented 0.
    return summed / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True, over_ranks: SumOverRanks | None = None) -> Tensor:
    """Variance over all valid entries: sum_i (x_i - mean)^2 / (n - 1 if unbiased else n) (over every rank's
    entries with ``over_ranks``).

    Returns a 0-dim tensor; it is 0 when n <= 1 (a single value has no spread, and none has no variance).
    """
    valid = _valid(values, mask)
    mean = masked_mean(values, valid, over_ranks=over_ranks)
    squared_error = total(masked_sum((values - mean) ** 2, valid), over_ranks)
    count = total(valid.sum().to(squared_error.dtype), over_ranks)
    denominator = count - 1 if unbiased else count
    # For n <= 1 the squared error is exactly 0, so clamping the denominator gives 0 instead of 0/0.
    return squared_error / denominator.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  over_ranks: SumOverRanks | None = None, unbiased: bool = True, floor: bool = False) -> Tensor:
    """Standardise valid entries: (x - mean) / sqrt(var + eps), with mean and var over valid entries (of every
    rank, with ``over_ranks``).

    The defaults are TRL's ``masked_whiten`` (Bessel's variance, ``eps`` added); ``unbiased=False, floor=True``
    is OpenRLHF 0.11's advantage normalisation, (x - mean) / sqrt(max(var, eps)) with the biased variance.
    With ``shift_mean=False`` the mean is added back, so only the scale changes (used for rewards, whose sign
    matters). Padded entries of the output are 0. Shape: same as ``values``.
    """
    valid = _valid(values, mask)
    mean = masked_mean(values, valid, over_ranks=over_ranks)
    variance = masked_var(values, valid, unbiased=unbiased, over_ranks=over_ranks)
    whitened = (values - mean) * torch.rsqrt(variance.clamp(min=eps) if floor else variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, torch.zeros_like(whitened))


def last_marked_index(mask: Tensor) -> Tensor:
    """``[B]`` column of the last marked entry of each row of ``mask`` ``[B, T]`` (0 for a row with none).

    Not ``mask.sum(-1) - 1``: an episode's mask has holes (tool and environment tokens between policy turns)."""
    columns = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), columns, -1).amax(-1).clamp(min=0)


def pack_left(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(packed [B, T], packed mask)``: each row's marked entries moved to its front, in order, the rest after.

    Functions that need a prefix mask (GAE, discounted returns) run on the packed tensors and :func:`unpack`
    puts their results back; the unmarked entries between marked ones are skipped, as if absent."""
    order = torch.sort((~mask.bool()).to(torch.int8), dim=-1, stable=True).indices
    return values.gather(-1, order), mask.bool().gather(-1, order)


def unpack(packed: Tensor, mask: Tensor) -> Tensor:
    """The inverse of :func:`pack_left` for ``mask``: packed entries back at their columns, 0 elsewhere."""
    order = torch.sort((~mask.bool()).to(torch.int8), dim=-1, stable=True).indices
    values = torch.zeros_like(packed).scatter(-1, order, packed)
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def is_prefix(mask: Tensor) -> bool:
    """Whether every row of ``mask`` marks a prefix (right padding, no holes)."""
    mask = mask.bool()
    return bool((mask[..., 1:] <= mask[..., :-1]).all())
