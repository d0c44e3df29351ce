"""Data modules of supervised targets: demonstrations for SFT (:class:`SFTDataModule`) and worked responses labelled
step by step for a process reward model (:class:`StepwiseDataModule`)."""

from __future__ import annotations

from typing import Any

from rlhf_lightning.data.collate import EncodedSFT, EncodedSteps, collate_sft, collate_steps
from rlhf_lightning.data.formats import parse_sft, parse_stepwise
from rlhf_lightning.data.sources import DataFormatError, Record
from rlhf_lightning.data.stage_data import SYNTHETIC, StageDataModule
from rlhf_lightning.data.tokenize import encode_completion, encode_prompt, encode_steps, separator_token_id
from rlhf_lightning.tasks import make_task


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
