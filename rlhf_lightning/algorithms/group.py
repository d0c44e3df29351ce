"""Advantages of the critic-free family (GRPO, Dr. GRPO, RLOO, REINFORCE++): baselines from sibling samples.

Rows are grouped consecutively: prompt ``i``'s ``G`` samples are rows ``i * G .. i * G + G - 1`` of an ``[N]``
reward vector, ``N = P * G``. Every advantage here is one scalar per response; :func:`broadcast_to_tokens` puts
it on the response's tokens. Statistics are computed in at least float32 whatever the reward dtype.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlhf_lightning.algorithms.advantages import _discount_matrix
from rlhf_lightning.algorithms.masked import SumOverRanks, is_prefix, pack_left, total, unpack

ScaleRewards = Literal["group", "batch", "none"]
_SCALES: tuple[str, ...] = get_args(ScaleRewards)


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``[N]`` rewards as ``[N / G, G]``, one group per row, in at least float32."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got shape {tuple(rewards.shape)}.")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"The number of rewards ({rewards.shape[0]}) is not a multiple of group_size ({group_size}): "
            "every prompt needs exactly group_size consecutive samples."
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    return rewards.to(dtype).view(-1, group_size)


def _unbiased_std(values: Tensor, dim: int | None = None, over_ranks: SumOverRanks | None = None) -> Tensor:
    """Bessel-corrected std, 0 (not NaN as ``torch.std`` gives) when there is a single value. ``over_ranks``
    (with ``dim`` None): the std of every rank's values together."""
    if dim is not None:
        count = values.new_tensor(float(values.shape[dim]))
        squared_error = (values - values.mean(dim, keepdim=True)).pow(2).sum(dim)
    else:
        count = total(values.new_tensor(float(values.numel())), over_ranks)
        mean = total(values.sum(), over_ranks) / count.clamp(min=1)
        squared_error = total((values - mean).pow(2).sum(), over_ranks)
    # A single value deviates by exactly 0 from its mean, so max(n - 1, 1) turns 0/0 into the 0 we document.
    return (squared_error / (count - 1).clamp(min=1)).sqrt()


def group_advantages(
    rewards: Tensor, group_size: int, scale: ScaleRewards = "group", eps: float = 1e-4,
    over_ranks: SumOverRanks | None = None,
) -> Tensor:
    """GRPO advantages: the reward minus its group's mean, optionally divided by a std.

    ``scale="group"``: (r - mean_group) / (std_group + eps), std with Bessel's correction (as TRL, verl).
    ``scale="batch"``: (r - mean_group) / (std_batch + eps), std of all N rewards (TRL's
    ``scale_rewards="batch"``; still centred on the group mean; of every rank's rewards with ``over_ranks``).
    ``scale="none"`` (Dr. GRPO): r - mean_group.
    A group of one has std 0 and advantage 0; so does any group whose rewards are all equal.
    Shapes: ``rewards`` ``[N]``, ``N`` a multiple of ``group_size`` -> ``[N]`` (at least float32).
    """
    if scale not in _SCALES:
        raise ValueError(f"Unknown scale {scale!r}; expected one of {', '.join(_SCALES)}.")
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (_unbiased_std(grouped, dim=1).unsqueeze(1) + eps)
    elif scale == "batch":
        centred = centred / (_unbiased_std(grouped, over_ranks=over_ranks) + eps)
    return centred.reshape(-1)


def normalize_advantages(advantages: Tensor, eps: float = 1e-4, over_ranks: SumOverRanks | None = None) -> Tensor:
    """TRL's RLOO ``normalize_advantages``: (A - mean) / (std + eps) over the batch's responses (every rank's
    with ``over_ranks``), std with Bessel's correction, ``eps`` 1e-4 added to the std.

    Shapes: ``advantages`` ``[N]`` -> ``[N]`` (at least float32).
    """
    values = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    count = total(values.new_tensor(float(values.numel())), over_ranks)
    mean = total(values.sum(), over_ranks) / count.clamp(min=1)
    return (values - mean) / (_unbiased_std(values, over_ranks=over_ranks) + eps)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out: r_i - mean of the other G - 1 rewards of its group = G / (G - 1) (r_i - mean).

    Shapes: ``rewards`` ``[N]``, ``N`` a multiple of ``group_size`` >= 2 -> ``[N]`` (at least float32).
    """
    if group_size == 1:
        raise ValueError(
            "rloo_advantages needs group_size >= 2: a leave-one-out baseline needs another sample."
        )
    grouped = _grouped(rewards, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


@torch.no_grad()
def zero_std_fraction(rewards: Tensor, group_size: int) -> Tensor:
    """Share of groups whose rewards are all equal, which get zero advantage and so no learning signal.

    TRL logs it as ``frac_reward_zero_std``. Equality is exact (no tolerance); a group of one always counts.
    Shapes: ``rewards`` ``[N]`` -> 0-dim float.
    """
    grouped = _grouped(rewards, group_size)
    flat = (grouped == grouped[:, :1]).all(dim=1)
    return flat.to(grouped.dtype).mean()


def returns_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted return from each token to the end of its response: G_t = sum_{s>=t} gamma^(s-t) r_s.

    Only marked tokens contribute; unmarked ones between them (an episode's tool and environment tokens) are
    skipped as if absent, so gamma applies once per policy token. REINFORCE++ uses gamma = 1 with the sequence
    reward on the last token and a per-token KL penalty on every token.
    Shapes: ``token_rewards``, ``mask`` ``[B, T]`` -> ``[B, T]``, 0 where unmarked, at least float32.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}.")
    if not is_prefix(mask):
        packed_rewards, packed = pack_left(token_rewards, mask)
        return unpack(returns_to_go(packed_rewards, packed, gamma), mask)
    dtype = torch.promote_types(token_rewards.dtype, torch.float32)
    valid = mask.bool()
    rewards = torch.where(valid, token_rewards.to(dtype), torch.zeros((), dtype=dtype, device=valid.device))
    if gamma == 1.0:
        # Undiscounted: a reversed cumulative sum, linear in T rather than the T x T matrix below.
        returns = rewards.flip(1).cumsum(1).flip(1)
    else:
        returns = rewards @ _discount_matrix(gamma, rewards.shape[1], dtype, rewards.device)
    return torch.where(valid, returns, torch.zeros_like(returns))


def broadcast_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """Put a per-sequence value on every valid token of its row (a sequence advantage on its tokens).

    Differentiable in ``values``. Shapes: ``values`` ``[B]``, ``mask`` ``[B, T]`` -> ``[B, T]``, 0 at padding.
    """
    if values.dim() != 1 or mask.dim() != 2 or values.shape[0] != mask.shape[0]:
        raise ValueError(
            f"Expected values [B] and mask [B, T], got {tuple(values.shape)} and {tuple(mask.shape)}."
        )
    return torch.where(mask.bool(), values.unsqueeze(1), torch.zeros_like(values).unsqueeze(1))
