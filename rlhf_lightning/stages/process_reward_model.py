"""Process reward model: a ``prm`` LoRA adapter and a head on the frozen SFT base, trained to tell right steps from
wrong ones (Lightman et al. 2023, "Let's Verify Step by Step"; Wang et al. 2024, "Math-Shepherd").

The data is TRL's stepwise form (:class:`~rlhf_lightning.data.modules.StepwiseDataModule`): every step is followed
by the separator token, and the head's logit at that token is the step's "right" logit, trained with binary
cross-entropy there and nowhere else, as TRL's ``PRMTrainer`` did (TRL removed it in 2026, #7133).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import BinaryAUROC, BinaryF1Score

from rlhf_lightning.core.stage import SupervisedStage
from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.data.tokenize import separator_token_id
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rewards.process_reward import PRM_CONFIG, PRM_ROLE
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.metrics import MeanStd, reset_metrics
from rlhf_lightning.utils.optim import OptimizerSettings


class ProcessRewardModel(SupervisedStage):
    """A process reward model trained on step-labelled responses: one logit per step, read at the separator token
    that ends it, with binary cross-entropy against the step's label (right = 1).

    At the end of ``fit`` the adapter is written to ``export_dir/prm`` in peft format with ``head.safetensors``,
    the base's fingerprint and ``prm_config.json`` (the separator), which
    :class:`~rlhf_lightning.rewards.process_reward.ProcessReward` loads onto the policy's base.

    Args:
        base: the frozen base, normally the SFT model whose responses the PRM will score.
        lora: the ``prm`` adapter.
        separator: the text that ends every step, one token of the tokenizer (TRL's default ``"\\n"``; ``","`` for
            the arithmetic task, whose steps are joined by ``" , "``).
        optimizer: AdamW and its schedule (``lr``, ``weight_decay``, ``warmup`` in optimizer steps, ``schedule``,
            ``adam_eps``, ``nonfinite``: see :class:`~rlhf_lightning.utils.optim.OptimizerSettings`).
        export_dir: folder for the trained PRM, under the run folder (``trainer.default_root_dir``) unless
            absolute; null = do not export.
    """

    metric_prefix = "prm"
    default_optimizer = OptimizerSettings(schedule="linear")

    def __init__(
        self,
        base: BaseModelSpec,
        lora: LoraSpec = LoraSpec(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        separator: str = "\n",
        optimizer: OptimizerSettings = default_optimizer,
        export_dir: str | None = None,
    ) -> None:
        if not isinstance(separator, str) or not separator:
            raise ValueError(f"separator: expected the non-empty text that ends each step, got {separator!r}")
        export_dir = checks.optional_str(export_dir)
        super().__init__(base)
        self.save_hyperparameters()
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)
        self.lora = lora.check("lora")
        self.separator = separator
        self.val_loss = MeanStd()
        self.val_step_accuracy = MeanStd()
        self.val_solution_accuracy = MeanStd()
        # Finding the wrong steps is what a PRM is for: ranked (AUROC) and at the 0.5 threshold (F1).
        self.val_wrong_auroc = BinaryAUROC()
        self.val_wrong_f1 = BinaryF1Score()

    @property
    def separator_id(self) -> int:
        """The separator's token id (one token, checked)."""
        return separator_token_id(self.tokenizer, self.separator, "separator")

    def build_model(self, empty: bool) -> SharedBase:
        self.separator_id  # noqa: B018 (a separator of several tokens fails before any weight is read)
        model = self.load_base(empty=empty)
        model.add_adapter(PRM_ROLE, self.lora)
        model.add_head(PRM_ROLE)
        return model

    def step_logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The head's "right step" logit ``[B, T]`` at every token (read at the separators)."""
        with self.model.role(PRM_ROLE):
            hidden = self.model.hidden_states(input_ids, attention_mask)
        return self.model.heads[PRM_ROLE](hidden)

    def _labelled(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits, labels, where)``: the logits and 0/1 labels of the labelled steps, and the ``[B, T]`` mask of
        where they are."""
        where = batch["labels"] != IGNORE_INDEX
        logits = self.step_logits(batch["input_ids"], batch["attention_mask"])
        return logits[where], batch["labels"][where].float(), where

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits, labels, _ = self._labelled(batch)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.guard_losses({"prm/loss": loss})
        accuracy = ((logits > 0).float() == labels).float().mean()
        self.log_dict({"prm/loss": loss, "prm/step_accuracy": accuracy, "prm/right_fraction": labels.mean(),
                       "prm/lr": self.trainer.optimizers[0].param_groups[0]["lr"]}, sync_dist=True)
        self.log_dict({"loss": loss, "acc": accuracy}, prog_bar=True, logger=False, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        logits, labels, where = self._labelled(batch)
        self.val_loss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
        correct = (logits > 0).float() == labels
        self.val_step_accuracy.update(correct.float())
        # A solution is judged right when every one of its labelled steps is.
        wrong_per_row = torch.zeros(where.shape, dtype=torch.bool, device=where.device)
        wrong_per_row[where] = ~correct
        self.val_solution_accuracy.update((~wrong_per_row.any(-1)).float())
        self.val_wrong_auroc.update(torch.sigmoid(-logits), (labels == 0).long())
        self.val_wrong_f1.update(torch.sigmoid(-logits), (labels == 0).long())

    def on_validation_epoch_end(self) -> None:
        metrics = {"prm/val/loss": self.val_loss.compute()[0],
                   "prm/val/step_accuracy": self.val_step_accuracy.compute()[0],
                   "prm/val/solution_accuracy": self.val_solution_accuracy.compute()[0],
                   "prm/val/wrong_step_f1": self.val_wrong_f1.compute(),
                   "prm/val/wrong_step_auroc": self.val_wrong_auroc.compute()}
        self.log_dict(metrics, prog_bar=True, sync_dist=True)
        reset_metrics(self.val_loss, self.val_step_accuracy, self.val_solution_accuracy, self.val_wrong_auroc,
                      self.val_wrong_f1)
        super().on_validation_epoch_end()

    def export(self, directory: str | Path) -> Path:
        """Write the PRM to ``directory/prm``: the adapter (peft format), its head, the base's fingerprint and
        ``prm_config.json`` with the separator and its token id. Every rank takes part; rank 0 writes."""
        out = self.model.save_adapter(PRM_ROLE, directory, write=self.is_writer)
        if self.is_writer:
            (out / PRM_CONFIG).write_text(json.dumps({"separator": self.separator,
                                                       "separator_id": self.separator_id}, indent=2))
        return out
