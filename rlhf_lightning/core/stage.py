"""What every stage's LightningModule shares: loading the base, optimizers, checkpoints without frozen weights."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from rlhf_lightning.callbacks.atomic_io import CheckpointError
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.optim import Schedule, adamw, lr_lambda
from rlhf_lightning.resume import CLASS_KEY, class_mismatch, class_path


class StageModule(L.LightningModule):
    """Base class of the stage modules.

    Lightning checkpoints keep only what trains (adapters, heads, or every weight under full fine-tuning) and
    the optimizer state; a frozen base is loaded again from its own path, so a checkpoint of a LoRA run is
    megabytes, not the size of the model.
    """

    def __init__(self) -> None:
        super().__init__()
        # Frozen base weights are not in the checkpoint; `on_load_checkpoint` checks for what must be.
        self.strict_loading = False

    def load_base(self, spec: BaseModelSpec, train_base: bool = False) -> SharedBase:
        """Load ``spec``'s tokenizer (as ``self.tokenizer``) and model, wrapped as a :class:`SharedBase`."""
        self.tokenizer = load_tokenizer(spec)
        model = load_causal_lm(spec, self.tokenizer)
        model.train()  # from_pretrained returns eval mode; with dropout off the two modes compute the same
        return SharedBase(model, train_base=train_base, fused_lora=spec.fused_lora)

    def configure_adamw(
        self, parameter_groups: list[dict], weight_decay: float, warmup_steps: int, schedule: Schedule,
        total_steps: int | None = None, eps: float = 1e-8,
    ) -> dict[str, Any]:
        """AdamW with a warm-up/decay schedule; ``total_steps`` defaults to the Trainer's estimate."""
        optimizer = adamw(parameter_groups, weight_decay, eps=eps)

        # Asked lazily: reading `estimated_stepping_batches` here would build the train loader before a
        # checkpoint's loader state is restored, and the resumed run would replay the epoch from its start.
        def total() -> int:
            return total_steps if total_steps is not None else int(self.trainer.estimated_stepping_batches)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, warmup_steps, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def checkpointed_keys(self) -> set[str]:
        """State-dict keys a checkpoint must hold: every parameter that trains."""
        return {name for name, parameter in self.named_parameters() if parameter.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CLASS_KEY] = class_path(type(self))  # so that another stage's module refuses the file
        if any(not parameter.requires_grad for parameter in self.parameters()):
            keep = self.checkpointed_keys()
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        refusal = class_mismatch(self.trainer.ckpt_path if self._trainer else "(loaded)", checkpoint.get(CLASS_KEY),
                                 type(self))
        if refusal:
            raise CheckpointError(refusal)
        missing = self.checkpointed_keys() - checkpoint["state_dict"].keys()
        if missing:
            raise KeyError(
                f"the checkpoint lacks {len(missing)} trained weights of this model (e.g. {sorted(missing)[0]}); "
                "was it written by a run with another adapter or head configuration?"
            )
