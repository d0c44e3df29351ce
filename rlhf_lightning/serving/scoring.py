"""The served reward source: one request's rows checked and encoded, many requests' rows scored together, without
gradients, as :class:`~rlhf_lightning.rewards.inputs.RewardInputs` (what the source reads in a training run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import pad
from rlhf_lightning.data.tokenize import encode_completion, encode_prompt
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.inputs import RewardInputs, last_token_index
from rlhf_lightning.rewards.remote_protocol import SCHEMA_VERSION, tokenizer_identity
from rlhf_lightning.rewards.sources import RewardSource

# A text with more characters than this per position of the served model is first encoded by its head alone: a head
# that already needs more positions proves the whole does; a head that does not (text packed unusually densely into
# tokens) leaves the whole to be encoded and checked as any row.
CHARS_PER_POSITION = 16


class RequestError(ValueError):
    """A request the server cannot score as sent: answered with HTTP 422 and this one line."""


def public_name(name: str) -> str:
    """A model's name as the server shows it to clients: a hub id as it is, a folder by its last part only (a
    client has no business with the machine's paths)."""
    return Path(name).name if Path(name).is_absolute() or Path(name).exists() else name


@dataclass
class Rows:
    """The rows of one request (or of several, joined), each sequence ending with the token the score is read at;
    with ``masks``, the sequences as the client laid them out (padding included, one width), scored in that layout."""

    prompts: list[Any]
    completions: list[str]
    completion_ids: list[list[int]]
    sequences: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    masks: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def shape(self) -> tuple[Any, ...]:
        """What rows must share to be joined into one batch: the data's columns, and a client's layout width."""
        return (*sorted(self.columns), None if self.masks is None else len(self.sequences[0]))

    @staticmethod
    def join(parts: list[Rows]) -> Rows:
        """One batch of every part's rows, in order (the parts have the same :attr:`shape`)."""
        def joined(name: str) -> list[Any]:
            return [value for part in parts for value in getattr(part, name)]

        columns = {name: [value for part in parts for value in part.columns[name]] for name in parts[0].columns}
        return Rows(joined("prompts"), joined("completions"), joined("completion_ids"), joined("sequences"), columns,
                    None if parts[0].masks is None else joined("masks"))

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.prompts[start:stop], self.completions[start:stop], self.completion_ids[start:stop],
                    self.sequences[start:stop], {name: values[start:stop] for name, values in self.columns.items()},
                    None if self.masks is None else self.masks[start:stop])


