"""What reward sources read: sampled responses as token ids (each closed as the reward stage closed completions) and
as texts, with their prompts and the dataset's other columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.tokenize import completion_end_id
from rlhf_lightning.rollout.settings import is_stop


@dataclass
class RewardInputs:
    """One batch of responses to score, as token ids (closed with EOS, for reward models) and as texts (for
    functions). Lists have one entry per response."""

    input_ids: Tensor  # [B, T] prompt + response, each closed with its end token (EOS or the turn-end token)
    attention_mask: Tensor  # [B, T]
    last_index: Tensor  # [B] position of that token, where a reward model reads its score
    prompts: list[Any]  # the prompts as the dataset holds them: text, or a list of messages
    completions: list[str]  # the responses as text (special tokens dropped)
    completion_ids: list[list[int]]  # the response tokens (stop token included)
    columns: dict[str, list[Any]] = field(default_factory=dict)  # the dataset's other columns
    # [B, R] the tokens read after each opening, which are input_ids[:, -R - 1:-1] (closing adds a column); for
    # sources that score a response token by token (ProcessReward). None when built by hand without it.
    response_mask: Tensor | None = None
    stop_token_ids: tuple[int, ...] = ()  # the tokens that end a response besides EOS

    @property
    def responses(self) -> Tensor:
        """``[B, R]`` the response tokens (with ``response_mask``)."""
        width = self.response_mask.shape[1]
        return self.input_ids[:, self.input_ids.shape[1] - width - 1:-1]

    @property
    def prompt_length(self) -> int:
        """``P``, the columns of the left-padded openings (needs ``response_mask``)."""
        if self.response_mask is None:
            raise ValueError("RewardInputs.prompt_length needs response_mask, which these inputs were built without")
        return self.input_ids.shape[1] - self.response_mask.shape[1] - 1


def last_token_index(attention_mask: Tensor) -> Tensor:
    """``[B]`` index of the last real token of each row (prompt left-padded, response right-padded)."""
    length = attention_mask.shape[1]
    positions = torch.arange(length, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, -1).max(-1).values


def close_responses(input_ids: Tensor, attention_mask: Tensor, end_token_id: int | Tensor,
                    stop_token_ids: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """Sequences as a reward model reads them: each ends with its end token (EOS, or the chat template's turn-end
    token), appended where the response ends with neither it nor another stop token.

    A reward model is trained on sequences that end with that token and reads its score there; read at the last
    word of a response cut off by ``sampling.max_new_tokens`` its output is meaningless, and a policy learns to exploit
    that. ``end_token_id`` is one id or one per row ``[B]``. Returns ``(input_ids, attention_mask, last_index)``
    one column wider than the inputs.
    """
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    end = torch.as_tensor(end_token_id, dtype=input_ids.dtype, device=input_ids.device).expand(rows.shape[0])
    last = last_token_index(attention_mask)
    closed = (input_ids[rows, last] == end) | is_stop(input_ids[rows, last], stop_token_ids)
    input_ids = torch.cat([input_ids, end[:, None].clone()], 1)
    attention_mask = torch.cat([attention_mask, torch.zeros_like(attention_mask[:, :1])], 1)
    position = torch.where(closed, last, last + 1)
    input_ids[rows, position] = torch.where(closed, input_ids[rows, position], end)
    attention_mask[rows, position] = 1
    return input_ids, attention_mask, position


def reward_inputs(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, completions: list[str],
                  prompts: Sequence[Any], columns: dict[str, list] | None, tokenizer: PreTrainedTokenizerBase,
                  stop_token_ids: tuple[int, ...] = ()) -> RewardInputs:
    """What reward sources read of sampled rollouts (responses in the last ``R`` columns of ``input_ids``): each
    sequence closed as the data stage closed completions (:func:`~rlhf_lightning.data.tokenize.completion_end_id`:
    the turn-end token after a conversation, EOS after text)."""
    prompts = list(prompts)
    ends = torch.tensor([completion_end_id(tokenizer, isinstance(prompt, list)) for prompt in prompts],
                        dtype=input_ids.dtype, device=input_ids.device)
    responses = input_ids[:, input_ids.shape[1] - response_mask.shape[1]:]
    return RewardInputs(
        *close_responses(input_ids, attention_mask, ends, stop_token_ids), prompts=prompts, completions=completions,
        completion_ids=[row[keep].tolist() for row, keep in zip(responses, response_mask, strict=True)],
        columns=dict(columns or {}), response_mask=response_mask, stop_token_ids=tuple(stop_token_ids))
