"""Reward-model ensembles as pure tensor functions: how the members' scores combine into one (Coste et al. 2023,
"Reward Model Ensembles Help Mitigate Overoptimization"), how much they disagree, and which training pairs weigh on
which member (the data each member is trained on)."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

# mean: the members' average; min: worst-case optimisation (WCO), the lowest member's score; uwo:
# uncertainty-weighted optimisation, the mean less uncertainty_coef times the members' variance.
CombineRule = Literal["mean", "min", "uwo"]
COMBINE_RULES: tuple[str, ...] = get_args(CombineRule)
# shared: every member trains on every pair (members differ by their initialisation and nothing else); bootstrap:
# each member weighs each pair by its own Poisson(1) count, an online bootstrap resample of the data; partition:
# each pair trains one member, chosen at random per pair (disjoint data).
MemberData = Literal["shared", "bootstrap", "partition"]
MEMBER_DATA: tuple[str, ...] = get_args(MemberData)


def member_variance(scores: Tensor) -> Tensor:
    """The members' variance ``[...]`` of scores ``[..., K]``: ``mean_k (r_k - mean r)^2`` (over the K members, not
    K - 1: the ensemble's own spread, as Coste et al.'s UWO penalises it)."""
    return scores.var(dim=-1, unbiased=False)


def combine_members(scores: Tensor, rule: CombineRule = "mean", uncertainty_coef: float = 0.0) -> Tensor:
    """One score ``[...]`` from the members' scores ``[..., K]``.

    - ``mean``: ``(1/K) sum_k r_k``;
    - ``min``: ``min_k r_k``, worst-case optimisation (WCO);
    - ``uwo``: ``(1/K) sum_k r_k - uncertainty_coef * (1/K) sum_k (r_k - mean r)^2``, uncertainty-weighted
      optimisation (UWO).
    """
    if rule == "mean":
        return scores.mean(-1)
    if rule == "min":
        return scores.min(-1).values
    if rule == "uwo":
        return scores.mean(-1) - uncertainty_coef * member_variance(scores)
    raise ValueError(f"combine must be one of {', '.join(COMBINE_RULES)}, got {rule!r}")


def pair_weights(member_data: MemberData, member: int, members: int, indices: Tensor, seed: int) -> Tensor:
    """How much each pair of a batch weighs in member ``member``'s loss ``[B]`` (float), a function of the pairs'
    positions in their dataset (``indices`` ``[B]``), the member and ``seed`` only, so a resumed fit and every rank
    draw the same weights.

    ``shared``: 1 each. ``bootstrap``: a Poisson(1) count per (member, pair), the online bootstrap (Oza and Russell
    2001): over an epoch each member sees a bootstrap resample of the pairs. ``partition``: 1 for the pairs whose
    member, drawn uniformly per pair from the same stream for every member, is ``member``; 0 for the others.
    """
    if member_data == "shared":
        return torch.ones(indices.shape, dtype=torch.float32, device=indices.device)
    if member_data not in MEMBER_DATA:
        raise ValueError(f"member_data must be one of {', '.join(MEMBER_DATA)}, got {member_data!r}")
    if bool((indices < 0).any()):
        raise ValueError(f"member_data: {member_data} needs pairs numbered by their position in the dataset (a "
                         "preference data module numbers them); got unnumbered pairs (index -1)")
    weights = []
    for index in indices.tolist():
        # One generator per pair (microseconds): the draw depends on the seed and the pair, nothing else.
        generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)
        if member_data == "partition":
            weights.append(float(int(torch.randint(members, (), generator=generator)) == member))
        else:
            weights.append(float(torch.poisson(torch.ones(members), generator=generator)[member]))
    return torch.tensor(weights, dtype=torch.float32, device=indices.device)
