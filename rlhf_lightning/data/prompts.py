"""The data module of the online algorithms (:class:`PromptDataModule`): prompts for reinforcement learning, and
optionally pretraining text for the PPO-ptx loss."""

from __future__ import annotations

from typing import Any

from rlhf_lightning.data.collate import EncodedPrompt, collate_prompts
from rlhf_lightning.data.demonstrations import SFTDataModule
from rlhf_lightning.data.formats import parse_prompt
from rlhf_lightning.data.loader import ResumableLoader
from rlhf_lightning.data.sources import DataFormatError, Record
from rlhf_lightning.data.stage_data import SYNTHETIC, StageDataModule
from rlhf_lightning.data.tokenize import encode_prompt
from rlhf_lightning.tasks import make_task
from rlhf_lightning.utils import checks


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
