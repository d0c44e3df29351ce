"""Reward-model ensembles: each combination rule against a hand computation, the source's scores against its members
scored one by one, K adapters on the one base, no gradient into the members, and every online algorithm trained on an
ensemble with its disagreement logged."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from rlhf_lightning import (
    GRPO,
    PPO,
    RLOO,
    AdapterReward,
    EnsembleReward,
    OnlineDPO,
    OnPolicyDistillation,
    REINFORCEPlusPlus,
)
from rlhf_lightning.algorithms.ensemble import combine_members, member_variance, pair_weights
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase, adapter_of
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards import RewardInputs
from tests.helpers.models import ENSEMBLE_STATS
from tests.helpers.modules import make
from tests.helpers.online import ONLINE_SETTINGS, assert_one_copy_of_the_base, prompts


def test_each_rule_combines_the_members_as_computed_by_hand():
    scores = torch.tensor([[1.0, 2.0, 6.0], [0.0, 0.0, 0.0], [-1.0, 3.0, 1.0]])
    # variances over the members (1/K): (4 + 1 + 9) / 3, 0, (4 + 4 + 0) / 3
    assert member_variance(scores).tolist() == pytest.approx([14 / 3, 0.0, 8 / 3])
    assert combine_members(scores, "mean").tolist() == pytest.approx([3.0, 0.0, 1.0])
    assert combine_members(scores, "min").tolist() == [1.0, 0.0, -1.0]
    assert combine_members(scores, "uwo", 0.5).tolist() == pytest.approx([3 - 7 / 3, 0.0, 1 - 4 / 3])
    assert combine_members(scores, "uwo", 0.0).tolist() == pytest.approx([3.0, 0.0, 1.0])  # lambda 0: the mean
    with pytest.raises(ValueError, match="combine must be one of mean, min, uwo, got 'max'"):
        combine_members(scores, "max")


def test_pair_weights_are_a_function_of_the_pair_alone():
    indices = torch.arange(400)
    shared = pair_weights("shared", 1, 3, indices, seed=0)
    assert shared.tolist() == [1.0] * 400
    # partition: every pair trains exactly one member
    partition = torch.stack([pair_weights("partition", k, 3, indices, seed=0) for k in range(3)])
    assert partition.sum(0).tolist() == [1.0] * 400 and set(partition.flatten().tolist()) == {0.0, 1.0}
    assert all(80 < count < 190 for count in partition.sum(1).tolist())  # about a third each
    # bootstrap: Poisson(1) counts, about one on average, other members other counts
    bootstrap = torch.stack([pair_weights("bootstrap", k, 3, indices, seed=0) for k in range(3)])
    assert 0.85 < bootstrap.mean() < 1.15 and 0.25 < (bootstrap == 0).float().mean() < 0.5  # e^-1 = 0.37 of zeros
    assert not torch.equal(bootstrap[0], bootstrap[1])
    # the same pair gets the same weight in any batch (a resumed fit, another rank), another seed other weights
    assert torch.equal(pair_weights("bootstrap", 2, 3, torch.tensor([17, 3]), seed=0), bootstrap[2, [17, 3]])
    assert not torch.equal(pair_weights("bootstrap", 0, 3, indices, seed=1), bootstrap[0])
    with pytest.raises(ValueError, match="needs pairs numbered"):
        pair_weights("bootstrap", 0, 3, torch.tensor([-1, 2]), seed=0)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    return SharedBase(load_causal_lm(spec, tokenizer)), tokenizer


def _inputs(rows: int = 5, columns: int = 9) -> RewardInputs:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 40, (rows, columns), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return RewardInputs(ids, mask, torch.full((rows,), columns - 1), prompts=[""] * rows, completions=[""] * rows,
                        completion_ids=[[0]] * rows)


def _one_by_one(ensemble_dir, tiny_model_dir) -> torch.Tensor:
    """Each member scored alone, as an AdapterReward on a base of its own: ``[B, K]``, standardised by hand."""
    columns = []
    for k, (mean, std) in enumerate(ENSEMBLE_STATS):
        spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
        source = AdapterReward(str(ensemble_dir / f"reward_{k}"))
        source.setup(SharedBase(load_causal_lm(spec, load_tokenizer(spec))), None)
        columns.append((source.score(_inputs()) - mean) / std)
    return torch.stack(columns, -1)


@pytest.mark.parametrize("rule", ["mean", "min", "uwo"])
def test_the_ensemble_scores_as_its_members_scored_one_by_one_then_combined(rule, ensemble_dir, tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    base = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    source = EnsembleReward(str(ensemble_dir), combine=rule, uncertainty_coef=0.7)
    source.setup(base, None)
    assert base.adapters == ["reward_0", "reward_1", "reward_2"] and set(base.heads) == set(base.adapters)
    expected = _one_by_one(ensemble_dir, tiny_model_dir)
    assert expected.std(0).min() > 0.05  # the members differ
    torch.testing.assert_close(source.member_scores(_inputs()), expected)
    by_hand = {"mean": expected.mean(-1), "min": expected.min(-1).values,
               "uwo": expected.mean(-1) - 0.7 * ((expected - expected.mean(-1, keepdim=True)) ** 2).mean(-1)}[rule]
    torch.testing.assert_close(source.score(_inputs()), by_hand)
    disagreement = expected.std(-1, unbiased=False)
    torch.testing.assert_close(source.response_values()["reward_disagreement"], disagreement)
    metrics = source.batch_metrics()
    torch.testing.assert_close(metrics["reward_disagreement"], disagreement.mean())
    torch.testing.assert_close(metrics["reward_member_1"], expected[:, 1].mean())
    assert source.statistics == (0.0, 1.0)  # standardised: reward_shaping.normalize leaves it as it is


def test_members_given_as_a_list_of_adapters_and_raw_scores(ensemble_dir, tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    source = EnsembleReward([str(ensemble_dir / "reward_2"), str(ensemble_dir / "reward_0")], combine="mean",
                            standardize=False)
    source.setup(SharedBase(load_causal_lm(spec, load_tokenizer(spec))), None)
    standardised = _one_by_one(ensemble_dir, tiny_model_dir)
    raw = standardised * torch.tensor([s for _, s in ENSEMBLE_STATS]) + torch.tensor([m for m, _ in ENSEMBLE_STATS])
    torch.testing.assert_close(source.score(_inputs()), raw[:, [2, 0]].mean(-1))
    assert source.statistics is None


def test_sources_on_one_base_each_keep_their_own_adapters(ensemble_dir, tiny_model_dir):
    # two sources under one adapter name would both score with the one loaded last
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    base = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    sources = [AdapterReward(str(ensemble_dir / "reward_0")), AdapterReward(str(ensemble_dir / "reward_1")),
               EnsembleReward([str(ensemble_dir / "reward_2")], standardize=False),
               EnsembleReward([str(ensemble_dir / "reward_1"), str(ensemble_dir / "reward_0")], combine="mean",
                              standardize=False)]
    for source in sources:
        source.setup(base, None)
    assert base.adapters == ["reward", "reward_source2", "reward_0", "reward_0_source2", "reward_1_source2"]
    assert [source.adapter_role for source in sources] == ["reward", "reward_source2", "reward_0", "reward_0_source2"]
    standardised = _one_by_one(ensemble_dir, tiny_model_dir)
    raw = standardised * torch.tensor([s for _, s in ENSEMBLE_STATS]) + torch.tensor([m for m, _ in ENSEMBLE_STATS])
    torch.testing.assert_close(torch.stack([source.score(_inputs()) for source in sources], -1),
                               torch.stack([raw[:, 0], raw[:, 1], raw[:, 2], raw[:, [1, 0]].mean(-1)], -1))


def test_a_path_that_holds_no_ensemble_and_an_adapter_source_given_an_ensemble_are_one_line(ensemble_dir, base,
                                                                                             tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{ensemble_dir.parent} holds no ensemble .* it holds adapters at "
                                                f"{ensemble_dir / 'reward_0'}"):
        EnsembleReward(str(ensemble_dir.parent)).setup(*base)
    with pytest.raises(FileNotFoundError, match="no reward adapter at .*nowhere"):
        EnsembleReward([str(ensemble_dir / "reward_0"), str(tmp_path / "nowhere")]).setup(*base)
    with pytest.raises(FileNotFoundError, match=r"holds an ensemble of 3 reward models \(ensemble.json\), not one "
                                                r"adapter: score with all of them, reward: \{class_path: "
                                                r"rlhf_lightning.EnsembleReward"):
        AdapterReward(str(ensemble_dir)).setup(*base)
    (tmp_path / "lacking").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "head.safetensors", "head_config.json"):
        (tmp_path / "lacking" / name).write_bytes((ensemble_dir / "reward_0" / name).read_bytes())
    spec = BaseModelSpec(name_or_path=str(json.loads((ensemble_dir / "reward_0" / "adapter_config.json").read_text())
                                          ["base_model_name_or_path"]))
    with pytest.raises(FileNotFoundError, match="standardize needs each member's reward_stats.json"):
        EnsembleReward([str(tmp_path / "lacking")]).setup(SharedBase(load_causal_lm(spec, load_tokenizer(spec))),
                                                          None)


def test_ppo_holds_one_base_beside_the_members_and_trains_neither(tiny_model_dir, ensemble_dir):
    module = make(PPO, tiny_model_dir, EnsembleReward(str(ensemble_dir)), sampling={"max_new_tokens": 6},
                  critic={"from_reward": True})
    assert sorted(module.model.adapters) == ["critic", "policy", "reward_0", "reward_1", "reward_2"]
    assert_one_copy_of_the_base(module, tiny_model_dir)
    # the critic starts as the first member
    critic = {n.replace(".critic.", "."): p for n, p in module.model.model.named_parameters() if adapter_of(n) == "critic"}
    first = {n.replace(".reward_0.", "."): p for n, p in module.model.model.named_parameters() if adapter_of(n) == "reward_0"}
    assert critic.keys() == first.keys() and all(torch.equal(critic[n], first[n]) for n in critic)
    trainable = {adapter_of(n) for n, p in module.model.model.named_parameters() if p.requires_grad}
    assert trainable == {"policy", "critic"}
    assert not any(p.requires_grad for name, head in module.model.heads.items() if name.startswith("reward")
                   for p in head.parameters())


class Last(L.Callback):
    """The logged values at the end of the fit (training's last iteration and the last validation)."""

    def on_fit_end(self, trainer, pl_module) -> None:
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.slow
@pytest.mark.parametrize("cls", [PPO, GRPO, RLOO, REINFORCEPlusPlus, OnlineDPO, OnPolicyDistillation])
def test_every_online_algorithm_trains_on_an_ensemble_and_logs_its_disagreement(cls, tiny_model_dir, ensemble_dir):
    # on-policy distillation trains toward its teacher and measures the ensemble's scores
    teacher = {"teacher": str(tiny_model_dir)} if cls is OnPolicyDistillation else {}
    module = make(cls, tiny_model_dir, EnsembleReward(str(ensemble_dir), combine="uwo"),
                  defaults={**ONLINE_SETTINGS, "samples_per_prompt": 2, "update": {"epochs": 2, "num_minibatches": 1}},
                  **teacher)
    policy = {n: p.clone() for n, p in module.named_parameters() if adapter_of(n) == "policy"}
    members = {n: p.clone() for n, p in module.named_parameters() if (adapter_of(n) or "").startswith("reward")}
    data = prompts(module, n=12, batch_size=4, val_fraction=0.34, val_batch_size=4)
    last = Last()
    L.Trainer(max_epochs=1, limit_train_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, num_sanity_val_steps=0, log_every_n_steps=1, val_check_interval=2,
              check_val_every_n_epoch=None, callbacks=[last]).fit(module, datamodule=data)
    prefix = module.metric_prefix
    assert last.metrics[f"{prefix}/objective/reward_disagreement"] > 0
    assert {f"{prefix}/objective/reward_member_{k}" for k in range(3)} <= last.metrics.keys()
    assert last.metrics[f"{prefix}/val/reward_disagreement"] > 0
    assert any(not torch.equal(p, policy[n]) for n, p in module.named_parameters() if n in policy)
    assert all(torch.equal(p, members[n]) for n, p in module.named_parameters() if n in members)
