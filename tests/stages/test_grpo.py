"""GRPO (``rlhf_lightning.stages.grpo``) on a tiny GPT-2: passes, KL term, losses, rewards, CLI, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhf_lightning import GRPO, RLOO, AdapterReward, FunctionReward
from rlhf_lightning.algorithms.policy_losses import Clip
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from tests.helpers.models import LORA, built
from tests.helpers.online import fit_iterations, make_online, perturb, prompt_batch, prompts

REPO = Path(__file__).resolve().parents[2]


def test_grpo_single_step_skips_the_old_logprob_pass_and_beta_zero_the_reference(tiny_model_dir, reward_dir):
    module = make_online(GRPO, tiny_model_dir, reward_dir, update={"epochs": 1, "num_minibatches": 1}, kl={"coef": 0.0})
    calls = []
    original = module.policy.response_logprobs
    module.policy.response_logprobs = lambda role, *a, **k: calls.append(role) or original(role, *a, **k)
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    assert experience.logprobs is None and experience.ref_logprobs is None and calls == []
    terms = module.losses(experience)  # old log-probs = this pass's own, detached: ratio exactly 1
    assert terms["policy/ratio"].item() == 1.0 and terms["policy/clipfrac"].item() == 0.0
    assert calls == ["policy"]
    # with beta > 0 the reference is scored in the rollout, the policy still only once
    module = make_online(GRPO, tiny_model_dir, reward_dir, update={"epochs": 1, "num_minibatches": 1}, kl={"coef": 0.1})
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    assert experience.logprobs is None and experience.ref_logprobs is not None


def test_kl_in_the_loss_is_k3_times_the_ratio(tiny_model_dir, reward_dir):
    module = make_online(GRPO, tiny_model_dir, reward_dir, kl={"coef": 0.5})
    perturb(module, "policy")
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    with torch.no_grad():
        perturb(module, "policy")  # the policy moves after sampling: ratios differ from 1
    terms = module.losses(experience)
    logprobs, _ = module.policy.response_logprobs("policy", experience.input_ids, experience.attention_mask,
                                           experience.response_mask)
    mask = experience.response_mask
    log_ratio_ref = experience.ref_logprobs - logprobs
    k3 = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # ALGORITHMS.md's formula, written out
    ratio = torch.exp(logprobs - experience.logprobs)
    expected = (torch.where(mask, k3 * ratio, 0.0).sum() / mask.sum())
    torch.testing.assert_close(terms["loss/kl"], expected.detach(), rtol=1e-5, atol=1e-6)
    # the total is the surrogate plus beta times that term (token mean over the step)
    torch.testing.assert_close(terms["loss/total"], terms["loss/policy"] + 0.5 * expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_the_step_loss_does_not_depend_on_the_micro_batch_split(aggregation, tiny_model_dir, reward_dir):
    """Two micro-batches of unequal token counts accumulate exactly the gradient of the whole batch."""
    module = make_online(GRPO, tiny_model_dir, reward_dir, loss={"aggregation": aggregation}, kl={"coef": 0.1},
                         update={"epochs": 1, "num_minibatches": 1})
    perturb(module, "policy")
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    split = [torch.arange(0, 5), torch.arange(5, 16)]  # unequal rows, hence unequal token counts
    policy = [p for n, p in module.named_parameters() if adapter_of(n) == "policy"]
    whole = torch.autograd.grad(module.losses(experience)["loss/total"], policy)
    micros = [experience.select(rows) for rows in split]
    normalisers = module.step_normalisers(micros)
    parts = [torch.autograd.grad(module.policy_losses(m, normalisers["policy"])[0], policy) for m in micros]
    for full, first, second in zip(whole, *parts, strict=True):
        torch.testing.assert_close(full, first + second, rtol=1e-5, atol=1e-7)


def test_truncated_completions_carry_no_loss(tiny_model_dir, reward_dir):
    module = make_online(GRPO, tiny_model_dir, reward_dir, loss={"mask_truncated_completions": True},
                         sampling={"max_new_tokens": 3})
    experience, stats = module.collect_and_prepare(prompt_batch(module))
    loss_mask = module.loss_mask(experience)
    stopped_rows = loss_mask.any(-1)
    assert 0 < stopped_rows.sum() < 16, "the tiny model must leave some responses unfinished in 3 tokens"
    assert torch.equal(loss_mask[stopped_rows], experience.response_mask[stopped_rows])
    # a loss computed on the unfinished rows alone is exactly zero, and so is its gradient
    unfinished = experience.select((~stopped_rows).nonzero().flatten())
    total = module.losses(unfinished)["loss/total"]
    assert total.item() == 0.0
    policy = [p for n, p in module.named_parameters() if adapter_of(n) == "policy"]
    assert all(g.abs().sum() == 0 for g in torch.autograd.grad(total, policy, allow_unused=False))
    with pytest.raises(ValueError, match="^loss.mask_truncated_completions needs a sampling.stop_token"):
        make_online(GRPO, tiny_model_dir, reward_dir, loss={"mask_truncated_completions": True},
                    sampling={"stop_token": None})


def test_lora_dropout_is_forced_to_zero_and_top_k_is_refused(tiny_model_dir, reward_dir):
    module = make_online(GRPO, tiny_model_dir, reward_dir, policy_lora=LoraSpec(r=4, alpha=8, dropout=0.3))
    assert module.model.model.peft_config["policy"].lora_dropout == 0.0
    experience, _ = module.collect_and_prepare(prompt_batch(module))  # old log-probs from the rollout (2 x 2 steps)
    terms = module.losses(experience)
    assert terms["policy/ratio"].item() == pytest.approx(1.0, abs=1e-6)  # no dropout noise between passes
    with pytest.raises(ValueError, match="sampling.top_k/top_p"):
        make_online(GRPO, tiny_model_dir, reward_dir, sampling={"top_k": 5})
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        make_online(RLOO, tiny_model_dir, reward_dir, samples_per_prompt=1)
    with pytest.raises(ValueError, match="epochs must be an integer >= 1, got 0"):
        make_online(GRPO, tiny_model_dir, reward_dir, update={"epochs": 0})


def length_bonus(prompts, completions, completion_ids, topic, **kwargs):
    """A TRL-style reward function: the extra column arrives as a keyword; None = not applicable."""
    return [None if t == "skip" else 0.1 * len(ids) for t, ids in zip(topic, completion_ids, strict=True)]


def test_reward_functions_with_trl_signature_columns_weights_and_none(tiny_model_dir, reward_dir, tmp_path):
    rows = [{"prompt": "the cat", "topic": "skip"}, {"prompt": "a dog", "topic": "animals"}]
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("\n".join(json.dumps(row) for row in rows))
    module = built(GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), policy_lora=LORA,
                        sampling={"max_new_tokens": 5}, samples_per_prompt=2,
                        reward=[AdapterReward(str(reward_dir)), FunctionReward(length_bonus)],
                        reward_shaping={"weights": [1.0, 2.0]}))
    batch = next(iter(prompts(module, dataset=str(data_file), batch_size=2).train_dataloader()["prompts"]))
    assert batch["columns"] == {"topic": ["skip", "animals"]} or batch["columns"] == {"topic": ["animals", "skip"]}
    experience, stats = module.collect_and_prepare(batch)
    topics = [t for t in batch["columns"]["topic"] for _ in range(2)]
    lengths = experience.response_mask.sum(-1).float()
    with torch.no_grad():
        source = module.rewards.score(module.collector.reward_inputs(
            module, experience.input_ids, experience.attention_mask, experience.response_mask,
            module.policy.decode(experience.responses, experience.response_mask),
            prompts=[p for p in batch["raw_prompt"] for _ in range(2)], columns={"topic": topics}))
    expected_bonus = torch.tensor([math.nan if t == "skip" else 0.1 * float(n) for t, n in zip(topics, lengths, strict=True)])
    torch.testing.assert_close(source[:, 1], expected_bonus, equal_nan=True)
    expected = source[:, 0] + 2.0 * torch.nan_to_num(source[:, 1])
    torch.testing.assert_close(experience.scores, expected)
    assert {"objective/score/reward_model", "objective/score/length_bonus"} <= set(stats)


def test_grpo_fit_logs_its_terms_and_resumes_exactly(tiny_model_dir, reward_dir, tmp_path):
    kwargs = dict(kl={"coef": 0.05}, policy_loss=Clip(clip_range_high=0.28), loss={"ent_coef": 0.01})
    module = make_online(GRPO, tiny_model_dir, reward_dir, **kwargs)
    trainer, uninterrupted = fit_iterations(module, prompts(module, n=24, batch_size=4), tmp_path / "full", iterations=4,
                                  prefix="grpo/")
    expected = {"grpo/loss/policy", "grpo/loss/kl", "grpo/loss/entropy", "grpo/loss/total", "grpo/policy/approx_kl",
                "grpo/policy/clipfrac_low", "grpo/policy/clipfrac_high", "grpo/policy/entropy",
                "grpo/objective/kl", "grpo/objective/score", "grpo/objective/gold", "grpo/objective/frac_zero_std",
                "grpo/response/length", "grpo/response/eos_frac", "grpo/lr/policy", "grpo/grad_norm"}
    assert expected <= set(uninterrupted[-1]), expected - set(uninterrupted[-1])
    assert trainer.global_step == 4 * 2 * 2
    checkpoint = tmp_path / "full" / "epoch=0-step=8.ckpt"  # after iteration 2 of 4
    resumed_module = make_online(GRPO, tiny_model_dir, reward_dir, **kwargs)
    _, resumed = fit_iterations(resumed_module, prompts(resumed_module, n=24, batch_size=4), tmp_path / "resumed",
                      iterations=4, ckpt_path=str(checkpoint), prefix="grpo/")
    assert resumed == uninterrupted[2:]


def test_the_cli_takes_a_list_of_weighted_reward_sources(tiny_model_dir, reward_dir, tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"""model:
  init_args:
    base: {{name_or_path: {tiny_model_dir}}}
    policy_lora: {{r: 4, alpha: 8}}
    reward:
      - class_path: rlhf_lightning.AdapterReward
        init_args: {{path: {reward_dir}}}
      - class_path: rlhf_lightning.FunctionReward
        init_args: {{fn: rlhf_lightning.tasks.synthetic.gold_rewards}}
    reward_shaping: {{weights: [1.0, 0.5]}}
