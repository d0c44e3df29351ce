"""What the on-policy loop trains on: an immutable batch of experience, its shaped rewards, and its texts for
callbacks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_lightning.algorithms.masked import masked_mean


@dataclass(frozen=True)
class Experience:
    """Sampled responses and what every algorithm measures on them: built once per iteration, never changed during
    the update (``dataclasses.replace`` makes a new one).

    ``B`` sequences of ``P`` left-padded prompt tokens followed by ``R`` right-padded response (or episode) tokens;
    per-token tensors are ``[B, R]`` and aligned with them. Rows of one prompt are consecutive (``group_size`` of
    them). An algorithm that measures more subclasses it (PPO's values and returns, a teacher's log-probs, online
    DPO's pair weights) and makes it (:meth:`extended`) in its
    :meth:`~rlhf_lightning.core.online.OnlineRL.extend_experience` or
    :meth:`~rlhf_lightning.core.online.OnlineRL.prepare_update`.
    """

    input_ids: Tensor  # [B, P + R] prompt and response tokens
    attention_mask: Tensor  # [B, P + R] 1 on real tokens
    # [B, R] bool: the policy's tokens, up to and including the stop token. In an episode, the policy's turns only:
    # the tool and environment tokens between them are context, with no loss, KL or entropy.
    response_mask: Tensor
    scores: Tensor  # [B] the reward sources' scores as trained on (normalised, penalised, clipped)
    is_stopped: Tensor  # [B] bool: the response ended with a stop token (not cut off by a token limit)
    # [B, R] log-probs the sampler gave the response tokens (its own distribution, kept to measure and correct a
    # mismatch with the trainer's pass)
    sampler_logprobs: Tensor
    # [B, R] log-probs under the policy at sampling time, from the pass the plan names (PassPlan.logprobs_pass): a
    # pass of the rollout's, or the update's first one made before the rewards; None when the update makes a single
    # optimizer step and nothing reads them before it: its own pass (detached) gives them.
    logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None  # [B, R] under the reference; None when nothing needs them
    # [B, R] an episode's environment rewards, each at the last policy token of its turn; None for single-turn
    turn_rewards: Tensor | None = None
    advantages: Tensor | None = None  # [B, R], set by the algorithm
    group_size: int = 1  # responses per prompt
    # [B, R] step rewards of a process reward model, each at its step's last token (PPO, ``dense_step_rewards``);
    # None when the steps' scores are reduced into ``scores`` or no source scores steps
    step_rewards: Tensor | None = None
    # [B, R] the policy's entropy at sampling time, from the pass that gave ``logprobs`` (for statistics only)
    entropy: Tensor | None = None
    # the first optimizer step's forward pass, made before the rewards (PassPlan.reuse_first_pass), its rows cut
    # as this micro-batch's: on that step's micro-batch only, handed to it by the update
    first_pass: FirstPass | None = None

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def responses(self) -> Tensor:
        """``[B, R]`` response tokens (padding after the stop token)."""
        return self.input_ids[:, self.prompt_length :]

    def extended(self, cls: type[Experience], **fields: Tensor) -> Experience:
        """This experience as ``cls`` (a subclass), with its own ``fields`` added."""
        return cls(**{field.name: getattr(self, field.name) for field in dataclasses.fields(self)}, **fields)

    def select(self, rows: Tensor) -> Experience:
        """The experience of ``rows`` only (a minibatch or micro-batch), of the same class."""
        changes = {f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **changes)

    def row_extents(self) -> tuple[Tensor, Tensor]:
        """``([B] opening columns, [B] response columns)`` each row needs: from its first real token to the end of
        the (left-padded) prompt columns, and from the start of the response columns to its last real token (an
        episode's environment tokens included)."""
        prompt = self.attention_mask[:, : self.prompt_length].bool()
        after = self.attention_mask[:, self.prompt_length :].bool()
        # the first real column of each opening (argmax finds the first True); a row without one needs none
        openings = torch.where(prompt.any(1), self.prompt_length - prompt.int().argmax(1), 0)
        columns = torch.arange(1, after.shape[1] + 1, device=after.device)
        return openings, (after * columns).amax(1)

    def cut(self, opening: int, response: int) -> Experience:
        """This experience on fewer columns: the last ``opening`` prompt columns and the first ``response`` response
        columns (at least 1), e.g. those its own rows need (:meth:`row_extents`).

        Only padding may be cut: prompts are left-padded and positions count real tokens only, so every real token
        keeps its position and its context, and every pass gives the same numbers on fewer columns. Every tensor
        with a second dimension but ``input_ids`` and ``attention_mask`` must be per-token, ``[B, R, ...]``.
        """
        width, start = self.response_mask.shape[1], self.prompt_length - opening
        keep = max(response, 1)
        if start == 0 and keep == width:
            return self
        changes = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, Tensor) or value.dim() < 2:
                continue
            if field.name in ("input_ids", "attention_mask"):
                changes[field.name] = value[:, start : self.prompt_length + keep]
            elif value.shape[1] == width:
                changes[field.name] = value[:, :keep]
            else:
                raise ValueError(f"{type(self).__name__}.{field.name} is {list(value.shape)}: a tensor with a second "
                                 f"dimension must be per-token, [B, R={width}, ...], for the columns to be cut")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class FirstPass:
    """The policy's forward pass of the first optimizer step, made on the whole rollout before the rewards
    (``PassPlan.reuse_first_pass``), with its graph for that step's backward: the loop hands it, as a value, from
    the step that makes it to the update, which gives it to its first optimizer step (:meth:`rows_of`) and drops it."""

    logprobs: Tensor  # [B, R] with gradients
    entropy: Tensor  # [B, R] (with gradients under an entropy bonus)

    def rows_of(self, micro: Experience, rows: list[int]) -> Experience:
        """``micro`` (the first step's micro-batch: ``rows`` of the rollout, in its order, cut to its columns)
        carrying this pass's rows."""
        index, width = torch.tensor(rows, device=self.logprobs.device), micro.response_mask.shape[1]
        return dataclasses.replace(micro, first_pass=FirstPass(self.logprobs[index, :width],
                                                               self.entropy[index, :width]))


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor) -> Tensor:
    """KL of each response to the reference, ``[B]``: the sum of ``log pi - log pi_ref`` over its tokens."""
    return torch.where(response_mask, logprobs - ref_logprobs, 0.0).sum(-1)