class RewardService:
    """A reward source set up on its base, scoring :class:`Rows` on ``device``; it counts what it served.

    Args:
        source: the reward source, already set up on ``base`` with ``tokenizer``.
        base: the base it scores on (an adapter source's), or None for a source without one.
        tokenizer: the base's tokenizer: the meaning of the token ids a request sends.
        device: where the rows are scored.
        embeddings: the base's embedding rows (token ids must be below), or None.
        max_length: the most tokens a sequence may have (the base's positions), or None.
    """

    def __init__(self, source: RewardSource, base: SharedBase | None, tokenizer: PreTrainedTokenizerBase,
                 device: torch.device, embeddings: int | None = None, max_length: int | None = None) -> None:
        self.source, self.base, self.tokenizer, self.device = source, base, tokenizer, device
        self.embeddings, self.max_length = embeddings, max_length
        self.served = {"requests": 0, "rows": 0, "batches": 0}

    @property
    def source_class(self) -> str:
        return f"{type(self.source).__module__}.{type(self.source).__name__}"

    @property
    def label(self) -> str:
        return f"{self.source.name} ({self.source_class})"

    def info(self, max_batch_size: int) -> dict[str, Any]:
        """``GET /info``: what a client checks at setup (see :mod:`rlhf_lightning.rewards.remote_protocol`)."""
        stats = self.source.statistics
        tokenizer = tokenizer_identity(self.tokenizer)
        return {
            "schema": SCHEMA_VERSION,
            "source": {"name": self.source.name, "class": self.source_class,
                       "may_abstain": bool(getattr(self.source, "may_abstain", True))},
            "statistics": None if stats is None else {"mean": stats[0], "std": stats[1]},
            "tokenizer": {**tokenizer, "name": public_name(tokenizer["name"])},
            "max_batch_size": max_batch_size,
            "served": dict(self.served),
        }

    def rows(self, prompts: list[Any], completions: list[str], completion_ids: list[list[int]] | None,
             input_ids: list[list[int]] | None, columns: dict[str, list[Any]],
             attention_mask: list[list[int]] | None = None) -> Rows:
        """One request's rows, checked: every list one entry per completion, token ids within the vocabulary and
        the base's positions. Without ``input_ids`` each row is encoded here, as the reward stage encodes a
        completion; without ``completion_ids``, the completion's own tokens. With ``attention_mask``, ``input_ids``
        are the client's padded rows (:meth:`check_layout`)."""
        count = len(completions)
        lists = {"prompts": prompts, "completion_ids": completion_ids, "input_ids": input_ids,
                 "attention_mask": attention_mask, **{f"columns.{name}": values for name, values in columns.items()}}
        for key, values in lists.items():
            if values is not None and len(values) != count:
                raise RequestError(f"{key} has {len(values)} entries for {count} completions: expected one per "
                                   "completion")
        try:  # a reward function that needs a column this request lacks: the client's mistake, named (a 422)
            self.source.check_columns(sorted(columns))
        except (TypeError, ValueError) as error:
            raise RequestError(f"columns: {error} (the request's columns are the prompt data here)") from None
        if attention_mask is not None:
            self.check_layout(input_ids, attention_mask)
        # Each row checked as soon as it is encoded: a request whose first row is too long fails at once, without
        # holding the token ids of every other row.
        given_input_ids, given_completion_ids = input_ids is not None, completion_ids is not None
        input_ids, completion_ids = list(input_ids or []), list(completion_ids or [])
        for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if not given_completion_ids or not given_input_ids:
                self.check_fits(completion, row, "completion")
            if not given_input_ids:
                self.check_fits(prompt if isinstance(prompt, str) else " ".join(
                    str(message.get("content", "")) for message in prompt), row, "prompt")
                input_ids.append(self.encode(prompt, completion, row))
            self.check_ids("input_ids", row, input_ids[row])
            if not given_completion_ids:
                completion_ids.append(self.tokenizer(completion, add_special_tokens=False)["input_ids"])
            self.check_ids("completion_ids", row, completion_ids[row])
        return Rows(list(prompts), list(completions), completion_ids, input_ids, dict(columns), attention_mask)

    def check_layout(self, input_ids: list[list[int]] | None, attention_mask: list[list[int]]) -> None:
        """A client's layout: ``input_ids`` rows of one width with their padding, ``attention_mask`` 1 on the
        attended tokens of each (at least one); the score is read at each row's last attended token."""
        if input_ids is None:
            raise RequestError("attention_mask without input_ids: expected both (the padded rows and their mask), or "
                               "neither")
        width = len(input_ids[0]) if input_ids else 0
        for row, (sequence, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
            if len(sequence) != width or len(mask) != width:
                raise RequestError(f"input_ids/attention_mask row {row} has {len(sequence)}/{len(mask)} entries, "
                                   f"row 0 {width}: expected rows of one width (the padded batch)")
            if not set(mask) <= {0, 1} or 1 not in mask:
                raise RequestError(f"attention_mask row {row}: expected 0 and 1, with a 1 on each attended token")

    def encode(self, prompt: Any, completion: str, row: int) -> list[int]:
        """A text row's token ids, as the reward stage encodes a completion (closed with its end token)."""
        where = f"row {row}"
        if isinstance(prompt, list):
            completion = [{"role": "assistant", "content": completion}]
        try:
            prompt_ids = encode_prompt(self.tokenizer, prompt, where)
            return prompt_ids + encode_completion(self.tokenizer, prompt, completion, prompt_ids, where)
        except ValueError as error:
            raise RequestError(str(error)) from None

    def check_fits(self, text: str, row: int, what: str) -> None:
        """Refuse a text that cannot fit the base's positions before it is encoded whole (a 30 MB completion would be
        8 million tokens, minutes of the server's CPU, before its refusal): a text longer than
        :data:`CHARS_PER_POSITION` characters per position is first encoded by its head, cut after a word where it
        can be (so its tokens are the text's first ones), and refused when the head alone needs more positions."""
        budget = None if self.max_length is None else self.max_length * CHARS_PER_POSITION
        if budget is None or len(text) <= budget:
            return
        head = text[:budget]
        space = max(head.rfind(" "), head.rfind("\n"))
        head = head[:space] if space > budget // 2 else head
        count = len(self.tokenizer(head, add_special_tokens=False)["input_ids"])
        if count > self.max_length:
            raise RequestError(f"row {row}: the {what} has {len(text)} characters, and its first {len(head)} alone are "
                               f"{count} tokens, beyond the {self.max_length} positions of the served model")

    def check_ids(self, key: str, row: int, sequence: list[int]) -> None:
        if key == "input_ids" and not sequence:
            raise RequestError(f"input_ids row {row} is empty: expected the prompt's and completion's token ids, "
                               "ending with the token the score is read at")
        if key == "input_ids" and self.max_length is not None and len(sequence) > self.max_length:
            raise RequestError(f"input_ids row {row} has {len(sequence)} tokens, beyond the {self.max_length} "
                               "positions of the served model")
        if self.embeddings is not None and sequence and not 0 <= min(sequence) <= max(sequence) < self.embeddings:
            bad = next(token for token in sequence if not 0 <= token < self.embeddings)
            raise RequestError(f"{key} row {row} holds token id {bad}: expected ids in [0, {self.embeddings}) "
                               f"(tokenizer {public_name(str(self.tokenizer.name_or_path))})")

    @torch.no_grad()
    def score(self, rows: Rows) -> list[float]:
        """The source's scores of ``rows`` (NaN where it does not apply), as the training loop computes them: in the
        client's layout when it sent one (the same padding: the same numbers), else left-padded, each row read at
        its last attended token."""
        if rows.masks is None:
            input_ids, attention_mask = pad(rows.sequences, self.tokenizer.pad_token_id, side="left")
        else:
            input_ids, attention_mask = torch.tensor(rows.sequences), torch.tensor(rows.masks)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        last_index = last_token_index(attention_mask)
        inputs = RewardInputs(input_ids, attention_mask, last_index, rows.prompts, rows.completions,
                              rows.completion_ids, rows.columns)
        scores = self.source.score(inputs).float().cpu()
        if scores.shape != (len(rows),):
            raise RuntimeError(f"reward source {self.label} returned scores of shape {tuple(scores.shape)} for "
                               f"{len(rows)} rows: expected [{len(rows)}]")
        self.served["batches"] += 1
        return scores.tolist()
