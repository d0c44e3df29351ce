"""Bradley-Terry reward model: a ``reward`` LoRA adapter and a score head on the frozen SFT base, or an ensemble of
them, each member an adapter and a head of its own on the same base."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from rlhf_lightning.algorithms.ensemble import MEMBER_DATA, MemberData, member_variance, pair_weights
from rlhf_lightning.algorithms.preference import bradley_terry_loss
from rlhf_lightning.core.stage import SupervisedStage
from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.sharding import full_tensor
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rewards.ensemble import ENSEMBLE_FILE
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.metrics import MeanStd, PairwiseAccuracy, reset_metrics
from rlhf_lightning.utils.nonfinite import check_finite_weights
from rlhf_lightning.utils.optim import OptimizerSettings

REWARD_ROLE = "reward"
REWARD_STATS = "reward_stats.json"


def member_names(members: int) -> list[str]:
    """The adapters (and heads) of an ensemble of ``members``: ``reward`` alone, or ``reward_0 .. reward_{K-1}``."""
    return [REWARD_ROLE] if members == 1 else [f"{REWARD_ROLE}_{k}" for k in range(members)]


class RewardModel(SupervisedStage):
    """A reward model trained on preference pairs with the Bradley-Terry loss.

    The score of a sequence is the head's output at its last token (the EOS). Chosen and rejected sequences go
    through the model in one forward pass. At the end of ``fit`` the adapter is written to
    ``export_dir/reward`` in peft format with ``head.safetensors`` and ``reward_stats.json`` (mean and std of
    the scores over the validation data, for reward normalisation in PPO).

    With ``members: K`` > 1 the fit trains an ensemble (for :class:`~rlhf_lightning.rewards.ensemble.EnsembleReward`,
    after Coste et al. 2023): K adapters ``reward_0 .. reward_{K-1}``, each with its own head and its own random
    initialisation, all on the one frozen base, each step every member's loss on the same batch (K forward and
    backward passes: K times the compute, not K bases in memory). The members differ by their initialisation and
    by ``member_data``. Their losses are summed, so each member gets exactly its own loss's gradient; a
    ``trainer.gradient_clip_val`` clips the members' gradients together. ``rm/loss`` and ``rm/accuracy`` are the
    members' mean (``rm/member_<k>/loss`` each), validation's ``rm/val/accuracy`` and ``gold_accuracy`` those of the
    members' mean score (``rm/val/member_<k>/...`` each) and ``rm/val/disagreement`` the members' standard deviation
    per sequence, averaged. The export is ``export_dir/reward/reward_<k>`` (each as a single reward model's, its
    own statistics included) and ``export_dir/reward/ensemble.json``.

    Args:
        base: the frozen base, normally the SFT model.
        lora: the ``reward`` adapter; null = full fine-tuning of the base (then the export is a whole model).
        center_coef: weight of the reward-centering term ``mean((r_chosen + r_rejected)^2)``; 0 = off.
        members: reward models trained together on the one base (an ensemble); 1 = a single reward model.
        member_data: what each member of an ensemble trains on: ``shared`` every pair (members differ by their
            initialisation alone, as Coste et al.'s differ by their seed; best-of-n picked better with them than
            with either other on the embedded task: docs/studies.md); ``bootstrap`` each pair weighted by the
            member's own Poisson(1) count, an online bootstrap resample; ``partition`` each pair trains one member
            (disjoint data). Drawn from the run's seed and the pair's row, so a resumed fit draws the same.
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
        members: int = 1,
        member_data: MemberData = "shared",
        optimizer: OptimizerSettings = default_optimizer,
        export_dir: str | None = None,
    ) -> None:
        checks.non_negative("center_coef", center_coef)
        checks.at_least("members", members)
        checks.one_of("member_data", member_data, MEMBER_DATA)
        if members > 1 and lora is None:
            raise ValueError(f"members={members}: an ensemble is one reward adapter per member on the shared base, "
                             "and lora is null (full fine-tuning); set lora, or members: 1")
        export_dir = checks.optional_str(export_dir)
        super().__init__(base)
        self.save_hyperparameters()
        self.optimizer_settings = self.keep_group("optimizer", optimizer, self.default_optimizer)
        self.lora = lora.check("lora") if lora is not None else None
        self.members = member_names(members)  # each member's adapter and head
        self.val_accuracy = PairwiseAccuracy()
        self.val_gold_accuracy = PairwiseAccuracy()
        self.val_rewards = MeanStd()
        self.val_loss = MeanStd()
        self.val_margin = MeanStd()
        if members > 1:
            self.val_member_accuracy = torch.nn.ModuleList(PairwiseAccuracy() for _ in self.members)
            self.val_member_gold_accuracy = torch.nn.ModuleList(PairwiseAccuracy() for _ in self.members)
            self.val_disagreement = MeanStd()

    def build_model(self, empty: bool) -> SharedBase:
        model = self.load_base(train_base=self.lora is None, empty=empty)
        for member in self.members:  # each member's adapter and head drawn in turn: their initialisations differ
            if self.lora is not None:
                model.add_adapter(member, self.lora)
            model.add_head(member)
        return model

    def rewards(self, input_ids: Tensor, attention_mask: Tensor, last_index: Tensor,
                member: str = REWARD_ROLE) -> Tensor:
        """Scores ``[N]`` of right- or left-padded sequences, read at ``last_index``, by ``member`` (an ensemble's
        ``reward_<k>``; the single reward model's by default)."""
        with self.model.role(member if self.lora is not None else None):
            hidden = self.model.hidden_states(input_ids, attention_mask)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.model.heads[member](hidden[rows, last_index])

    def _pair_rewards(self, batch: dict[str, Tensor], member: str = REWARD_ROLE) -> tuple[Tensor, Tensor]:
        chosen, rejected = self.rewards(batch["input_ids"], batch["attention_mask"], batch["last_index"],
                                        member).chunk(2)
        return chosen, rejected

    def _loss(self, chosen: Tensor, rejected: Tensor, batch: dict[str, Tensor], weights: Tensor | None = None) -> Tensor:
        return bradley_terry_loss(chosen, rejected, batch["margin"], self.hparams.center_coef, weights)

    def member_weights(self, member: int, batch: dict[str, Tensor]) -> Tensor | None:
        """How much each pair of ``batch`` weighs in member ``member``'s loss (None: a single reward model)."""
        if len(self.members) == 1:
            return None
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything's: the same again on resume
        return pair_weights(self.hparams.member_data, member, len(self.members), batch["index"], seed)

    def member_losses(self, batch: dict[str, Tensor]) -> tuple[Tensor, list[Tensor], list[tuple[Tensor, Tensor]]]:
        """``(loss to minimise, each member's loss, each member's detached chosen and rejected scores)``. The members'
        losses are summed: each member's gradient is its own loss's, as if it trained alone."""
        losses, pairs = [], []
        for k, member in enumerate(self.members):
            chosen, rejected = self._pair_rewards(batch, member)
            losses.append(self._loss(chosen, rejected, batch, self.member_weights(k, batch)))
            pairs.append((chosen.detach(), rejected.detach()))
        return (losses[0] if len(losses) == 1 else torch.stack(losses).sum()), losses, pairs

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, losses, pairs = self.member_losses(batch)
        self.guard_losses({"rm/loss": loss})
        chosen, rejected = members_mean(pairs)
        both = torch.cat([chosen, rejected])
        mean_loss = loss if len(losses) == 1 else loss.detach() / len(losses)
        if len(losses) > 1:
            self.log_dict({f"rm/member_{k}/loss": value.detach() for k, value in enumerate(losses)}, sync_dist=True)
        self.log_dict(
            {
                "rm/loss": mean_loss,
                "rm/accuracy": (chosen > rejected).float().mean(),
                "rm/margin": (chosen - rejected).mean(),
                "rm/reward_mean": both.mean(),
                "rm/reward_std": both.std(),
                "rm/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            },
            prog_bar=False, sync_dist=True,  # the global batch's values, not rank 0's share
        )
        self.log_dict({"loss": mean_loss, "acc": (chosen > rejected).float().mean()}, prog_bar=True, logger=False,
                      sync_dist=True)

        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        scores = [self._pair_rewards(batch, member) for member in self.members]
        chosen, rejected = members_mean(scores)
        if len(scores) > 1:
            for k, (member_chosen, member_rejected) in enumerate(scores):
                self.val_member_accuracy[k].update(member_chosen, member_rejected)
                if "gold_chosen" in batch:
                    self.val_member_gold_accuracy[k].update(*self._gold_ordered(member_chosen, member_rejected, batch))
            every = torch.stack([torch.cat([c, r]) for c, r in scores], -1)  # [2B, K]
            self.val_disagreement.update(member_variance(every).sqrt())
        self.val_loss.update(-torch.nn.functional.logsigmoid(chosen - rejected - batch["margin"]))
        self.val_accuracy.update(chosen, rejected)
        self.val_margin.update(chosen - rejected)
        self.val_rewards.update(torch.cat([chosen, rejected]))
        if "gold_chosen" in batch:
            self.val_gold_accuracy.update(*self._gold_ordered(chosen, rejected, batch))

    @staticmethod
    def _gold_ordered(chosen: Tensor, rejected: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The scores of each pair's gold-preferred response, then of the other."""
        gold_prefers_chosen = batch["gold_chosen"] > batch["gold_rejected"]
        return torch.where(gold_prefers_chosen, chosen, rejected), torch.where(gold_prefers_chosen, rejected, chosen)

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
        if len(self.members) > 1:
            self.log_member_metrics()
        super().on_validation_epoch_end()

    def log_member_metrics(self) -> None:
        """An ensemble's validation per member (``rm/val/member_<k>/accuracy``, ``gold_accuracy``) and the members'
        disagreement (``rm/val/disagreement``: their standard deviation per sequence, averaged)."""
        metrics = {"rm/val/disagreement": self.val_disagreement.compute()[0]}
        for k in range(len(self.members)):
            metrics[f"rm/val/member_{k}/accuracy"] = self.val_member_accuracy[k].compute()
            if self.val_member_gold_accuracy[k].update_count > 0:
                metrics[f"rm/val/member_{k}/gold_accuracy"] = self.val_member_gold_accuracy[k].compute()
        self.log_dict(metrics, sync_dist=True)
        reset_metrics(self.val_disagreement, *self.val_member_accuracy, *self.val_member_gold_accuracy)

    def on_fit_end(self) -> None:
        if self.export_folder is not None:
            # Every rank scores the same batches (a sharded model's forward passes are collective).
            datamodule = self.trainer.datamodule
            loader = datamodule.val_dataloader() if datamodule is not None else []
            if not loader:
                loader = datamodule.train_dataloader()
            if len(self.members) == 1:
                self.export(self.export_folder, reward_statistics(self, loader))
            else:
                self.export_ensemble(self.export_folder, [reward_statistics(self, loader, member)
                                                          for member in self.members])

    def export_ensemble(self, directory: str | Path, stats: list[dict[str, float]]) -> Path:
        """Write an ensemble to ``directory/reward``: each member as :meth:`export` writes a single reward model
        (``reward_<k>``, its statistics included), and ``ensemble.json`` naming them. Every rank takes part."""
        out = Path(directory) / REWARD_ROLE
        for member, member_stats in zip(self.members, stats, strict=True):
            self.export(out, member_stats, member)
        if self.is_writer:
            (out / ENSEMBLE_FILE).write_text(json.dumps(
                {"members": self.members, "member_data": self.hparams.member_data}, indent=2))
        return out

    def export(self, directory: str | Path, stats: dict[str, float] | None = None, member: str = REWARD_ROLE) -> Path:
        """Write the reward model (an ensemble's ``member``) to ``directory/<member>``: the adapter (peft format)
        or, under full fine-tuning, the whole model; the score head; and the reward statistics if given. In a
        distributed fit every rank takes part (a sharded model is gathered) and rank 0 writes."""
        directory = Path(directory)
        if stats is not None:
            checks.finite("reward statistics mean", stats["mean"])
            checks.finite("reward statistics std", stats["std"])
        if self.lora is not None:
            out = self.model.save_adapter(member, directory, write=self.is_writer)
        else:
            out = self.model.save_merged(None, directory / REWARD_ROLE, self.tokenizer, write=self.is_writer)
            head = {key: full_tensor(value.detach()) for key, value in self.model.heads[REWARD_ROLE].state_dict().items()}
            if self.is_writer:
                check_finite_weights(head, f"the reward model's head to {directory}")
                ScalarHead.save_state(out, head, self.model.hidden_size)
        if stats is not None and self.is_writer:
            (out / REWARD_STATS).write_text(json.dumps(stats, indent=2))
        return out


def members_mean(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The members' mean scores of the chosen and of the rejected responses (a single model's own)."""
    if len(pairs) == 1:
        return pairs[0]
    return torch.stack([c for c, _ in pairs]).mean(0), torch.stack([r for _, r in pairs]).mean(0)


@torch.no_grad()
def reward_statistics(module: RewardModel, loader, member: str = REWARD_ROLE) -> dict[str, float]:
    """Mean and std of ``member``'s scores of every sequence (chosen and rejected) served by ``loader`` (the same on
    every rank: each rank scores every batch, so nothing is synchronised)."""
    stats = MeanStd(sync_on_compute=False).to(module.device)
    was_training = module.training
    module.eval()
    for batch in loader:
        batch = {key: value.to(module.device) for key, value in batch.items()}
        stats.update(module.rewards(batch["input_ids"], batch["attention_mask"], batch["last_index"], member))
    module.train(was_training)
    mean, std = stats.compute()
    return {"mean": float(mean), "std": float(std), "count": int(stats.count)}
