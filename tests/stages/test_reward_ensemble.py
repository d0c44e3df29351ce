"""The reward stage with ``members: K``: K adapters and heads on the one base, each member's loss reaching only its
own adapter and head, each member's data (shared, bootstrap, partition), the export that EnsembleReward reads, and an
exact resume after kill -9."""

from __future__ import annotations

import json
import signal

import lightning as L
import pytest
import torch

from rlhf_lightning import EnsembleReward
from rlhf_lightning.algorithms import bradley_terry_loss
from rlhf_lightning.data.modules import PreferenceDataModule
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase, adapter_of
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.stages.reward_model import RewardModel
from tests.helpers.models import built
from tests.helpers.preemption import COMMON, assert_same_training, drive, run, stage

MEMBERS = ["reward_0", "reward_1", "reward_2"]


@pytest.fixture
def data():
    return PreferenceDataModule(dataset="synthetic", synthetic_rows=80, batch_size=8, val_fraction=0.2)


def _ensemble(tiny_model_dir, **kwargs) -> RewardModel:
    torch.manual_seed(0)
    return built(RewardModel(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), lora=LoraSpec(r=4, alpha=8),
                             members=3, **kwargs))


def _batch(module, data) -> dict:
    data.tokenizer = module.tokenizer
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def test_members_are_adapters_and_heads_of_their_own_on_one_base(tiny_model_dir):
    module = _ensemble(tiny_model_dir)
    assert module.model.adapters == MEMBERS and list(module.model.heads) == MEMBERS
    parameters = dict(module.model.model.named_parameters())
    first_a = [p for n, p in parameters.items() if adapter_of(n) == "reward_0" and "lora_A" in n]
    second_a = [p for n, p in parameters.items() if adapter_of(n) == "reward_1" and "lora_A" in n]
    assert not torch.equal(first_a[0], second_a[0])  # initialised apart
    assert not torch.equal(module.model.heads["reward_0"].linear.weight, module.model.heads["reward_1"].linear.weight)
    base_numel = sum(p.numel() for _, p in module.model.base_parameters())
    reference = load_causal_lm(BaseModelSpec(name_or_path=str(tiny_model_dir)),
                               load_tokenizer(BaseModelSpec(name_or_path=str(tiny_model_dir))))
    assert base_numel == sum(p.numel() for p in reference.parameters())  # the base once, whatever K


def test_each_members_loss_reaches_its_own_adapter_and_head_alone(tiny_model_dir, data):
    module = _ensemble(tiny_model_dir, member_data="shared")
    with torch.no_grad():  # move B off zero so that A receives gradient too
        for name, parameter in module.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    batch = _batch(module, data)
    chosen, rejected = module._pair_rewards(batch, "reward_1")
    module._loss(chosen, rejected, batch).backward()
    with_grad = {name for name, p in module.named_parameters() if p.grad is not None}
    assert with_grad == {name for name, _ in module.named_parameters()
                         if adapter_of(name) == "reward_1" or name.startswith("model.heads.reward_1.")}
    # the training step's summed loss gives each member its own loss's gradient
    alone = {name: module.get_parameter(name).grad.clone() for name in with_grad}
    module.zero_grad()
    module.member_losses(batch)[0].backward()
    for name in alone:
        torch.testing.assert_close(module.get_parameter(name).grad, alone[name])


@pytest.mark.parametrize("member_data", ["bootstrap", "partition"])
def test_each_member_trains_on_its_own_weights_of_the_pairs(tiny_model_dir, data, member_data):
    module = _ensemble(tiny_model_dir, member_data=member_data)
    batch = _batch(module, data)
    weights = [module.member_weights(k, batch) for k in range(3)]
    assert not torch.equal(weights[0], weights[1])
    if member_data == "partition":
        assert torch.stack(weights).sum(0).tolist() == [1.0] * len(batch["index"])
    chosen, rejected = module._pair_rewards(batch, "reward_2")
    per_pair = -torch.nn.functional.logsigmoid(chosen - rejected)
    by_hand = (weights[2] * per_pair).sum() / weights[2].sum()
    torch.testing.assert_close(module._loss(chosen, rejected, batch, weights[2]), by_hand)
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, weights=torch.ones_like(chosen)),
                               bradley_terry_loss(chosen, rejected))


