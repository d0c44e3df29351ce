"""DPO and its offline family on the shared base: DPO (Rafailov et al. 2023), cDPO and robust DPO (Chowdhury et
al. 2024), IPO (Azar et al. 2023), SLiC's hinge (Zhao et al. 2023), length-normalised DPO (Tulu 3, Lambert et
al. 2024), SimPO (Meng et al. 2024) and RPO's NLL term (Pang et al. 2024).

The policy is the ``policy`` LoRA adapter on the SFT base; the reference is the same base with adapters disabled,
so DPO holds one base in memory. Chosen and rejected responses go through the model in one forward pass of the
``2B`` rows of :func:`~rlhf_lightning.data.collate.collate_pairs`; the loss formulas are
:func:`~rlhf_lightning.algorithms.dpo.dpo_loss`'s.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.dpo import check_beta, dpo_loss, pair_values
from rlhf_lightning.algorithms.preference_losses import PreferenceLoss, Sigmoid
from rlhf_lightning.core.offline import OfflinePreference
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.data.collate import EncodedPair
from rlhf_lightning.models.shared_base import REFERENCE
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.timing import phase

log = logging.getLogger(__name__)

# Per-pair values averaged over the validation set and logged as dpo/val/<name> (training logs batch means).
PAIR_METRICS = ("loss", "loss/nll", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                "rewards/gold_accuracy", "logps/chosen", "logps/rejected")


class DPO(OfflinePreference):
    """Direct preference optimisation of the policy adapter on preference pairs (automatic optimization).

    Implicit reward of a response: ``beta * (log pi(y) - log pi_ref(y))``, log-probs summed over its tokens
    (SimPO: ``beta * log pi(y) / |y|``, no reference). ``dpo/logps/*`` are summed log-probs too (TRL's
    convention), averaged over pairs. On held-out prompts, responses sampled from the policy are scored as in
    PPO: ``dpo/val/gold``, ``dpo/val/kl``, ``dpo/val/length``, ``dpo/val/eos_frac``.

    Args:
        beta: inverse temperature of the implicit reward (DPO 0.1; ``SigmoidNorm`` and SimPO want larger, ~2-10).
        preference_loss: the registered DPO loss and its arguments: ``Sigmoid`` (DPO; cDPO with
            ``label_smoothing``), ``Robust`` (``label_smoothing``), ``IPO``, ``Hinge``, ``SigmoidNorm``
            (length-normalised) or ``SimPO`` (reference-free: ``gamma``, ``label_smoothing``), or a
            :class:`~rlhf_lightning.algorithms.preference_losses.PreferenceLoss` of your own by import path.
        rpo_alpha: weight of the chosen response's per-token NLL added to the loss (RPO); 0 = off.
        precompute_reference: compute the reference log-probs of every training and validation pair once when
            ``fit`` starts (kept in checkpoints), instead of a reference pass per batch.
    """

    metric_prefix = "dpo"
    validation_metrics = (*OfflinePreference.validation_metrics, *PAIR_METRICS)

    def __init__(
        self,
        *args: Any,
        beta: float = 0.1,
        preference_loss: PreferenceLoss = Sigmoid(),  # noqa: B008 (never mutated; the CLI shows it as the default)
        rpo_alpha: float = 0.0,
        precompute_reference: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_beta(beta)
        PreferenceLoss.require("preference_loss", preference_loss)
        self.preference_loss = preference_loss  # the instance (hparams hold what the config said)
        checks.non_negative("rpo_alpha", rpo_alpha)
        if self.sampling.temperature != 1.0:
            log.warning("sampling.temperature %s divides the logits of the DPO log-probs too, not only of the samples",
                        self.sampling.temperature)
        # split -> (fingerprint of the pairs, summed reference log-probs [2, N]: chosen row, rejected row)
        self.reference_tables: dict[str, tuple[str, Tensor]] = {}
        # The splits whose table was computed, or checked against this run's pairs, in this fit: only those are
        # read (a table restored by `validate --ckpt_path` or a resume without precompute_reference is not).
        self.verified_splits: set[str] = set()

    @property
    def needs_reference(self) -> bool:
        return self.preference_loss.uses_reference

    def reference_logps(self, batch: dict[str, Tensor], split: str) -> Tensor | None:
        """``[2B]`` reference log-probs: precomputed for ``split`` when available, else one no-grad pass."""
        if self.needs_reference and split in self.verified_splits:
            table = self.reference_tables[split][1]
            return table[:, batch["index"].cpu()].flatten().to(self.device)
        return super().reference_logps(batch, split)

    # ---- loss ---------------------------------------------------------------------------------------------

    def batch_losses(self, batch: dict[str, Tensor], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss to minimise, per-pair detached values [B] named as in PAIR_METRICS)``."""
        hp = self.hparams
        chosen_lengths, rejected_lengths = batch["response_mask"].sum(-1).chunk(2)
        with phase("update/policy forward"):
            chosen, rejected = self.sequence_logps(POLICY, batch).chunk(2)
        reference = self.reference_logps(batch, split)
        ref_chosen, ref_rejected = reference.chunk(2) if reference is not None else (None, None)
        out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths, hp.beta,
                       self.preference_loss)
        losses = out.losses
        values = pair_values(out, chosen, rejected)
        if hp.rpo_alpha:
            nll = -chosen / chosen_lengths  # per-token NLL of each chosen response (algorithms.dpo.nll_loss)
            losses = losses + hp.rpo_alpha * nll
            values["loss/nll"] = nll.detach()
        if "gold_chosen" in batch:  # does the implicit reward order the pair as the noise-free gold reward does?
            gold_prefers_chosen = batch["gold_chosen"] > batch["gold_rejected"]
            agrees = torch.where(gold_prefers_chosen, out.chosen_rewards > out.rejected_rewards,
                                 out.rejected_rewards > out.chosen_rewards)  # a tie is never right
            values["rewards/gold_accuracy"] = agrees.float()
        values["loss"] = losses.detach()
        return losses.mean(), values

    def guarded_values(self, loss: Tensor, values: dict[str, Tensor]) -> dict[str, Tensor]:
        return {f"dpo/loss ({self.preference_loss.name})": loss, "dpo/logps/chosen": values["logps/chosen"],
                "dpo/logps/rejected": values["logps/rejected"]}

    def progress_bar(self, means: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"loss": means["loss"], "acc": means["rewards/accuracy"]}

    # ---- precomputed reference ----------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        if not (self.hparams.precompute_reference and self.needs_reference):
            return
        datamodule = self.trainer.datamodule
        if not hasattr(datamodule, "train_set"):
            raise ValueError("precompute_reference needs a PreferenceDataModule (its train_set and val_set)")
        for split, pairs in (("train", datamodule.train_set), ("val", datamodule.val_set)):
            fingerprint = pairs_fingerprint(pairs)
            if split in self.reference_tables:  # restored from a checkpoint: reuse it, never recompute
                if self.reference_tables[split][0] != fingerprint:
                    raise ValueError(f"the checkpoint's reference log-probs of the {split} pairs were computed on "
                                     "other data than this run's; resume with the same data settings")
            else:
                table = self.compute_reference(pairs, datamodule.collate, datamodule.val_batch_size)
                self.reference_tables[split] = (fingerprint, table)
            self.verified_splits.add(split)

    @torch.no_grad()
    def compute_reference(self, pairs: Sequence[EncodedPair], collate: Callable[[list], dict],
                          batch_size: int) -> Tensor:
        """Summed reference log-probs ``[2, N]`` of every pair; each rank computes every world-size-th pair.

        Every rank runs the same number of batches (the last rank's share padded with a pair of its own, whose
        values are not kept): a sharded model's forward passes are collective."""
        table = torch.zeros(2, len(pairs), device=self.device)
        world = self.trainer.world_size
        mine = list(range(self.global_rank, len(pairs), world))
        share = -(-len(pairs) // world)
        padded = mine + mine[-1:] * (share - len(mine)) if mine else [0] * share
        with self.policy.sampler.gathered_base(self.model):  # a sharded base gathered once for every batch of the table
            for start in range(0, share, batch_size):
                rows = padded[start : start + batch_size]
                batch = collate([pairs[i] for i in rows])
                if bool((batch["index"] < 0).any()):
                    raise ValueError("precompute_reference needs numbered pairs (EncodedPair.index)")
                batch = {name: value.to(self.device) for name, value in batch.items()}
                values = self.sequence_logps(REFERENCE, batch).view(2, -1).float()
                kept = [offset for offset in range(len(rows)) if start + offset < len(mine)]
                table[:, batch["index"][kept]] = values[:, kept]
        return self.ranks.sum(table).cpu()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["dpo_reference"] = dict(self.reference_tables)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference_tables = dict(checkpoint.get("dpo_reference", {}))


def pairs_fingerprint(pairs: Sequence[EncodedPair]) -> str:
    """A hash of the token ids of ``pairs``, in order: precomputed log-probs belong to exactly these pairs."""
    digest = hashlib.sha256()
    for pair in pairs:
        for ids in (pair.chosen_ids, pair.rejected_ids, [pair.prompt_length]):
            digest.update(array("q", ids).tobytes())
            digest.update(b"|")
    return digest.hexdigest()
