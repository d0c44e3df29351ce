"""Online DPO on the on-policy loop, on a tiny GPT-2: each prompt's two samples become a pair ranked by the
reward sources (ties carry no loss), the loss is the DPO family's on the policy's own log-probs against the
reference, pairs stay whole through the update's shuffling, gradients reach exactly the policy adapter, and the
shipped config runs from the command line logging every metric."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from rlhf_lightning import AdapterReward, OnlineDPO
from rlhf_lightning.algorithms.dpo import dpo_loss
from rlhf_lightning.algorithms.preference_losses import IPO, Sigmoid, SimPO
from rlhf_lightning.cli import main
from rlhf_lightning.models.shared_base import REFERENCE, adapter_of
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.cli import logged_keys, one_line
from tests.helpers.modules import make
from tests.helpers.online import fit_iterations, perturb, prompt_batch, prompts

REPO = Path(__file__).resolve().parents[2]


make_online_dpo = functools.partial(make, OnlineDPO, defaults=dict(sampling={"max_new_tokens": 6}, gold_reward=gold_rewards))


def sequence_logps(module: OnlineDPO, role, experience) -> torch.Tensor:
    with torch.no_grad():
        logprobs, _ = module.policy.response_logprobs(role, experience.input_ids, experience.attention_mask,
                                               experience.response_mask)
    return torch.where(experience.response_mask, logprobs, 0.0).sum(-1)


def test_each_prompts_two_samples_are_ranked_into_a_pair_chosen_first(tiny_model_dir, reward_dir):
    module = make_online_dpo(tiny_model_dir, reward_dir)
    batch = prompt_batch(module, n=8)
    with module.policy.sampler.gathered_base(module.model):
        raw, _ = module.collector.collect(module, batch)
    rewards, _ = module.shape_rewards(raw)
    experience, stats = module.prepare_update(raw, rewards)
    assert experience.response_mask.shape[0] == 16
    before, after = raw.scores.view(8, 2), experience.scores.view(8, 2)
    torch.testing.assert_close(after[:, 0], before.max(1).values)  # chosen = the higher score
    torch.testing.assert_close(after[:, 1], before.min(1).values)
    for pair in range(8):  # the rows moved with their scores, and a pair never mixes two prompts
        rows = {tuple(raw.input_ids[2 * pair + i].tolist()) for i in range(2)}
        assert {tuple(experience.input_ids[2 * pair + i].tolist()) for i in range(2)} == rows
    ties = before[:, 0] == before[:, 1]
    assert experience.pair_weights.tolist() == (~ties).float().repeat_interleave(2).tolist()
    assert float(stats["objective/scores_margin"]) == pytest.approx(float((after[:, 0] - after[:, 1]).mean()))
    assert float(stats["objective/tie_frac"]) == pytest.approx(float(ties.float().mean()))
    assert experience.ref_logprobs is not None  # the DPO loss needs the reference


@pytest.mark.parametrize("loss, beta", [(Sigmoid(), 0.1), (IPO(), 0.5), (SimPO(), 2.0)], ids=["sigmoid", "ipo", "simpo"])
def test_the_loss_is_the_dpo_loss_of_the_untied_pairs(tiny_model_dir, reward_dir, loss, beta):
    module = make_online_dpo(tiny_model_dir, reward_dir, preference_loss=loss, beta=beta)
    perturb(module, "policy")
    experience, _ = module.collect_and_prepare(prompt_batch(module, n=8))
    # A tie, made here on the experience as the ranking marks it: that pair must carry no loss.
    weights = experience.pair_weights.clone()
    weights[:2] = 0.0
    experience = dataclasses.replace(experience, pair_weights=weights)
    terms = module.losses(experience)
    policy, reference = sequence_logps(module, "policy", experience), sequence_logps(module, REFERENCE, experience)
    lengths = experience.response_mask.sum(-1)
    expected = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], lengths[0::2], lengths[1::2],
                        beta, loss)
    counted = weights[0::2] > 0
    torch.testing.assert_close(terms["loss/policy"].detach(), expected.losses[counted].mean(), atol=1e-6, rtol=1e-5)
    margin = (expected.chosen_rewards - expected.rejected_rewards)[counted]
    torch.testing.assert_close(terms["rewards/margin"], margin.mean(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(terms["rewards/accuracy"], (margin > 0).float().mean())


def test_an_iteration_keeps_pairs_whole_and_trains_only_the_policy_adapter(tiny_model_dir, reward_dir, tmp_path):
    module = make_online_dpo(tiny_model_dir, reward_dir, update={"num_minibatches": 2, "gradient_accumulation": 2})
    seen = []  # every micro-batch's rows, as (pair weights, prompt tokens)
    loss = module.loss

    def recording(micro, *args):
        seen.append((micro.pair_weights, micro.input_ids[:, :micro.prompt_length]))
        return loss(micro, *args)

    module.loss = recording
    policy = {name for name, _ in module.named_parameters() if adapter_of(name) == "policy"}
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    fit_iterations(module, prompts(module, n=8), tmp_path, iterations=1, prefix="online_dpo/")
    assert len(seen) == 4  # 2 minibatches x 2 micro-batches of 4 rows: 2 pairs each
    for weights, prompt_ids in seen:
        assert weights.shape == (4,) and torch.equal(weights[0::2], weights[1::2])
        assert torch.equal(prompt_ids[0::2], prompt_ids[1::2])  # each pair's rows answer the same prompt
    changed = {name for name, p in module.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed == policy
    with pytest.raises(ValueError, match="of whole groups of 2 rows"):
        module.updater.minibatch_sizes(12)  # 2 minibatches of 2 micro-batches of 3 rows would split a pair


def cli_arguments(tiny_model_dir, reward_dir, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "online_dpo.yaml"), "--trainer.accelerator=cpu",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.val_check_interval=2",
            f"--model.init_args.base.name_or_path={tiny_model_dir}",
            f"--model.init_args.reward.init_args.path={reward_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
            "--model.init_args.sampling.max_new_tokens=4", "--data.init_args.synthetic_rows=40",
            "--data.init_args.batch_size=4", "--data.init_args.val_batch_size=4", *extra]


def test_config_runs_from_the_cli_and_logs_every_metric(tiny_model_dir, reward_dir, tmp_path):
    main(cli_arguments(tiny_model_dir, reward_dir))
    assert (tmp_path / "outputs/online_dpo/adapters/policy/adapter_config.json").exists()
    expected = {f"online_dpo/{name}" for name in (
        "objective/scores_margin", "objective/tie_frac", "objective/kl", "objective/score", "loss/policy",
        "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected",
        "val/score", "val/gold", "val/kl")}
    missing = expected - logged_keys(tmp_path / "outputs/online_dpo", expected)
    assert not missing, missing


@pytest.mark.parametrize("argument, expected, code", [
    # the policy-gradient family's arguments and a fixed pair size are not online DPO's: the parser refuses them
    ("--model.init_args.samples_per_prompt=4", "OnlineDPO takes no argument 'samples_per_prompt'", 2),
    ("--model.init_args.kl.coef=0.1", "OnlineDPO takes no argument 'kl.coef'", 2),
    ("--model.init_args.kl_coef=0.1", "OnlineDPO takes no argument 'kl_coef'", 2),  # the name before groups
    ("--model.init_args.clip_range=0.1", "OnlineDPO takes no argument 'clip_range'", 2),
    ("--model.init_args.loss_type=kto", "loss_type", 2),  # not a DPO loss
    ("--data.init_args.ptx_dataset=synthetic", "has no pretraining loss on it", 1),
])
def test_settings_that_do_not_apply_are_refused_in_one_line(tiny_model_dir, reward_dir, capsys, argument, expected,
                                                            code):
    arguments = cli_arguments(tiny_model_dir, reward_dir, argument, "--trainer.logger=false")
    assert expected in one_line(capsys, *arguments, code=code)


def test_from_python_too_a_pair_size_and_episode_bounds_without_episodes_are_refused(tiny_model_dir, reward_dir):
    arguments = dict(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward(str(reward_dir)))
    with pytest.raises(ValueError, match=r"^samples_per_prompt=3: online DPO samples exactly 2 responses"):
        OnlineDPO(**arguments, samples_per_prompt=3)
    with pytest.raises(ValueError, match=r"^episodes\.max_turns=2, episodes\.max_tokens=None: they bound episodes, "
                                         r"and there is no episodes\.environment; set it, or leave them at 4 and null$"):
        OnlineDPO(**arguments, episodes={"max_turns": 2})
