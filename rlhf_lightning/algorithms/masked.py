"""Statistics over the valid (unpadded) entries of a tensor.

``mask`` marks valid entries with ``True`` (or 1). Padded entries may hold anything, even inf or NaN:
they are selected away with ``torch.where`` rather than multiplied by zero, because ``inf * 0`` is NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

Dim = int | tuple[int, ...] | None


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


def masked_mean(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean over valid entries: masked_sum(values) / count(valid).

    Where there is no valid entry the mean is undefined; it is returned as 0 (never NaN), which also keeps
    gradients finite. Shapes as in :func:`masked_sum`.
    """
    valid = _valid(values, mask)
    count = valid.sum() if dim is None else valid.sum(dim)
    # The sum is 0 where the count is 0, so dividing by max(count, 1) yields the documented 0.
    return masked_sum(values, valid, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all valid entries: sum_i (x_i - mean)^2 / (n - 1 if unbiased else n).

    Returns a 0-dim tensor; it is 0 when n <= 1 (a single value has no spread, and none has no variance).
    """
    valid = _valid(values, mask)
    count = valid.sum()
    mean = masked_mean(values, valid)
    squared_error = masked_sum((values - mean) ** 2, valid)
    denominator = count - 1 if unbiased else count
    # For n <= 1 the squared error is exactly 0, so clamping the denominator gives 0 instead of 0/0.
    return squared_error / denominator.clamp(min=1).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise valid entries: (x - mean) / sqrt(var + eps), with mean and unbiased var over valid entries.

    With ``shift_mean=False`` the mean is added back, so only the scale changes (used for rewards, whose sign
    matters). Padded entries of the output are 0. Shape: same as ``values``.
    """
    valid = _valid(values, mask)
    mean = masked_mean(values, valid)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, valid) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, torch.zeros_like(whitened))
