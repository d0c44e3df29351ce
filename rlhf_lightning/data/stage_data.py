"""What the stage data modules share (:class:`StageDataModule`): where rows come from (the embedded tasks, files, a
``datasets`` folder or hub id), the validation split, checking and tokenizing every row once in ``setup``, the
``max_length`` limit, and resumable training batches. The tokenizer is the LightningModule's, so model and data can
never disagree on it.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import replace
from typing import Any, ClassVar, Literal

import lightning as L
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.data.collate import EncodedPair, EncodedUnpaired
from rlhf_lightning.data.loader import ResumableLoader
from rlhf_lightning.data.sources import DataFormatError, Record, read_records
from rlhf_lightning.tasks import TASKS
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
