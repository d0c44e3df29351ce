"""DPO as the tests build it, and its preference pairs."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_lightning import DPO, PreferenceDataModule
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.models import LORA, built


def make_dpo(tiny_model_dir: Path, **kwargs) -> DPO:
    torch.manual_seed(0)
    defaults = dict(policy_lora=LORA, max_new_tokens=4, lr=1e-2, gold_reward=gold_rewards)
    return built(DPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), **{**defaults, **kwargs}))


def pairs(module: DPO, n: int = 16, batch_size: int = 8, val_fraction: float = 0.25) -> PreferenceDataModule:
    data = PreferenceDataModule(dataset="synthetic", synthetic_rows=n, batch_size=batch_size,
                                val_fraction=val_fraction, max_length=64)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    return data


def perturb_policy(module: DPO) -> None:
    """A policy away from its reference, with non-zero LoRA B so that A gets gradient too."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.model.model.named_parameters():
            if adapter_of(name) == "policy" and "lora_B" in name:
                parameter.normal_(0, 0.3)
