"""Generalised advantage estimation (Schulman et al. 2016) over right-padded responses."""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import is_prefix, pack_left, unpack


def _check_discounts(gamma: float, lam: float) -> None:
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}.")


def _td_errors(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 past the last valid token; also masked V."""
    values = torch.where(valid, values, torch.zeros_like(values))
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    # Padding values are 0 after masking, so shifting left gives V = 0 after the episode's last token.
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * next_values - values
    return torch.where(valid, deltas, torch.zeros_like(deltas)), values


def _discount_matrix(decay: float, length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """M[s, t] = decay^(s - t) for s >= t, else 0, so (deltas @ M)[t] = sum_{s>=t} decay^(s-t) delta_s."""
    steps = torch.arange(length, device=device)
    # Clamped so the (discarded) upper triangle holds decay^0 rather than 0^-k = inf.
    exponents = (steps[:, None] - steps[None, :]).clamp(min=0).to(dtype)
    # pow(0, 0) == 1 keeps the diagonal at 1 when gamma * lam = 0; long horizons underflow to 0, never NaN.
    return torch.tensor(decay, dtype=dtype, device=device).pow(exponents).tril()


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Advantages A_t = sum_k (gamma * lam)^k delta_{t+k} and returns A_t + V_t, without a loop over tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t, where V is 0 after the last valid token (the episode ends there).
    ``mask`` marks the policy's tokens: a prefix of each row for a single response; in a multi-turn episode the
    tool and environment tokens between turns are unmarked, and they are skipped as if absent: V_{t+1} is the
    value at the next *policy* token and gamma and lam apply once per policy token, so a tool result neither
    discounts nor adds a step (its rewards belong to the policy token before it). Shapes: ``rewards``,
    ``values``, ``mask`` ``[B, T]`` -> (advantages, returns), both ``[B, T]`` and 0 at unmarked positions.
    Computed in at least float32 (a bf16 value head would otherwise lose the discounted sums).
    """
    _check_discounts(gamma, lam)
    if not is_prefix(mask):
        (rewards, packed), (values, _) = pack_left(rewards, mask), pack_left(values, mask)
        advantages, returns = gae(rewards, values, packed, gamma, lam)
        return unpack(advantages, mask), unpack(returns, mask)
    dtype = torch.promote_types(torch.result_type(rewards, values), torch.float32)
    valid = mask.bool()
    deltas, values = _td_errors(rewards.to(dtype), values.to(dtype), valid, gamma)
    advantages = deltas @ _discount_matrix(gamma * lam, deltas.shape[1], dtype, deltas.device)
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def _gae_loop(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Reference GAE by the backward recursion A_t = delta_t + gamma * lam * A_{t+1}; for tests only."""
    valid = mask.bool()
    dtype = torch.promote_types(torch.result_type(rewards, values), torch.float32)
    rewards, values = rewards.to(dtype), values.to(dtype)
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = torch.where(valid[:, t], delta + gamma * lam * next_advantage, torch.zeros_like(delta))
        advantages[:, t] = advantage
        # A padded step carries nothing back: the episode ended before it.
        next_advantage = advantage
        next_value = torch.where(valid[:, t], values[:, t], torch.zeros_like(next_value))
    returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
    return advantages, returns
