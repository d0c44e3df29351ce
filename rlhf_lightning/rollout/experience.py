"""What a rollout produces: an immutable batch of experience, and its texts for callbacks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Experience:
    """Sampled responses and everything measured on them: built once per iteration, never changed during the
    update (``with_advantages`` returns a new one).

    ``B`` sequences of ``P`` left-padded prompt tokens followed by ``R`` right-padded response (or episode)
    tokens; per-token tensors are ``[B, R]`` and aligned with them. Rows of one prompt are consecutive
    (``group_size`` of them).
    """

    input_ids: Tensor  # [B, P + R] prompt and response tokens
    attention_mask: Tensor  # [B, P + R] 1 on real tokens
    response_mask: Tensor  # [B, R] bool: response tokens up to and including the stop token
    scores: Tensor  # [B] sequence rewards as the algorithm uses them (normalised, penalised, clipped)
    # [B, R] log-probs under the policy at sampling time; None when the update makes a single optimizer step,
    # whose own pass (detached) gives them: the policy has not changed before it.
    logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None  # [B, R] under the reference; None when no KL term needs them
    values: Tensor | None = None  # [B, R] critic values of the state before each response token, 0 after the end
    advantages: Tensor | None = None  # [B, R]
    returns: Tensor | None = None  # [B, R] critic targets (algorithms with a critic)
    group_size: int = 1  # responses per prompt
    # [B, R] an episode's environment rewards, each at the last policy token of its turn (also summed into
    # ``scores``); None for single-turn rollouts. In an episode ``response_mask`` marks the policy's tokens only:
    # the tool and environment tokens between turns are context, with no loss, KL or entropy.
    turn_rewards: Tensor | None = None
    # [B, R] log-probs the sampler gave the response tokens (its own distribution, kept to measure and correct a
    # mismatch with the trainer's pass); None when not kept.
    sampler_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None  # [B, R] a teacher's log-probs (on-policy distillation)
    # [B] online DPO, rows ordered chosen then rejected in each pair: 1 where the pair carries loss, 0 for a tie
    pair_weights: Tensor | None = None

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def responses(self) -> Tensor:
        """``[B, R]`` response tokens (padding after the stop token)."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def full_response_mask(self) -> Tensor:
        """``[B, P + R]`` bool: the response tokens, in the coordinates of ``input_ids``."""
        prompt = torch.zeros_like(self.input_ids[:, : self.prompt_length], dtype=torch.bool)
        return torch.cat([prompt, self.response_mask], 1)

    def with_advantages(self, advantages: Tensor, returns: Tensor | None = None) -> Experience:
        return dataclasses.replace(self, advantages=advantages, returns=returns)

    def select(self, rows: Tensor) -> Experience:
        """The experience of ``rows`` only (a minibatch or micro-batch)."""
        changes = {f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **changes)


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """KL of each response to the reference, ``[B]``: the sum of ``log pi - log pi_ref`` over its tokens."""
    return torch.where(response_mask, logprobs - ref_logprobs, 0.0).sum(-1)


@dataclass
class Samples:
    """What a rollout sampled, as text, for callbacks that show it (one entry per response)."""

    iteration: int  # iterations completed before this rollout
    prompts: list[str]
    responses: list[str]
    scores: list[float]  # sequence rewards before normalisation, clipping and penalties
    kl: list[float]  # sequence KL to the reference (0 when the algorithm computes no reference log-probs)
    gold: list[float] | None  # the task's true reward, when it has one
