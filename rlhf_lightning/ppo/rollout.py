"""What a PPO rollout produces, and the pure functions that shape it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class Rollout:
    """A batch of sampled responses and everything scored on them, ready for the PPO epochs.

    ``B`` sequences of ``P`` (left-padded) prompt tokens followed by ``R`` (right-padded) response tokens.
    Per-token tensors are ``[B, R]`` and aligned with the response tokens.
    """

    input_ids: Tensor  # [B, P + R] prompt and response tokens
    attention_mask: Tensor  # [B, P + R] 1 on real tokens
    response_mask: Tensor  # [B, R] bool: response tokens up to and including the stop token
    # [B, R] log-probs of the sampled tokens under the policy at sampling time (None in a Draft whose first update
    # pass will provide them)
    logprobs: Tensor | None
    ref_logprobs: Tensor  # [B, R] ... under the reference (adapters disabled)
    values: Tensor | None  # [B, R] critic's value of the state before each response token (None: as logprobs)
    scores: Tensor  # [B] reward-model scores, as used in the reward (after normalisation and clipping)
    advantages: Tensor | None = None  # [B, R]
    returns: Tensor | None = None  # [B, R]

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def responses(self) -> Tensor:
        return self.input_ids[:, self.prompt_length :]

    def select(self, rows: Tensor) -> Rollout:
        """The rollout restricted to ``rows`` (a minibatch)."""
        return Rollout(**{f.name: None if (v := getattr(self, f.name)) is None else v[rows] for f in fields(self)})


@dataclass
class Draft:
    """A rollout that is sampled and scored, before rewards and advantages; what the statistics need besides."""

    rollout: Rollout  # logprobs and values may still be None (left to the first update pass)
    entropy: Tensor | None  # [B, R] policy entropy at each response position (a statistic)
    raw_scores: Tensor  # [B] reward-model scores before normalisation, clipping and penalties
    is_stopped: Tensor  # [B] bool: the response ended with the stop token
    prompts: list[str]
    responses: list[str]


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """KL of each response to the reference, ``[B]``: the sum of ``log pi - log pi_ref`` over its tokens."""
    return torch.where(response_mask, logprobs - ref_logprobs, 0.0).sum(-1)


@dataclass
class Samples:
    """What a rollout sampled, as text, for callbacks that show it (one entry per response)."""

    iteration: int  # PPO iterations completed before this rollout
    prompts: list[str]
    responses: list[str]
    scores: list[float]  # reward-model scores before normalisation, clipping and penalties
    kl: list[float]  # sequence KL to the reference, sum over response tokens of log pi - log pi_ref
    gold: list[float] | None  # the task's true reward, when it has one


def truncate_after_stop(responses: Tensor, stop_token_id: int | None, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Cut every response after its first stop token: ``(responses with pad after the stop, mask [B, R])``.

    The stop token itself stays in the response (it is an action the policy took, and the reward model reads its
    score there). Without a stop token every sampled token counts.
    """
    length = responses.shape[1]
    positions = torch.arange(length, device=responses.device)
    if stop_token_id is None:
        mask = torch.ones_like(responses, dtype=torch.bool)
    else:
        is_stop = responses == stop_token_id
        first_stop = torch.where(is_stop.any(-1), is_stop.int().argmax(-1), length)
        mask = positions[None, :] <= first_stop[:, None]
    return responses.masked_fill(~mask, pad_token_id), mask


def stopped(responses: Tensor, response_mask: Tensor, stop_token_id: int | None) -> Tensor:
    """``[B]`` bool: the response ended with the stop token (rather than running out of tokens)."""
    if stop_token_id is None:
        return torch.zeros(responses.shape[0], dtype=torch.bool, device=responses.device)
    last = response_mask.sum(-1) - 1
    return responses[torch.arange(responses.shape[0], device=responses.device), last] == stop_token_id


def last_token_index(attention_mask: Tensor) -> Tensor:
    """``[B]`` index of the last real token of each row (prompt left-padded, response right-padded)."""
    length = attention_mask.shape[1]
    positions = torch.arange(length, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, -1).max(-1).values


def close_with_eos(input_ids: Tensor, attention_mask: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sequences as a reward model reads them: each ends with EOS, appended where the response lacks one.

    A reward model is trained on sequences that end with EOS and reads its score there; read at the last word of
    a response cut off by ``max_new_tokens`` its output is meaningless, and a policy learns to exploit that.
    Returns ``(input_ids, attention_mask, last_index)`` one column wider than the inputs.
    """
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    last = last_token_index(attention_mask)
    has_eos = input_ids[rows, last] == eos_token_id
    input_ids = torch.cat([input_ids, torch.full_like(input_ids[:, :1], eos_token_id)], 1)
    attention_mask = torch.cat([attention_mask, torch.zeros_like(attention_mask[:, :1])], 1)
    position = torch.where(has_eos, last, last + 1)
    input_ids[rows, position] = eos_token_id
    attention_mask[rows, position] = 1
    return input_ids, attention_mask, position


def token_rewards(
    scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float
) -> Tensor:
    """Per-token rewards ``[B, R]``: ``-kl_coef * kl_t`` on every response token, plus the sequence score at
    its last token (InstructGPT / Ziegler et al.)."""
    rewards = torch.where(response_mask, -kl_coef * kl, torch.zeros_like(kl))
    last = response_mask.sum(-1) - 1
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last] += scores
    return rewards
