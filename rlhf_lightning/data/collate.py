"""Tokenized examples and the functions that pad them into batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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
    """A preference pair as two full token sequences (prompt + completion each) sharing their first
    ``prompt_length`` tokens; ``index`` is the pair's position in its dataset (-1 = not numbered), which keys
    values computed once per pair, such as DPO's precomputed reference log-probs."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_length: int
    margin: float = 0.0
    gold_chosen: float | None = None
    gold_rejected: float | None = None
    index: int = -1


@dataclass(frozen=True)
class EncodedUnpaired:
    """A prompt and one labelled response (KTO), kept apart: the batch pairs each prompt with another example's
    response too. ``index`` is the example's position in its dataset (-1 = not numbered)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool
    gold: float | None = None
    index: int = -1


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt for generation, with its text for logging, and the prompt and other columns as the dataset holds
    them, for reward functions."""

    input_ids: list[int]
    text: str
    raw: Any = None  # the prompt column: text, or a list of messages
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    index: int = -1  # the prompt's position in its dataset (-1 = not numbered)
    where: str = ""  # the row's file and line (or source and row), for errors about its columns


@dataclass(frozen=True)
class EncodedSteps:
    """A prompt and its steps, each followed by the separator token, as one sequence; ``labels`` holds each
    step's label (1 right, 0 wrong) at its separator and ``IGNORE_INDEX`` everywhere else."""

    input_ids: list[int]
    labels: list[int]


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


def after_prompt(mask: Tensor, prompt_lengths: list[int]) -> Tensor:
    """``[N, T]`` bool: each right-padded row's tokens after its prompt of ``prompt_lengths[row]`` tokens (from
    column 1 at the earliest: the first token of a sequence has no prediction), padding excluded."""
    starts = torch.tensor([max(length, 1) for length in prompt_lengths])
    return (torch.arange(mask.shape[1]) >= starts[:, None]) & mask.bool()


def collate_sft(examples: list[EncodedSFT], pad_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (prompt and padding set to -100)."""
    ids, mask = pad([example.input_ids for example in examples], pad_id, side="right")
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    for row, example in enumerate(examples):
        labels[row, : example.prompt_length] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def collate_pairs(examples: list[EncodedPair], pad_id: int) -> dict[str, Tensor]:
    """Chosen then rejected sequences stacked into one batch of ``2B`` right-padded rows, for a single forward pass.

    - ``input_ids``, ``attention_mask`` ``[2B, T]``; ``last_index`` ``[2B]``: each row's last real token (its
      EOS), where a reward model reads its score;
    - ``response_mask`` ``[2B, T]`` (bool): the completion tokens, EOS included, prompt and padding not (from
      column 1 at the earliest: the first token of a sequence has no prediction);
    - ``prompt_input_ids``, ``prompt_attention_mask`` ``[B, P]``: the prompts alone, left-padded, for sampling;
    - ``index`` ``[B]``: each pair's position in its dataset; ``margin`` ``[B]``;
    - ``gold_chosen``, ``gold_rejected`` ``[B]`` when every example has gold scores.
    """
    sequences = [example.chosen_ids for example in examples] + [example.rejected_ids for example in examples]
    ids, mask = pad(sequences, pad_id, side="right")
    prompt_ids, prompt_mask = pad([example.chosen_ids[: example.prompt_length] for example in examples], pad_id,
                                  side="left")
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "last_index": mask.sum(-1) - 1,
        "response_mask": after_prompt(mask, [example.prompt_length for example in examples] * 2),
        "prompt_input_ids": prompt_ids,
        "prompt_attention_mask": prompt_mask,
        "index": torch.tensor([example.index for example in examples], dtype=torch.long),
        "margin": torch.tensor([example.margin for example in examples], dtype=torch.float32),
    }
    if all(example.gold_chosen is not None and example.gold_rejected is not None for example in examples):
        batch["gold_chosen"] = torch.tensor([example.gold_chosen for example in examples], dtype=torch.float32)
        batch["gold_rejected"] = torch.tensor([example.gold_rejected for example in examples], dtype=torch.float32)
    return batch


def collate_unpaired(examples: list[EncodedUnpaired], pad_id: int) -> dict[str, Tensor]:
    """Each example's prompt with its own response, then with the previous example's response (the first with the
    last's), ``2B`` right-padded rows for one forward pass: the second half is KTO's mismatched ``(x, y')`` batch,
    whose responses are the same set as the first half's (TRL's rotation by one within the batch).

    - ``input_ids``, ``attention_mask``, ``response_mask`` ``[2B, T]`` as in :func:`collate_pairs`;
    - ``desirable`` ``[B]`` (bool), ``index`` ``[B]``, ``gold`` ``[B]`` when every example has a gold score;
    - ``prompt_input_ids``, ``prompt_attention_mask`` ``[B, P]``: the prompts, left-padded, for sampling.
    """
    completions = [example.completion_ids for example in examples]
    mismatched = completions[-1:] + completions[:-1]
    prompts = [example.prompt_ids for example in examples] * 2
    rows = [prompt + completion for prompt, completion in zip(prompts, completions + mismatched, strict=True)]
    ids, mask = pad(rows, pad_id, side="right")
    prompt_ids, prompt_mask = pad(prompts[: len(examples)], pad_id, side="left")
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "response_mask": after_prompt(mask, [len(prompt) for prompt in prompts]),
        "prompt_input_ids": prompt_ids,
        "prompt_attention_mask": prompt_mask,
        "desirable": torch.tensor([example.desirable for example in examples], dtype=torch.bool),
        "index": torch.tensor([example.index for example in examples], dtype=torch.long),
    }
    if all(example.gold is not None for example in examples):
        batch["gold"] = torch.tensor([example.gold for example in examples], dtype=torch.float32)
    return batch


def collate_prompts(examples: list[EncodedPrompt], pad_id: int) -> dict[str, Tensor | list[str]]:
    """Left-padded prompts (generation appends on the right), their texts, the raw prompts, the other columns
    (one list per column; a column missing from a row holds None there) and each prompt's ``index`` in its
    dataset."""
    ids, mask = pad([example.input_ids for example in examples], pad_id, side="left")
    names = sorted({name for example in examples for name in example.columns})
    return {"input_ids": ids, "attention_mask": mask, "prompt": [example.text for example in examples],
            "index": torch.tensor([example.index for example in examples], dtype=torch.long),
            "raw_prompt": [example.text if example.raw is None else example.raw for example in examples],
            "columns": {name: [example.columns.get(name) for example in examples] for name in names}}


def collate_steps(examples: list[EncodedSteps], pad_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` ``[N, T]`` (``IGNORE_INDEX`` on padding)."""
    input_ids, attention_mask = pad([example.input_ids for example in examples], pad_id, side="right")
    labels, _ = pad([example.labels for example in examples], IGNORE_INDEX, side="right")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
