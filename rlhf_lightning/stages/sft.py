"""Supervised fine-tuning: next-token loss on completion tokens only."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric

from rlhf_lightning.core.stage import SupervisedStage
from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.metrics import reset_metrics
from rlhf_lightning.utils.optim import OptimizerSettings

SFT_ADAPTER = "sft"


class SFT(SupervisedStage):
    """Supervised fine-tuning of a causal LM on demonstrations; prompt tokens carry no loss.

    At the end of ``fit`` the model is written to ``export_dir`` as a plain transformers model (a LoRA adapter
    merged in) with its tokenizer, ready to be the frozen base of the reward and PPO stages.

    Args:
        base: the model to fine-tune (a fresh one from ``architecture`` pretrains from scratch).
        lora: train a LoRA adapter instead of all weights; null = full fine-tuning.
        optimizer: AdamW and its schedule (``lr``, ``weight_decay``, ``warmup`` in optimizer steps, ``schedule``,
            ``adam_eps``, ``nonfinite``: see :class:`~rlhf_lightning.utils.optim.OptimizerSettings`).
        export_dir: folder for the final model and tokenizer, under the run folder (``trainer.default_root_dir``)
            unless absolute; null = do not export.
        export_format: ``merged``: a plain transformers model with the LoRA adapter merged in; ``adapter``: the LoRA
            adapter alone, in peft format, in ``<export_dir>/sft`` (needs ``lora``), to be loaded onto this same
            base, e.g. as a judge (``JudgeReward`` ``adapter``).
    """

    metric_prefix = "sft"

    def __init__(
        self,
        base: BaseModelSpec,
        lora: LoraSpec | None = None,
        optimizer: OptimizerSettings = SupervisedStage.default_optimizer,
        export_dir: str | None = None,
        export_format: Literal["merged", "adapter"] = "merged",
    ) -> None:
        checks.one_of("export_format", export_format, ("merged", "adapter"))
        if export_format == "adapter" and lora is None:
            raise ValueError("export_format: adapter exports the LoRA adapter; set lora (or export_format: merged)")
        export_dir = checks.optional_str(export_dir)
        super().__init__(base)
        self.save_hyperparameters()
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)
        self.lora = lora.check("lora") if lora is not None else None
        self.adapter = SFT_ADAPTER if lora is not None else None
        self.val_loss = MeanMetric()

    def build_model(self, empty: bool) -> SharedBase:
        model = self.load_base(train_base=self.lora is None, empty=empty)
        if self.lora is not None:
            model.add_adapter(SFT_ADAPTER, self.lora)
        return model

    def summed_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Next-token cross-entropy summed over completion tokens, and the number of those tokens."""
        with self.model.role(self.adapter):
            logits = self.model.next_token_logits(batch["input_ids"], batch["attention_mask"])
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
        return loss, (labels != IGNORE_INDEX).sum()

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Mean next-token cross-entropy over completion tokens, and the number of those tokens."""
        summed, tokens = self.summed_loss(batch)
        return summed / tokens.clamp(min=1), tokens

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        summed, tokens = self.summed_loss(batch)
        # Divided by the ranks' mean token count, not this rank's: DDP and FSDP average the ranks' gradients, so
        # every completion token of the global batch weighs the same wherever it is (one process: the mean).
        loss = summed / self.ranks.mean(tokens.float()).clamp(min=1)
        self.guard_losses({"sft/loss": loss})
        self.log("sft/loss", loss, prog_bar=True, sync_dist=True)  # the global batch's token mean
        self.log("sft/tokens", tokens.float(), reduce_fx="sum", sync_dist=True)
        self.log("sft/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, tokens = self.loss(batch)
        self.val_loss.update(loss, weight=tokens)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # token-weighted over the whole validation set, all ranks
        reset_metrics(self.val_loss)
        # Already the value of every rank: sync_dist averages equal values (and keeps Lightning's advice away).
        self.log("sft/val/loss", loss, sync_dist=True)
        self.log("sft/val/perplexity", torch.exp(loss.clamp(max=50.0)), sync_dist=True)
        super().on_validation_epoch_end()

    def export(self, directory: str | Path) -> Path:
        """Write the fine-tuned model (adapter merged) and tokenizer as a transformers folder, or with
        ``export_format: adapter`` the adapter alone (returns its folder). In a distributed fit every rank takes
        part (a sharded model is gathered) and rank 0 writes."""
        with torch.no_grad():
            if self.hparams.get("export_format", "merged") == "adapter":
                return self.model.save_adapter(SFT_ADAPTER, directory, write=self.is_writer)
            return self.model.save_merged(self.adapter, directory, self.tokenizer, write=self.is_writer)
