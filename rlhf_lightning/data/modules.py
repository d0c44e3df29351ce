"""LightningDataModules of the three stages: SFT demonstrations, preference pairs and prompts for RL.

Each reads rows from ``dataset`` (the embedded ``synthetic`` task, a JSONL/JSON/Parquet file, a folder or a
``datasets`` hub id), checks and tokenizes every row once in ``setup``, and serves resumable training batches.
The tokenizer is the LightningModule's, so model and data can never disagree on it.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import replace
from functools import partial
from typing import Any, ClassVar, Literal

import lightning as L
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import (
    EncodedPair,
    EncodedPrompt,
    EncodedSFT,
    EncodedSteps,
    EncodedUnpaired,
    collate_pairs,
    collate_prompts,
    collate_sft,
    collate_steps,
    collate_unpaired,
)
from rlhf_lightning.data.formats import (
    parse_preference,
    parse_prompt,
    parse_sft,
    parse_stepwise,
    parse_unpaired,
)
from rlhf_lightning.data.loader import ResumableLoader
from rlhf_lightning.data.sources import DataFormatError, Record, read_records
from rlhf_lightning.data.tokenize import encode_completion, encode_prompt, encode_steps, separator_token_id
from rlhf_lightning.tasks import TASKS, make_task
from rlhf_lightning.utils import checks

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
UNKNOWN_SHARE_WARNING = 0.1  # above this share of unknown tokens, the tokenizer does not fit the data


def token_ids(example: Any) -> list[int]:
    """Every token id of an encoded example (prompt, demonstration or pair)."""
    if isinstance(example, EncodedPair):
        return [*example.chosen_ids, *example.rejected_ids]
    if isinstance(example, EncodedUnpaired):
        return [*example.prompt_ids, *example.completion_ids]
    return list(example.input_ids)


class StageDataModule(L.LightningDataModule):
    """What the stage data modules share: where rows come from, the validation split, batching.

    Args:
        dataset: ``synthetic`` or ``arithmetic`` (an embedded task, generated from ``seed``), a ``.jsonl``/``.json``/``.parquet``
            file, a folder saved by ``datasets``, or a ``datasets`` hub id.
        split: split to read from a ``datasets`` folder or hub id.
        val_dataset: where validation rows come from (same forms); null holds out ``val_fraction`` of
            ``dataset``.
        val_split: split of ``val_dataset`` to read.
        val_fraction: share of ``dataset`` held out for validation when ``val_dataset`` is null (0 = none).
        synthetic_rows: rows generated when ``dataset`` is an embedded task.
        batch_size: examples per training batch on each device.
        val_batch_size: examples per validation batch; null = ``batch_size``.
        max_length: longest example in tokens.
        on_too_long: ``skip`` drops longer examples with a logged count and the first few rows; ``error`` stops
            at the first one.
        num_workers: DataLoader worker processes.
        seed: seed of the synthetic rows, the validation hold-out and the shuffling.
    """

    kind: ClassVar[str]
    # Whether examples carry their position in their set (``index``): it keys values computed once per example
    # (DPO's precomputed reference) and seeds each prompt's samples under ``seed_scope: prompt``.
    numbered: ClassVar[bool] = False

    def __init__(
        self,
        dataset: str = SYNTHETIC,
        split: str = "train",
        val_dataset: str | None = None,
        val_split: str = "test",
        val_fraction: float = 0.05,
        synthetic_rows: int = 10_000,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        max_length: int = 512,
        on_too_long: Literal["skip", "error"] = "skip",
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        checks.in_range("val_fraction", val_fraction, 0.0, 1.0, high_open=True)
        for name, value in {"synthetic_rows": synthetic_rows, "batch_size": batch_size,
                            "max_length": max_length}.items():
            checks.at_least(name, value)
        checks.at_least("val_batch_size", val_batch_size, optional=True)
        checks.at_least("num_workers", num_workers, minimum=0)
        checks.one_of("on_too_long", on_too_long, ("skip", "error"))
        val_dataset = checks.optional_str(val_dataset)
        self.dataset = dataset
        self.split = split
        self.val_dataset = val_dataset
        self.val_split = val_split
        self.val_fraction = val_fraction
        self.synthetic_rows = synthetic_rows
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.max_length = max_length
        self.on_too_long = on_too_long
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.train_set: list[Any] | None = None
        self.val_set: list[Any] = []

    # ---- what subclasses define ---------------------------------------------------------------------------

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        """``n`` rows of the embedded task ``task`` in this stage's format."""
        raise NotImplementedError

    def encode(self, record: Record) -> Any:
        """Parse and tokenize one row (a list when a row gives several examples); raise ``DataFormatError``
        naming ``record.where`` if it is malformed."""
        raise NotImplementedError

    def length(self, example: Any) -> int:
        """Length in tokens that ``max_length`` limits."""
        raise NotImplementedError

    def longest(self) -> int:
        """The longest example of the training and validation data, in tokens (see :meth:`length`)."""
        return max((self.length(example) for example in [*(self.train_set or []), *self.val_set]), default=0)

    def collate(self, examples: list[Any]) -> dict:
        raise NotImplementedError

    # ---- Lightning hooks --------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.tokenizer is None:
            self.tokenizer = self.trainer.lightning_module.tokenizer
        records = self._read(self.dataset, self.split)
        if self.val_dataset is not None:
            val_records = self._read(self.val_dataset, self.val_split)
        else:
            records, val_records = self._hold_out(records)
        self.train_set = self._encode_all(records, self.dataset)
        self.val_set = self._encode_all(val_records, self.val_dataset or self.dataset) if val_records else []

    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(
            self.train_set, self.batch_size, self.collate, shuffle=True, seed=self.seed, num_workers=self.num_workers,
            limit=self.trainer.limit_train_batches if self.trainer is not None else 1.0,
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_set:
            return []
        return DataLoader(
            self.val_set, batch_size=self.val_batch_size, collate_fn=self.collate, num_workers=self.num_workers
        )

    def training_source(self) -> str:
        """Where the training rows come from, as the data's own messages name it: a file's path, an embedded
        task, or ``folder-or-hub-id[split]``."""
        if self.dataset in TASKS or os.path.isfile(self.dataset):
            return self.dataset
        return f"{self.dataset}[{self.split}]"

    # ---- helpers ----------------------------------------------------------------------------------------

    def _read(self, dataset: str, split: str) -> list[Record]:
        if dataset in TASKS:
            rows = self.synthetic(self.synthetic_rows, dataset)
            return [Record(f"{dataset}[{self.kind}] row {i + 1}", row) for i, row in enumerate(rows)]
        return read_records(dataset, split)

    def _hold_out(self, records: list[Record]) -> tuple[list[Record], list[Record]]:
        n_val = int(len(records) * self.val_fraction)
        if n_val == 0:
            return records, []
        order = list(range(len(records)))
        random.Random(self.seed).shuffle(order)
        val = set(order[:n_val])
        return [r for i, r in enumerate(records) if i not in val], [r for i, r in enumerate(records) if i in val]

    def _encode_all(self, records: list[Record], source: str) -> list[Any]:
        examples, too_long = [], []
        for record in records:
            encoded = self.encode(record)
            for example in encoded if isinstance(encoded, list) else [encoded]:
                if self.length(example) > self.max_length:
                    if self.on_too_long == "error":
                        raise DataFormatError(
                            f"{record.where}: {self.length(example)} tokens, over max_length={self.max_length} "
                            "(raise max_length, or set on_too_long: skip)"
                        )
                    too_long.append(record.where)
                    continue
                examples.append(example)
        if too_long:
            log.warning(
                "%s: skipped %d of %d examples longer than max_length=%d tokens (first: %s)",
                source, len(too_long), len(records), self.max_length, ", ".join(too_long[:3]),
            )
        if not examples:
            raise DataFormatError(f"{source}: no usable examples (all {len(records)} longer than max_length?)")
        if self.numbered:
            examples = [replace(example, index=i) for i, example in enumerate(examples)]
        self._warn_unknown_tokens(examples, source)
        return examples

    def _warn_unknown_tokens(self, examples: list[Any], source: str) -> None:
        """Text the tokenizer cannot spell becomes its unknown token: say so when that is much of the data (the
        embedded tasks' word-level tokenizers on other text, say), where training would learn nothing of it."""
        unknown = self.tokenizer.unk_token_id
        if unknown is None:
            return
        ids = [token for example in examples for token in token_ids(example)]
        share = sum(token == unknown for token in ids) / max(len(ids), 1)
        if share > UNKNOWN_SHARE_WARNING:
            log.warning("%s: %.0f%% of its tokens are %s under tokenizer %r (%d tokens): it does not spell this "
                        "text; set base.tokenizer or base.name_or_path to a model of the data's language",
                        source, 100 * share, self.tokenizer.unk_token, getattr(self.tokenizer, "name_or_path", "?"),
                        len(self.tokenizer))


class SFTDataModule(StageDataModule):
    """Demonstrations for supervised fine-tuning.

    Rows are ``prompt``/``completion`` (text, or message lists), ``text`` (loss on every token) or ``messages``
    (loss on the last assistant message). The completion is closed with EOS.
    """

    kind = "sft"

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        return make_task(task, self.seed).sft_rows(n)

    def encode(self, record: Record) -> EncodedSFT:
        example = parse_sft(record)
        prompt_ids = encode_prompt(self.tokenizer, example.prompt, record.where)
        completion_ids = encode_completion(self.tokenizer, example.prompt, example.completion, prompt_ids,
                                           record.where)
        return EncodedSFT(prompt_ids + completion_ids, len(prompt_ids))

    def length(self, example: EncodedSFT) -> int:
        return len(example.input_ids)

    def collate(self, examples: list[EncodedSFT]) -> dict:
        return collate_sft(examples, self.tokenizer.pad_token_id)


class PreferenceDataModule(StageDataModule):
    """Preference pairs, for a Bradley-Terry reward model or DPO.

    Rows are ``prompt``/``chosen``/``rejected`` (text, or message lists), or only ``chosen``/``rejected`` holding
    whole transcripts (Anthropic HH style; the shared beginning becomes the prompt). An optional ``margin``
    column asks for ``r_chosen - r_rejected`` to exceed it; optional ``gold_chosen``/``gold_rejected`` (true
    scores, as the synthetic task has) add accuracy against the gold order to validation. Batches also carry
    the response mask and the left-padded prompts (see :func:`collate_pairs`); pairs are numbered by their
    position in the training and validation sets.
    """

    kind = "preferences"
    numbered = True

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        return make_task(task, self.seed).preference_rows(n)

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


class StepwiseDataModule(StageDataModule):
    """Worked responses labelled step by step, for a process reward model (TRL's stepwise form).

    Rows are ``prompt`` (text or messages), ``completions`` (the steps, a list of strings) and ``labels`` (one bool
    per step: the step is right); the embedded ``arithmetic`` task generates them with each step checked. Each
    step is followed by the model's ``separator`` token, which carries the step's label; every other token is
    ignored by the loss (``labels`` -100). A row whose label count differs from its step count, whose label is not
    a bool or whose step holds the separator stops the run, naming its file and row.

    Args:
        train_on_last_step_only: train on each row's last label only (TRL's option); validation reads every step.
    """

    kind = "stepwise"

    def __init__(self, *args: Any, train_on_last_step_only: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_on_last_step_only = train_on_last_step_only
        self.separator: str | None = None  # the model's (ProcessRewardModel.separator), read in setup
        self._last_step_only = False
        self._separator_id: int | None = None

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        made = make_task(task, self.seed)
        if not hasattr(made, "stepwise_rows"):
            raise DataFormatError(f"dataset: the embedded task {task!r} has no step-labelled rows; use "
                                  "dataset: arithmetic, or a JSONL file of prompt, completions and labels")
        return made.stepwise_rows(n)

    def setup(self, stage: str) -> None:
        if self.separator is None and self.train_set is None:
            self.separator = self.trainer.lightning_module.separator
        super().setup(stage)

    @property
    def separator_id(self) -> int:
        """The separator's one token id (checked once: the tokenizer does not change)."""
        if self._separator_id is None:
            self._separator_id = separator_token_id(self.tokenizer, self.separator, "separator")
        return self._separator_id

    def _encode_all(self, records: list[Record], source: str) -> list[Any]:
        # The training set first (see StageDataModule.setup): only it may keep its last labels only.
        self._last_step_only = self.train_on_last_step_only and self.train_set is None
        return super()._encode_all(records, source)

    def encode(self, record: Record) -> EncodedSteps:
        example = parse_stepwise(record, self.separator)
        prompt_ids = encode_prompt(self.tokenizer, example.prompt, record.where)
        return encode_steps(self.tokenizer, prompt_ids, example.steps, example.labels, self.separator_id,
                            record.where, self._last_step_only)

    def length(self, example: EncodedSteps) -> int:
        return len(example.input_ids)

    def collate(self, examples: list[EncodedSteps]) -> dict:
        return collate_steps(examples, self.tokenizer.pad_token_id)


class PromptDataModule(StageDataModule):
    """Prompts for reinforcement learning, and optionally pretraining text for the PPO-ptx loss.

    Rows have a ``prompt`` column of text or messages (the chat template opens the assistant turn).
    ``batch_size`` is the number of prompts per rollout on each device, and ``max_length`` limits the prompt.
    Training batches are ``{"prompts": ..., "ptx": ...}`` (``ptx`` only when ``ptx_dataset`` is set); prompts are
    numbered by their position in the training and validation sets (``index``).

    Args:
        ptx_dataset: SFT-format data (``text``, ``prompt``/``completion`` or ``messages``) for the pretraining
            term; ``synthetic`` uses the embedded task's demonstrations; null = none.
        ptx_batch_size: pretraining examples per PPO iteration.
        ptx_max_length: longest pretraining example, in tokens.
    """

    kind = "prompts"
    numbered = True

    def __init__(
        self,
        *args: Any,
        ptx_dataset: str | None = None,
        ptx_batch_size: int = 8,
        ptx_max_length: int = 512,
        **kwargs: Any,
    ) -> None:
        checks.at_least("ptx_batch_size", ptx_batch_size)
        checks.at_least("ptx_max_length", ptx_max_length)
        ptx_dataset = checks.optional_str(ptx_dataset)
        super().__init__(*args, **kwargs)
        self.ptx = None
        if ptx_dataset is not None:
            self.ptx = SFTDataModule(
                dataset=ptx_dataset, val_fraction=0.0, synthetic_rows=self.synthetic_rows,
                batch_size=ptx_batch_size, max_length=ptx_max_length, on_too_long=self.on_too_long,
                num_workers=self.num_workers, seed=self.seed,
            )

    def synthetic(self, n: int, task: str = SYNTHETIC) -> list[dict]:
        return make_task(task, self.seed).prompt_rows(n)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.ptx is not None and self.ptx.train_set is None:
            self.ptx.tokenizer = self.tokenizer
            self.ptx.setup(stage)

    def encode(self, record: Record) -> EncodedPrompt:
        example = parse_prompt(record)
        ids = encode_prompt(self.tokenizer, example.prompt, record.where)
        if not ids:
            raise DataFormatError(f"{record.where}: the prompt has no tokens; generation needs at least one")
        columns = {name: value for name, value in record.fields.items() if name != "prompt"}
        return EncodedPrompt(ids, self.tokenizer.decode(ids, skip_special_tokens=True), example.prompt, columns,
                             where=record.where)

    def length(self, example: EncodedPrompt) -> int:
        return len(example.input_ids)

    @property
    def columns(self) -> list[str]:
        """The dataset's columns besides ``prompt`` (what reward functions receive as keywords)."""
        return sorted({name for example in [*(self.train_set or []), *self.val_set] for name in example.columns})

    def collate(self, examples: list[EncodedPrompt]) -> dict:
        return collate_prompts(examples, self.tokenizer.pad_token_id)

    def train_dataloader(self) -> dict[str, ResumableLoader]:
        # A dict of loaders: Lightning combines them, cycling the shorter one.
        loaders = {"prompts": super().train_dataloader()}
        if self.ptx is not None:
            loaders["ptx"] = self.ptx.train_dataloader()
        return loaders
