"""Data modules of preferences: pairs for a Bradley-Terry reward model or DPO (:class:`PreferenceDataModule`), and
responses labelled desirable or undesirable one by one for KTO (:class:`UnpairedPreferenceDataModule`)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from rlhf_lightning.data.collate import EncodedPair, EncodedUnpaired, collate_pairs, collate_unpaired
from rlhf_lightning.data.formats import parse_preference, parse_unpaired
from rlhf_lightning.data.sources import Record
from rlhf_lightning.data.stage_data import SYNTHETIC, StageDataModule
from rlhf_lightning.data.tokenize import encode_completion, encode_prompt
from rlhf_lightning.tasks import make_task
from rlhf_lightning.utils import checks


class PreferenceDataModule(StageDataModule):
    """Preference pairs, for a Bradley-Terry reward model or DPO.

    Rows are ``prompt``/``chosen``/``rejected`` (text, or message lists), or only ``chosen``/``rejected`` holding
    whole transcripts (Anthropic HH style; the shared beginning becomes the prompt). An optional ``margin``
    column asks for ``r_chosen - r_rejected`` to exceed it; optional ``gold_chosen``/``gold_rejected`` (true
    scores, as the synthetic task has) add accuracy against the gold order to validation. Batches also carry
    the response mask and the left-padded prompts (see :func:`collate_pairs`); pairs are numbered by their
    position in the training and validation sets.

    Args:
        label_noise: the embedded synthetic task's labels: null = its own (Bradley-Terry sampling from the gold
            reward, 85% agreement with the gold order); a probability p = the gold order with each label flipped
            with probability p (0 = noiseless; 0.25 = Coste et al. 2023's noisy setting), training and validation
            pairs alike. The pairs are the same whatever the labels.
    """

    kind = "preferences"
    numbered = True

    def __init__(self, *args: Any, label_noise: float | None = None, **kwargs: Any) -> None:
        if label_noise is not None:
            checks.in_range("label_noise", label_noise, 0.0, 1.0)
        super().__init__(*args, **kwargs)
        self.label_noise = label_noise

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        made = make_task(task, self.seed)
        if self.label_noise is not None:
            if "label_noise" not in getattr(made, "__dataclass_fields__", {}):
                raise ValueError(f"label_noise: the embedded task {task!r} labels its pairs its own way; only the "
                                 "synthetic task takes label_noise")
            made = dataclasses.replace(made, label_noise=self.label_noise)
        return made.preference_rows(n)

    def encode(self, record: Record) -> EncodedPair:
        example = parse_preference(record)
        prompt_ids = encode_prompt(self.tokenizer, example.prompt, record.where)
        encode = partial(encode_completion, self.tokenizer, example.prompt, prompt_ids=prompt_ids,
                         where=record.where)
        return EncodedPair(
            chosen_ids=prompt_ids + encode(completion=example.chosen),
            rejected_ids=prompt_ids + encode(completion=example.rejected),
            prompt_length=len(prompt_ids),
            margin=example.margin,
            gold_chosen=example.gold_chosen,
            gold_rejected=example.gold_rejected,
        )

    def length(self, example: EncodedPair) -> int:
        return max(len(example.chosen_ids), len(example.rejected_ids))

    def longest_prompt(self) -> int:
        """The longest prompt of the pairs, in tokens (what DPO samples from in validation)."""
        return max((example.prompt_length for example in [*(self.train_set or []), *self.val_set]), default=0)

    def collate(self, examples: list[EncodedPair]) -> dict:
        return collate_pairs(examples, self.tokenizer.pad_token_id)


class UnpairedPreferenceDataModule(StageDataModule):
    """Responses labelled desirable or undesirable one by one, for KTO.

    Rows are TRL's unpaired form, ``prompt``/``completion``/``label`` (true = desirable; an optional ``gold``
    true score), or preference pairs in any of :class:`PreferenceDataModule`'s forms, each split into its chosen
    response (desirable) and its rejected one (undesirable), as TRL's ``unpair_preference_dataset`` does; the
    embedded tasks give pairs. ``batch_size`` counts responses. Each batch also holds every prompt with the
    previous example's response, for KTO's reference point (see :func:`collate_unpaired`).
    """

    kind = "unpaired"
    numbered = True

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        return make_task(task, self.seed).preference_rows(n)

    def encode(self, record: Record) -> list[EncodedUnpaired]:
        encoded = []
        for example in parse_unpaired(record):
            prompt_ids = encode_prompt(self.tokenizer, example.prompt, record.where)
            completion_ids = encode_completion(self.tokenizer, example.prompt, example.completion, prompt_ids,
                                               record.where)
            encoded.append(EncodedUnpaired(prompt_ids, completion_ids, example.desirable, example.gold))
        return encoded

    def length(self, example: EncodedUnpaired) -> int:
        return len(example.prompt_ids) + len(example.completion_ids)

    def longest(self) -> int:
        """The longest prompt with any response of the data (a batch pairs prompts with other responses too)."""
        examples = [*(self.train_set or []), *self.val_set]
        return (max((len(e.prompt_ids) for e in examples), default=0)
                + max((len(e.completion_ids) for e in examples), default=0))

    def longest_prompt(self) -> int:
        """The longest prompt, in tokens (what KTO samples from in validation)."""
        return max((len(example.prompt_ids) for example in [*(self.train_set or []), *self.val_set]), default=0)

    def label_counts(self) -> tuple[int, int]:
        """``(desirable, undesirable)`` examples in the training set."""
        desirable = sum(example.desirable for example in self.train_set or [])
        return desirable, len(self.train_set or []) - desirable

    def collate(self, examples: list[EncodedUnpaired]) -> dict:
        return collate_unpaired(examples, self.tokenizer.pad_token_id)
