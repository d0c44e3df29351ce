"""Tokenized examples and the functions that pad them into batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

IGNORE_INDEX = -100  # label of tokens that carry no loss


@dataclass(frozen=True)
class EncodedSFT:
    """A prompt and its completion as one token sequence; the loss falls on ``input_ids[prompt_length:]``."""

    input_ids: list[int]
    prompt_length: int


@dataclass(frozen=True)
class EncodedPair:
    """A preference pair as two full token sequences (prompt + completion each)."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0
    gold_chosen: float | None = None
    gold_rejected: float | None = None


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt for generation, with its text for text-based rewards and logging."""

    input_ids: list[int]
    text: str


def pad(sequences: list[list[int]], pad_id: int, side: Literal["left", "right"]) -> tuple[Tensor, Tensor]:
    """Pad to the longest sequence: ``(ids [B, T], attention_mask [B, T])``."""
    length = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        span = slice(length - len(sequence), length) if side == "left" else slice(0, len(sequence))
        ids[row, span] = torch.tensor(sequence, dtype=torch.long)
        mask[row, span] = 1
    return ids, mask


def collate_sft(examples: list[EncodedSFT], pad_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (prompt and padding set to -100)."""
    ids, mask = pad([example.input_ids for example in examples], pad_id, side="right")
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    for row, example in enumerate(examples):
        labels[row, : example.prompt_length] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate_pairs(examples: list[EncodedPair], pad_id: int) -> dict[str, Tensor]:
    """Chosen then rejected sequences stacked into one batch of ``2B`` rows, for a single forward pass.

    ``last_index`` points at each row's last real token (its EOS), where the reward is read.
    Gold scores are included when every example has them.
    """
    sequences = [example.chosen_ids for example in examples] + [example.rejected_ids for example in examples]
    ids, mask = pad(sequences, pad_id, side="right")
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "last_index": mask.sum(-1) - 1,
        "margin": torch.tensor([example.margin for example in examples], dtype=torch.float32),
    }
    if all(example.gold_chosen is not None and example.gold_rejected is not None for example in examples):
        batch["gold_chosen"] = torch.tensor([example.gold_chosen for example in examples], dtype=torch.float32)
        batch["gold_rejected"] = torch.tensor([example.gold_rejected for example in examples], dtype=torch.float32)
    return batch


def collate_prompts(examples: list[EncodedPrompt], pad_id: int) -> dict[str, Tensor | list[str]]:
    """Left-padded prompts (generation appends on the right) and their texts."""
    ids, mask = pad([example.input_ids for example in examples], pad_id, side="left")
    return {"input_ids": ids, "attention_mask": mask, "prompt": [example.text for example in examples]}