def test_the_export_is_what_ensemble_reward_reads(tiny_model_dir, data, tmp_path):
    module = _ensemble(tiny_model_dir, optimizer={"lr": 1e-2}, export_dir=str(tmp_path / "export"))
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    trainer.validate(module, datamodule=data, verbose=False)
    logged = trainer.callback_metrics
    assert logged["rm/val/disagreement"] > 0 and {f"rm/val/member_{k}/{name}" for k in range(3)
                                                   for name in ("accuracy", "gold_accuracy")} <= logged.keys()
    out = tmp_path / "export" / "reward"
    assert json.loads((out / "ensemble.json").read_text()) == {"members": MEMBERS, "member_data": "shared"}
    stats = [json.loads((out / member / "reward_stats.json").read_text()) for member in MEMBERS]
    assert len({s["mean"] for s in stats}) == 3 and all(s["count"] == 2 * len(data.val_set) for s in stats)

    batch = next(iter(data.val_dataloader()))
    module.eval()
    expected = torch.stack([(module.rewards(batch["input_ids"], batch["attention_mask"], batch["last_index"], member)
                             - s["mean"]) / s["std"] for member, s in zip(MEMBERS, stats, strict=True)], -1)
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    source = EnsembleReward(str(out), combine="mean")
    source.setup(SharedBase(load_causal_lm(spec, load_tokenizer(spec))), module.tokenizer)
    from rlhf_lightning.rewards import RewardInputs
    inputs = RewardInputs(batch["input_ids"], batch["attention_mask"], batch["last_index"], prompts=[],
                          completions=[], completion_ids=[])
    torch.testing.assert_close(source.member_scores(inputs), expected)


def test_an_ensemble_needs_adapters_and_a_known_member_data(tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    with pytest.raises(ValueError, match="members=3: an ensemble is one reward adapter per member on the shared base, "
                                         "and lora is null"):
        RewardModel(base=spec, lora=None, members=3)
    with pytest.raises(ValueError, match="member_data"):
        RewardModel(base=spec, members=3, member_data="order")
    with pytest.raises(ValueError, match="members"):
        RewardModel(base=spec, members=0)


@pytest.mark.slow
def test_an_ensemble_stage_killed_with_sigkill_resumes_exactly(tiny_model_dir, reward_dir, tmp_path):
    """Five batches of three bootstrap members, a checkpoint after each; killed before batch 3's optimizer step and
    resumed with --ckpt_path last: every later metric, gradient and the trained weights equal the uninterrupted
    run's."""
    arguments, _ = stage("reward", tiny_model_dir, reward_dir)
    arguments = [*arguments, *COMMON, "--model.init_args.members=3", "--model.init_args.member_data=bootstrap",
                 "--trainer.limit_train_batches=5",
                 "--trainer.limit_val_batches=0"]
    every = {"class_path": "rlhf_lightning.callbacks.Checkpoint",
             "init_args": {"every_n_train_steps": 1, "save_last": True, "enable_version_counter": False}}
    full = drive(tmp_path, "full", [run(tmp_path, "full", arguments, every)])
    assert full.returncode == 0, full.stderr[-3000:]
    killed = drive(tmp_path, "killed", [run(tmp_path, "killed", arguments, every, {
        "class_path": "tests.helpers.equivalence.KillAt", "init_args": {"iteration": 3, "step": 1}})])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = drive(tmp_path, "resumed", [run(tmp_path, "killed", arguments, every, resume=True)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full_probe, resumed_probe = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "killed.pt")
    assert {key.split(".")[-2] for key in full_probe["weights"] if "lora_A" in key} == set(MEMBERS)
    assert "rm/member_2/loss" in full_probe["metrics"][0]
    assert_same_training(full_probe, resumed_probe, from_batch=3, steps_per_batch=1)
