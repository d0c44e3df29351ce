"""Reward model: Bradley-Terry loss and metrics by hand, gradients, export and reload, resume."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lightning.algorithms import bradley_terry_loss
from rlhf_lightning.data.modules import PreferenceDataModule
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase, adapter_of
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.stages.reward_model import REWARD_STATS, RewardModel
from rlhf_lightning.utils.metrics import MeanStd, PairwiseAccuracy
from tests.helpers.models import built


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    expected = -(_log_sigmoid(1.0) + _log_sigmoid(-1.0)) / 2
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected)
    margin = torch.tensor([0.5, 0.0])
    expected_margin = -(_log_sigmoid(0.5) + _log_sigmoid(-1.0)) / 2
    assert bradley_terry_loss(chosen, rejected, margin).item() == pytest.approx(expected_margin)
    # centering adds coef * mean((r_c + r_r)^2) = 0.1 * (1 + 1) / 2
    assert bradley_terry_loss(chosen, rejected, center_coef=0.1).item() == pytest.approx(expected + 0.1)


def test_pairwise_accuracy_and_mean_std_by_hand():
    accuracy = PairwiseAccuracy()
    accuracy.update(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0]))  # right, wrong, tie
    accuracy.update(torch.tensor([5.0]), torch.tensor([-5.0]))
    assert accuracy.compute().item() == pytest.approx(2.5 / 4)
    stats = MeanStd()
    stats.update(torch.tensor([1.0, 2.0]))
    stats.update(torch.tensor([3.0, 6.0]))
    mean, std = stats.compute()
    assert mean.item() == pytest.approx(3.0)
    assert std.item() == pytest.approx(math.sqrt((4 + 1 + 0 + 9) / 3))


@pytest.fixture
def data():
    return PreferenceDataModule(dataset="synthetic", synthetic_rows=80, batch_size=8, val_fraction=0.2)


def _reward_model(tiny_model_dir, **kwargs):
    torch.manual_seed(0)
    return built(RewardModel(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), lora=LoraSpec(r=4, alpha=8),
                             **kwargs))


def test_gradients_reach_only_the_reward_adapter_and_head(tiny_model_dir, data):
    module = _reward_model(tiny_model_dir)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    with torch.no_grad():  # move B off zero so that A receives gradient too
        for name, parameter in module.named_parameters():
            if "lora_B.reward" in name:
                parameter.normal_(0, 0.1)
    batch = next(iter(data.train_dataloader()))
    chosen, rejected = module._pair_rewards(batch)
    module._loss(chosen, rejected, batch).backward()
    with_grad = {name for name, p in module.named_parameters() if p.grad is not None}
    expected = {name for name, _ in module.named_parameters()
                if adapter_of(name) == "reward" or name.startswith("model.heads.reward")}
    assert with_grad == expected
    # The loss only sees reward differences, so the head's bias (a shared offset) gets exactly zero gradient.
    assert module.model.heads["reward"].linear.bias.grad.item() == 0.0
    assert all(module.get_parameter(name).grad.abs().sum() > 0 for name in expected if not name.endswith("bias"))


def _trainer(tmp_path, max_steps, **kwargs):
    return L.Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)], **kwargs,
    )


def test_training_leaves_the_base_unchanged_and_export_reloads_identically(tiny_model_dir, data, tmp_path):
    module = _reward_model(tiny_model_dir, optimizer={"lr": 1e-2}, export_dir=str(tmp_path / "export"))
    base_before = {n: p.clone() for n, p in module.model.base_parameters()}
    head_before = module.model.heads["reward"].linear.weight.clone()
    _trainer(tmp_path, 5).fit(module, datamodule=data)
    for name, parameter in module.model.base_parameters():
        assert torch.equal(parameter, base_before[name]), name
    assert not torch.equal(module.model.heads["reward"].linear.weight, head_before)

    export = tmp_path / "export" / "reward"
    stats = json.loads((export / REWARD_STATS).read_text())
    assert stats["count"] == 2 * len(data.val_set) and stats["std"] > 0

    batch = next(iter(data.val_dataloader()))
    module.eval()
    expected = module.rewards(batch["input_ids"], batch["attention_mask"], batch["last_index"])
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    reloaded = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    reloaded.load_adapter(export, "reward")
    assert torch.equal(reloaded.score("reward", batch["input_ids"], batch["attention_mask"], batch["last_index"]),
                       expected)


def test_checkpoint_holds_only_what_trains_and_resumes(tiny_model_dir, data, tmp_path):
    # A constant schedule: a decaying one depends on max_steps, which differs between the two legs here.
    module = _reward_model(tiny_model_dir, optimizer={"lr": 1e-2, "schedule": "constant"})
    _trainer(tmp_path, 3).fit(module, datamodule=data)
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    keys = checkpoint["state_dict"].keys()
    assert keys and all("lora_" in key or key.startswith("model.heads.reward") for key in keys)
    assert keys == module.checkpointed_keys()

    resumed = _reward_model(tiny_model_dir, optimizer={"lr": 1e-2, "schedule": "constant"})
    trainer = _trainer(tmp_path, 5)
    trainer.fit(resumed, datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert trainer.global_step == 5
    uninterrupted = _reward_model(tiny_model_dir, optimizer={"lr": 1e-2, "schedule": "constant"})
    _trainer(tmp_path / "other", 5).fit(uninterrupted, datamodule=data)
    for (name, a), (_, b) in zip(resumed.named_parameters(), uninterrupted.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_validation_reports_accuracy_against_labels_and_gold(tiny_model_dir, data):
    module = _reward_model(tiny_model_dir)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    assert set(metrics) == {"rm/val/loss", "rm/val/accuracy", "rm/val/margin", "rm/val/reward_mean",
                            "rm/val/reward_std", "rm/val/gold_accuracy"}
    assert 0.0 <= metrics["rm/val/accuracy"] <= 1.0