def sampling_statistics(logprobs: Tensor, entropy: Tensor, ref_logprobs: Tensor | None,
                        response_mask: Tensor) -> tuple[dict[str, Tensor], Tensor | None]:
    """``(statistics, [B] sequence KL or None)`` of the policy at sampling time, from the pass that gave the
    rollout's log-probs (``PassPlan.logprobs_pass``; detached): ``policy/entropy``, the token mean of its entropy,
    and with the reference's log-probs ``objective/kl``, the mean sequence KL. The one producer of both."""
    stats = {"policy/entropy": masked_mean(entropy, response_mask)}
    if ref_logprobs is None:
        return stats, None
    kl = sequence_kl(logprobs, ref_logprobs, response_mask)
    stats["objective/kl"] = kl.mean()
    return stats, kl


@dataclass
class Samples:
    """What a rollout sampled, as text, for callbacks that show it (one entry per response)."""

    iteration: int  # iterations completed before this rollout
    prompts: list[str]
    responses: list[str]
    scores: list[float]  # sequence rewards before normalisation, clipping and penalties
    # sequence KL to the reference (0 when the rollout's log-probs are not known before the update, or the algorithm
    # computes no reference log-probs); None until the loop knows them (OnlineRL.sampling_statistics)
    kl: list[float] | None
    gold: list[float] | None  # the task's true reward, when it has one
