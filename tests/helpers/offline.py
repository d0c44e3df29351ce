"""DPO as the tests build it, and its preference pairs."""

from __future__ import annotations

import functools

import torch

from rlhf_lightning import DPO, PreferenceDataModule
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.modules import make

make_dpo = functools.partial(make, DPO, defaults=dict(sampling={"max_new_tokens": 4}, gold_reward=gold_rewards))


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
