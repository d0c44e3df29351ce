"""KTO (Ethayarajh et al. 2024) on the shared base: responses labelled desirable or undesirable one by one.

The policy is the ``policy`` LoRA adapter; the reference is the same base with adapters disabled. A batch of
:class:`~rlhf_lightning.data.modules.UnpairedPreferenceDataModule` holds ``2B`` rows (each prompt with its own
response, then with the previous example's) that go through the model in one forward pass; the second half
estimates KTO's reference point. The loss formulas are :func:`~rlhf_lightning.algorithms.kto.kto_loss`'s.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.kto import (
    KTOLossType,
    kto_loss,
    kto_reference_point,
    one_label_only,
    recommended_weights,
)
from rlhf_lightning.core.offline import OfflinePreference
from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.timing import phase

log = logging.getLogger(__name__)

# Per-example values averaged over the validation set and logged as kto/val/<name>; the chosen/rejected ones
# (TRL's names for desirable/undesirable) average over the examples with that label only.
EXAMPLE_METRICS = ("loss", "reference_point", "rewards/chosen", "rewards/rejected", "logps/chosen",
                   "logps/rejected", "desirable_frac")


class KTO(OfflinePreference):
    """Kahneman-Tversky optimisation of the policy adapter on labelled responses (automatic optimization).

    Implied reward of a response: ``beta * (log pi(y) - log pi_ref(y))``, log-probs summed over its tokens.
    ``kto/reference_point`` is the batch's KL estimate ``z_ref`` from mismatched prompt/response pairs (the
    mean over every rank's rows, clamped at 0, held out of the gradient, as TRL 1.16 computes it);
    ``kto/rewards/chosen`` and ``/rejected`` average the implied rewards of the desirable and the undesirable
    responses (TRL's names), ``kto/rewards/margin`` is their difference, ``kto/logps/*`` the summed log-probs.
    On held-out prompts, responses sampled from the policy are scored as in PPO: ``kto/val/gold``,
    ``kto/val/kl``, ``kto/val/length``, ``kto/val/eos_frac``.

    Args:
        beta: inverse temperature of the implied reward (TRL's 0.1).
        loss_type: ``kto`` (the paper's eqn. 7) or ``apo_zero_unpaired`` (unpaired APO-zero: no reference point,
            so no mismatched rows are run).
        desirable_weight: lambda_D, the weight of a desirable response's loss.
        undesirable_weight: lambda_U, the weight of an undesirable response's loss. With unequal counts, the
            paper asks lambda_D n_D / (lambda_U n_U) in [1, 4/3]; a run outside that range warns at setup, and so
            does training data whose responses all carry the same label.
    """

    metric_prefix = "kto"
    validation_metrics = (*OfflinePreference.validation_metrics, *EXAMPLE_METRICS)

    def __init__(
        self,
        *args: Any,
        beta: float = 0.1,
        loss_type: KTOLossType = "kto",
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        checks.positive("beta", beta)
        checks.one_of("loss_type", loss_type, ("kto", "apo_zero_unpaired"))
        checks.positive("desirable_weight", desirable_weight)
        checks.positive("undesirable_weight", undesirable_weight)

    @property
    def uses_reference_point(self) -> bool:
        return self.hparams.loss_type == "kto"

    def setup(self, stage: str) -> None:
        super().setup(stage)
        datamodule = self.datamodule
        if stage != "fit" or datamodule is None:
            return
        if not hasattr(datamodule, "label_counts"):
            raise ValueError("KTO trains on labelled responses: use rlhf_lightning.UnpairedPreferenceDataModule as "
                             "data.class_path (it reads prompt/completion/label rows and splits preference pairs)")
        if self.uses_reference_point and datamodule.batch_size < 2:
            raise ValueError(f"data.init_args.batch_size={datamodule.batch_size}: KTO's reference point pairs each "
                             "prompt with another example's response of the same batch, so a batch needs at least 2 "
                             "examples (TRL refuses 1 too)")
        counts = datamodule.label_counts()
        advice = (one_label_only(*counts, datamodule.training_source())
                  or recommended_weights(*counts, self.hparams.desirable_weight, self.hparams.undesirable_weight))
        if advice:
            log.warning("KTO: %s", advice)

    # ---- loss ---------------------------------------------------------------------------------------------

    def batch_losses(self, batch: dict[str, Tensor], split: str) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss to minimise, detached values named as in EXAMPLE_METRICS)``: ``loss`` per example, the
        reference point once per batch, the chosen/rejected values per desirable/undesirable example."""
        hp = self.hparams
        desirable = batch["desirable"]
        examples = desirable.shape[0]
        if not self.uses_reference_point:  # only the matched rows are needed
            batch = {name: value[:examples] if value.shape[0] == 2 * examples else value
                     for name, value in batch.items()}
        with phase("update/policy forward"):
            logps = self.sequence_logps(POLICY, batch)
        ref_logps = self.reference_logps(batch, split)
        reference_point = torch.zeros((), device=self.device)
        if self.uses_reference_point:
            reference_point = kto_reference_point(logps[examples:], ref_logps[examples:], self.ranks.sum)
        out = kto_loss(logps[:examples], ref_logps[:examples], desirable, reference_point, hp.beta,
                       hp.desirable_weight, hp.undesirable_weight, hp.loss_type)
        values = {"loss": out.losses.detach(), "reference_point": reference_point[None],
                  "rewards/chosen": out.rewards[desirable], "rewards/rejected": out.rewards[~desirable],
                  "logps/chosen": logps[:examples][desirable].detach(),
                  "logps/rejected": logps[:examples][~desirable].detach(), "desirable_frac": desirable.float()}
        # A batch may hold no desirable (or no undesirable) response: those values are empty, and their means are
        # taken over the batches and ranks that have some (training_means, held_out.record).
        return out.losses.mean(), values

    def guarded_values(self, loss: Tensor, values: dict[str, Tensor]) -> dict[str, Tensor]:
        return {f"kto/loss ({self.hparams.loss_type})": loss} | {
            f"kto/{name}": values[name] for name in ("reference_point", "logps/chosen", "logps/rejected")}

    def training_means(self, values: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The global batch's means, and ``rewards/margin``: chosen minus rejected (when the batch has both)."""
        means = super().training_means(values, batch)
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margin"] = means["rewards/chosen"] - means["rewards/rejected"]
        return means