""")
    from rlhf_lightning.cli import RLHFCLI

    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "grpo.yaml"), "--config", str(mix),
                        "--trainer.logger=false"], run=False)
    assert cli.model.rewards.names == ["reward_model", "gold_rewards"] and cli.model.rewards.weights == [1.0, 0.5]


def test_a_subclass_that_fixes_a_parent_argument_keeps_it_under_the_cli(tiny_model_dir, reward_dir, tmp_path,
                                                                         monkeypatch):
    """LightningCLI saves the config as the hyper-parameters; what a subclass passes to its parent itself (not
    in the config) must still reach ``hparams``, at every level of the class chain."""
    (tmp_path / "fixed_arguments.py").write_text('''
from rlhf_lightning import GRPO, PPO
from rlhf_lightning.algorithms.advantage_estimators import GAE, GroupRelative


class DiscountedPPO(PPO):
    """PPO with gamma fixed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, advantages=GAE(gamma=0.99), **kwargs)


class DrGRPO(GRPO):
    """Dr. GRPO as a class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, advantages=GroupRelative(scale_rewards="none"), loss={"aggregation": "constant"},
                         **kwargs)
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    from rlhf_lightning.cli import RLHFCLI

    common = [f"--model.init_args.base.name_or_path={tiny_model_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
              f"--model.init_args.reward.init_args.path={reward_dir}", "--trainer.logger=false"]
    ppo = RLHFCLI(args=["--config", str(REPO / "configs" / "ppo.yaml"), "--model.class_path=fixed_arguments.DiscountedPPO",
                        "--model.init_args.critic.lora={r: 4, alpha: 8}", *common], run=False).model
    assert ppo.hparams.advantages.gamma == ppo.advantages.gamma == 0.99 and ppo.hparams["update"]["epochs"] == 4 and ppo.hparams.sampling["temperature"] == 1.0
    grpo = RLHFCLI(args=["--config", str(REPO / "configs" / "grpo.yaml"), "--model.class_path=fixed_arguments.DrGRPO",
                         *common], run=False).model
    assert grpo.hparams.advantages.scale_rewards == grpo.advantages.scale_rewards == "none"
    assert grpo.hparams["loss"]["aggregation"] == grpo.loss_settings.aggregation == "constant"
    grpo.configure_model()
    experience, _ = grpo.collect_and_prepare(prompt_batch(grpo))  # reads both during the iteration
    assert experience.advantages is not None


@pytest.mark.parametrize("ptx_coef, ptx_dataset, message", [
    (0.5, None, r"^loss\.ptx_coef=0\.5 needs pretraining text: set data\.init_args\.ptx_dataset$"),
    (0.0, "synthetic", r"^data\.init_args\.ptx_dataset is set, but GRPO has no pretraining loss on it \(loss\.ptx_coef 0\)"),
])
def test_pretraining_text_and_its_loss_come_together(tiny_model_dir, reward_dir, ptx_coef, ptx_dataset, message):
    """A loss.ptx_coef without ptx data would train without the term; ptx data without one would be read and
    never trained on: both are refused before the first rollout."""
    import lightning as L

    module = GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward(str(reward_dir)),
                  policy_lora=LORA, samples_per_prompt=2, sampling={"max_new_tokens": 4},
                  loss={"ptx_coef": ptx_coef})
    data = prompts(module, n=8, batch_size=2, ptx_dataset=ptx_dataset)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=data)
    assert module.last_samples is None  # no rollout was sampled
