"""The on-policy modules as the tests build them, their prompts and fits."""

from __future__ import annotations

import functools

import lightning as L
import torch
from transformers import AutoModelForCausalLM

from rlhf_lightning import PPO, AdapterReward, OnPolicyDistillation, PromptDataModule
from rlhf_lightning.callbacks import IterationCheckpoint
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.models import LORA, built
from tests.helpers.modules import make, merged

# PPO of the stage tests: 6 new tokens, two epochs of two minibatches, the gold reward logged.
PPO_SETTINGS = dict(sampling={"max_new_tokens": 6}, update={"epochs": 2, "num_minibatches": 2}, critic={"lr": 1e-2}, gold_reward=gold_rewards)
make_ppo = functools.partial(make, PPO, defaults=PPO_SETTINGS)


def prompts(module: PPO, n: int = 8, **kwargs) -> PromptDataModule:
    kwargs = {"dataset": "synthetic", "synthetic_rows": n, "batch_size": 8, "val_fraction": 0.0, **kwargs}
    data = PromptDataModule(**kwargs)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    return data


def first_batch(module: PPO) -> dict:
    return next(iter(prompts(module).train_dataloader()["prompts"]))


def perturb(module: PPO, *adapters: str) -> None:
    with torch.no_grad():
        for name, parameter in module.model.model.named_parameters():
            if adapter_of(name) in adapters and "lora_B" in name:
                parameter.normal_(0, 0.3)


def assert_one_copy_of_the_base(module, model_dir) -> None:
    """The storages reachable from the module hold the base once, plus adapters and heads."""
    base_numel = sum(p.numel() for _, p in module.model.base_parameters())
    storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes() // tensor.element_size()
    adapter_numel = sum(p.numel() for n, p in module.model.model.named_parameters() if adapter_of(n))
    head_numel = sum(p.numel() for p in module.model.heads.parameters())
    assert sum(storages.values()) <= base_numel + adapter_numel + head_numel + 4096  # + small buffers
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    assert base_numel == sum(p.numel() for p in reference.parameters())


class Recorder(L.Callback):
    """Every iteration's logged ppo/* values (timings excluded: they are not deterministic)."""

    def __init__(self, prefix: str = "ppo/") -> None:
        self.prefix = prefix
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()
                          if k.startswith(self.prefix) and "/time/" not in k and "throughput" not in k})


def fit_iterations(module, data, tmp_path, iterations, ckpt_path=None, prefix="ppo/", **trainer_kwargs):
    recorder = Recorder(prefix)
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=iterations, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        callbacks=[recorder, IterationCheckpoint(dirpath=tmp_path, every_n_iterations=2, save_top_k=-1,
                                                 enable_version_counter=False)],
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, recorder.rows


# The on-policy family's tests: PPO's settings without its critic's rate, 4 responses per prompt.
ONLINE_SETTINGS = dict(sampling={"max_new_tokens": 6}, samples_per_prompt=4, update={"epochs": 2, "num_minibatches": 2}, gold_reward=gold_rewards)
make_online = functools.partial(make, defaults=ONLINE_SETTINGS)


def prompt_batch(module: OnlineRL, n: int = 4) -> dict:
    return next(iter(prompts(module, n=n, batch_size=n).train_dataloader()["prompts"]))


def student(tiny_model_dir, reward_dir, teacher, **kwargs):
    """On-policy distillation from ``teacher`` (a model folder or an adapter) on the tiny base."""
    return built(OnPolicyDistillation(**merged(dict(base=BaseModelSpec(name_or_path=str(tiny_model_dir)),
                                                    policy_lora=LORA, sampling={"max_new_tokens": 6},
                                                    reward=AdapterReward(str(reward_dir)), teacher=str(teacher)),
                                               kwargs)))
