"""Bradley-Terry reward model: a ``reward`` LoRA adapter and a score head on the frozen SFT base."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from rlhf_lightning.algorithms.preference import bradley_terry_loss
from rlhf_lightning.core.stage import SupervisedStage
from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.sharding import full_tensor
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.metrics import MeanStd, PairwiseAccuracy, reset_metrics
from rlhf_lightning.utils.nonfinite import check_finite_weights
from rlhf_lightning.utils.optim import OptimizerSettings

REWARD_ROLE = "reward"
REWARD_STATS = "reward_stats.json"


class RewardModel(SupervisedStage):
    """A reward model trained on preference pairs with the Bradley-Terry loss.

    The score of a sequence is the head's output at its last token (the EOS). Chosen and rejected sequences go
    through the model in one forward pass. At the end of ``fit`` the adapter is written to
    ``export_dir/reward`` in peft format with ``head.safetensors`` and ``reward_stats.json`` (mean and std of
    the scores over the validation data, for reward normalisation in PPO).

    Args:
        base: the frozen base, normally the SFT model.
        lora: the ``reward`` adapter; null = full fine-tuning of the base (then the export is a whole model).
        center_coef: weight of the reward-centering term ``mean((r_chosen + r_rejected)^2)``; 0 = off.
        optimizer: AdamW and its schedule (``lr``, ``weight_decay``, ``warmup`` in optimizer steps, ``schedule``,
            ``adam_eps``, ``nonfinite``: see :class:`~rlhf_lightning.utils.optim.OptimizerSettings`).
        export_dir: folder for the trained reward model, under the run folder (``trainer.default_root_dir``)
            unless absolute; null = do not export.
    """

    metric_prefix = "rm"
    default_optimizer = OptimizerSettings(schedule="linear")

    def __init__(
        self,
        base: BaseModelSpec,
        lora: LoraSpec | None = LoraSpec(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        center_coef: float = 0.0,
        optimizer: OptimizerSettings = default_optimizer,
        export_dir: str | None = None,
    ) -> None:
        checks.non_negative("center_coef", center_coef)
        export_dir = checks.optional_str(export_dir)
        super().__init__(base)
        self.save_hyperparameters()
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)
        self.lora = lora.check("lora") if lora is not None else None
        self.adapter = REWARD_ROLE if lora is not None else None
        self.val_accuracy = PairwiseAccuracy()
        self.val_gold_accuracy = PairwiseAccuracy()
        self.val_rewards = MeanStd()
        self.val_loss = MeanStd()
        self.val_margin = MeanStd()

    def build_model(self, empty: bool) -> SharedBase:
        model = self.load_base(train_base=self.lora is None, empty=empty)
        if self.lora is not None:
            model.add_adapter(REWARD_ROLE, self.lora)
        model.add_head(REWARD_ROLE)
        return model

    def rewards(self, input_ids: Tensor, attention_mask: Tensor, last_index: Tensor) -> Tensor:
        """Scores ``[N]`` of right- or left-padded sequences, read at ``last_index``."""
        with self.model.role(self.adapter):
            hidden = self.model.hidden_states(input_ids, attention_mask)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.model.heads[REWARD_ROLE](hidden[rows, last_index])

    def _pair_rewards(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        chosen, rejected = self.rewards(batch["input_ids"], batch["attention_mask"], batch["last_index"]).chunk(2)
        return chosen, rejected

    def _loss(self, chosen: Tensor, rejected: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return bradley_terry_loss(chosen, rejected, batch["margin"], self.hparams.center_coef)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        chosen, rejected = self._pair_rewards(batch)
        loss = self._loss(chosen, rejected, batch)
        self.guard_losses({"rm/loss": loss})
        both = torch.cat([chosen, rejected]).detach()
        self.log_dict(
            {
                "rm/loss": loss,
                "rm/accuracy": (chosen > rejected).float().mean(),
                "rm/margin": (chosen - rejected).mean(),
                "rm/reward_mean": both.mean(),
                "rm/reward_std": both.std(),
                "rm/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            },
            prog_bar=False, sync_dist=True,  # the global batch's values, not rank 0's share
        )
        self.log_dict({"loss": loss, "acc": (chosen > rejected).float().mean()}, prog_bar=True, logger=False,
                      sync_dist=True)

        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        chosen, rejected = self._pair_rewards(batch)
        self.val_loss.update(-torch.nn.functional.logsigmoid(chosen - rejected - batch["margin"]))
        self.val_accuracy.update(chosen, rejected)
        self.val_margin.update(chosen - rejected)
        self.val_rewards.update(torch.cat([chosen, rejected]))
        if "gold_chosen" in batch:
            gold_prefers_chosen = batch["gold_chosen"] > batch["gold_rejected"]
            self.val_gold_accuracy.update(
                torch.where(gold_prefers_chosen, chosen, rejected), torch.where(gold_prefers_chosen, rejected, chosen)
            )

    def on_validation_epoch_end(self) -> None:
        mean, std = self.val_rewards.compute()
        metrics = {
            "rm/val/loss": self.val_loss.compute()[0],
            "rm/val/accuracy": self.val_accuracy.compute(),
            "rm/val/margin": self.val_margin.compute()[0],
            "rm/val/reward_mean": mean,
            "rm/val/reward_std": std,
        }
        if self.val_gold_accuracy.update_count > 0:
            metrics["rm/val/gold_accuracy"] = self.val_gold_accuracy.compute()
        self.log_dict(metrics, prog_bar=True, sync_dist=True)  # every rank's values already: sync_dist keeps them
        reset_metrics(self.val_loss, self.val_accuracy, self.val_margin, self.val_rewards, self.val_gold_accuracy)
        super().on_validation_epoch_end()

    def on_fit_end(self) -> None:
        if self.export_folder is not None:
            # Every rank scores the same batches (a sharded model's forward passes are collective).
            datamodule = self.trainer.datamodule
            loader = datamodule.val_dataloader() if datamodule is not None else []
            if not loader:
                loader = datamodule.train_dataloader()
            self.export(self.export_folder, reward_statistics(self, loader))

    def export(self, directory: str | Path, stats: dict[str, float] | None = None) -> Path:
        """Write the reward model to ``directory/reward``: the adapter (peft format) or, under full fine-tuning,
        the whole model; the score head; and the reward statistics if given. In a distributed fit every rank
        takes part (a sharded model is gathered) and rank 0 writes."""
        directory = Path(directory)
        if stats is not None:
            checks.finite("reward statistics mean", stats["mean"])
            checks.finite("reward statistics std", stats["std"])
        if self.adapter is not None:
            out = self.model.save_adapter(REWARD_ROLE, directory, write=self.is_writer)
        else:
            out = self.model.save_merged(None, directory / REWARD_ROLE, self.tokenizer, write=self.is_writer)
            head = {key: full_tensor(value.detach()) for key, value in self.model.heads[REWARD_ROLE].state_dict().items()}
            if self.is_writer:
                check_finite_weights(head, f"the reward model's head to {directory}")
                ScalarHead.save_state(out, head, self.model.hidden_size)
        if stats is not None and self.is_writer:
            (out / REWARD_STATS).write_text(json.dumps(stats, indent=2))
        return out


@torch.no_grad()
def reward_statistics(module: RewardModel, loader) -> dict[str, float]:
    """Mean and std of the scores of every sequence (chosen and rejected) served by ``loader`` (the same on
    every rank: each rank scores every batch, so nothing is synchronised)."""
    stats = MeanStd(sync_on_compute=False).to(module.device)
    was_training = module.training
    module.eval()
    for batch in loader:
        batch = {key: value.to(module.device) for key, value in batch.items()}
        stats.update(module.rewards(batch["input_ids"], batch["attention_mask"], batch["last_index"]))
    module.train(was_training)
    mean, std = stats.compute()
    return {"mean": float(mean), "std": float(std), "count": int(stats.count)}
