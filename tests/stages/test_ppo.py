"""PPO on a tiny GPT-2: one shared base, a fresh policy equals the reference, gradients reach exactly the right
adapters, checkpoints resume exactly, and every term is logged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_lightning import PPO, AdapterReward, FunctionReward
from rlhf_lightning.algorithms.advantage_estimators import GAE
from rlhf_lightning.cli.merge_command import merge_adapter
from rlhf_lightning.models.shared_base import adapter_of, position_ids_from_mask
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.environment import with_repo_on_path
from tests.helpers.models import LORA, built
from tests.helpers.modules import merged
from tests.helpers.online import (
    assert_one_copy_of_the_base,
    first_batch,
    fit_iterations,
    make_ppo,
    perturb,
    prompts,
)

REPO = Path(__file__).resolve().parents[2]


def test_fresh_policy_is_the_reference_kl_zero_and_ratio_one(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir)
    rollout, stats = module.collect_and_prepare(first_batch(module))
    assert torch.equal(rollout.logprobs, rollout.ref_logprobs)
    assert stats["objective/kl"].item() == 0.0
    terms = module.losses(rollout.select(torch.randperm(8)[:4]), None)
    assert terms["policy/ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert terms["policy/approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert terms["policy/clipfrac"].item() == 0.0


def test_every_role_reads_the_same_base_weights_and_the_process_holds_one_copy(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir)
    seen: dict[str, set[int]] = {}
    current = {"role": None}
    # Hooks on the LoRA layers (the fused forward reads base_layer.weight without calling base_layer).
    handles = [
        layer.register_forward_pre_hook(
            lambda mod, args: seen.setdefault(current["role"], set()).add(mod.base_layer.weight.data_ptr()))
        for layer in module.model.hf_model.modules() if hasattr(layer, "base_layer")
    ]
    assert len(handles) == 4 * 2  # every linear layer of the 2-layer GPT-2
    batch = first_batch(module)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for role in ("policy", None, "critic", "reward"):
        current["role"] = role
        with module.model.role(role):
            module.model.hidden_states(ids, mask)
    for handle in handles:
        handle.remove()
    assert len(seen) == 4 and len({frozenset(pointers) for pointers in seen.values()}) == 1
    assert_one_copy_of_the_base(module, tiny_model_dir)


def test_policy_loss_reaches_only_the_policy_and_value_loss_only_the_critic(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir, update={"num_minibatches": 1})
    perturb(module, "policy", "critic")  # non-zero B, so that A gets gradient too
    rollout, _ = module.collect_and_prepare(first_batch(module))
    terms = module.losses(rollout, None)
    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad}
    policy_params = {n for n in trainable if adapter_of(n) == "policy"}
    critic_params = {n for n in trainable if adapter_of(n) == "critic" or n.startswith("model.heads.critic")}
    assert set(trainable) == policy_params | critic_params  # the reward adapter and head are frozen

    def reached(loss) -> set[str]:
        grads = torch.autograd.grad(loss, list(trainable.values()), allow_unused=True, retain_graph=True)
        return {name for name, grad in zip(trainable, grads, strict=True) if grad is not None and grad.abs().sum() > 0}

    assert reached(terms["loss/policy"]) == policy_params
    assert reached(terms["loss/value"]) == critic_params
    assert reached(terms["loss/total"]) == policy_params | critic_params


def test_training_updates_adapters_never_the_base_and_logs_every_term(tiny_model_dir, reward_dir, tmp_path):
    module = make_ppo(tiny_model_dir, reward_dir, loss={"ent_coef": 0.01, "ptx_coef": 0.1}, kl={"target": 1.0})
    base_before = {n: p.clone() for n, p in module.model.base_parameters()}
    policy_before = {n: p.clone() for n, p in module.model.model.named_parameters() if adapter_of(n) == "policy"}
    data = prompts(module, n=32, ptx_dataset="synthetic", ptx_batch_size=4)
    trainer, rows = fit_iterations(module, data, tmp_path, iterations=3)
    for name, parameter in module.model.base_parameters():
        assert torch.equal(parameter, base_before[name]), name
    assert any(not torch.equal(p, policy_before[n]) for n, p in module.model.model.named_parameters()
               if adapter_of(n) == "policy")
    assert trainer.global_step == 3 * 2 * 2  # iterations x epochs x num_minibatches
    expected = {
        "ppo/loss/policy", "ppo/loss/value", "ppo/loss/entropy", "ppo/loss/ptx", "ppo/loss/total",
        "ppo/policy/approx_kl", "ppo/policy/clipfrac", "ppo/policy/ratio", "ppo/policy/entropy",
        "ppo/policy/epochs", "ppo/policy/early_stopped", "ppo/value/clipfrac", "ppo/value/explained_variance",
        "ppo/value/mean", "ppo/objective/kl", "ppo/objective/kl_penalty", "ppo/objective/kl_coef",
        "ppo/objective/score", "ppo/objective/score_std", "ppo/objective/rlhf_reward", "ppo/objective/gold",
        "ppo/response/length", "ppo/response/eos_frac", "ppo/lr/policy", "ppo/lr/critic", "ppo/grad_norm",
        "ppo/iteration",
    }
    assert expected <= set(rows[-1]), expected - set(rows[-1])
    assert {"ppo/time/rollout", "ppo/time/update", "ppo/time/iteration",
            "ppo/throughput/tokens_per_second"} <= set(trainer.callback_metrics)
    # our decoder samples the trained weights themselves: its syncs take next to nothing, inside time/update
    assert 0 <= float(trainer.callback_metrics["ppo/time/engine_sync"]) < float(
        trainer.callback_metrics["ppo/time/update"])
    assert [row["ppo/iteration"] for row in rows] == [1.0, 2.0, 3.0]
    assert rows[-1]["ppo/objective/kl_coef"] != 0.05  # the adaptive controller moved


def test_resume_reproduces_the_next_iterations_exactly(tiny_model_dir, reward_dir, tmp_path):
    kwargs = dict(kl={"target": 0.5})  # the adaptive controller's state must travel too
    module = make_ppo(tiny_model_dir, reward_dir, **kwargs)
    _, uninterrupted = fit_iterations(module, prompts(module, n=48), tmp_path / "full", iterations=4)
    checkpoint = tmp_path / "full" / "epoch=0-step=8.ckpt"  # after iteration 2 of 4 (2 epochs x 2 minibatches each)
    saved = torch.load(checkpoint, weights_only=False)
    assert all(adapter_of(k) in ("policy", "critic") or k.startswith("model.heads.critic")
               for k in saved["state_dict"])
    assert "kl_controller" in saved and saved["optimizer_states"]

    resumed_module = make_ppo(tiny_model_dir, reward_dir, **kwargs)
    _, resumed = fit_iterations(resumed_module, prompts(resumed_module, n=48), tmp_path / "resumed", iterations=4,
                      ckpt_path=str(checkpoint))
    assert len(resumed) == 2
    assert resumed == uninterrupted[2:]


def test_export_and_merge_give_the_policy(tiny_model_dir, reward_dir, tmp_path):
    module = make_ppo(tiny_model_dir, reward_dir)
    perturb(module, "policy")
    paths = module.export(tmp_path / "adapters")
    assert (paths["critic"] / "head.safetensors").exists()
    merged = merge_adapter(paths["policy"], tmp_path / "merged", base=str(tiny_model_dir))
    batch = first_batch(module)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with module.model.role("policy"):
        expected = module.model.lm_head(module.model.hidden_states(ids, mask))
    logits = AutoModelForCausalLM.from_pretrained(merged)(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_scores_are_normalised_penalised_and_clipped(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir,
                      reward_shaping={"normalize": True, "missing_eos_penalty": 1.0, "clip": 1.2})
    scores = module.rewards.response_scores(torch.tensor([[0.5], [4.5], [-5.5], [2.5]]),
                                            torch.tensor([True, True, True, False]))
    # (s - 0.5) / 2, minus 1 where the response never stopped, clipped to +-1.2
    torch.testing.assert_close(scores, torch.tensor([0.0, 1.2, -1.2, 0.0]))


def test_function_reward_scores_texts_and_config_errors_are_clear(tiny_model_dir, reward_dir):
    torch.manual_seed(0)
    module = built(PPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=FunctionReward(gold_rewards),
                       policy_lora=LORA, critic={"lora": LORA}, sampling={"max_new_tokens": 6}, gold_reward=gold_rewards))
    rollout, stats = module.collect_and_prepare(first_batch(module))
    torch.testing.assert_close(stats["objective/score"], stats["objective/gold"])  # the same function
    with pytest.raises(ValueError, match="critic.from_reward needs an AdapterReward"):
        PPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=FunctionReward(gold_rewards),
            critic={"from_reward": True})
    unbuilt = PPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward("missing/reward"))
    with pytest.raises(FileNotFoundError, match="run the reward stage first"):
        unbuilt.configure_model()  # the reward adapter is read when the model is built
    with pytest.raises(ValueError, match="must split into update.num_minibatches=3"):
        make_ppo(tiny_model_dir, reward_dir, update={"num_minibatches": 3}).updater.minibatch_sizes(8)


def test_critic_can_start_from_the_reward_model(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir, critic={"from_reward": True})
    batch = first_batch(module)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    last = torch.full((ids.shape[0],), ids.shape[1] - 1)
    assert torch.equal(module.model.score("critic", ids, mask, last), module.model.score("reward", ids, mask, last))


def run_under_ddp(config: str, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``fit`` of ``configs/<config>`` on two CPU processes (gloo), tiny and short, from a fresh interpreter."""
    command = [
        sys.executable, "-m", "rlhf_lightning", "fit", "--config", str(REPO / "configs" / config), *overrides,
        "--model.init_args.sampling.max_new_tokens=6", "--model.init_args.update.target_kl=0.02",  # early stop decided alike on ranks
        f"--model.init_args.export_dir={tmp_path / 'adapters'}",
        "--data.init_args.synthetic_rows=64", "--data.init_args.val_fraction=0.25", "--data.init_args.val_batch_size=8",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2", "--trainer.val_check_interval=2", "--trainer.logger=false",
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
    ]
    env = with_repo_on_path()
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "distributed_backend=gloo" in result.stderr
    assert (tmp_path / "adapters" / "policy" / "adapter_model.safetensors").exists()
    return result


@pytest.mark.slow
def test_ppo_runs_under_ddp_on_two_cpu_processes(tiny_model_dir, reward_dir, tmp_path):
    run_under_ddp("ppo.yaml", tmp_path, f"--model.init_args.base.name_or_path={tiny_model_dir}",
                  f"--model.init_args.reward.init_args.path={reward_dir}",
                  "--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.critic.lora={r: 4, alpha: 8}",
                  "--model.init_args.kl.target=1.0", "--data.init_args.batch_size=8")
    assert (tmp_path / "adapters" / "critic" / "head.safetensors").exists()


@pytest.mark.parametrize("options", [
    {"critic": {"backward": "joint"}},  # one backward for both losses, as under DDP
    {"logprob_chunk": 2},  # log-probs in chunks, logits recomputed in the backward
    {"update": {"gradient_accumulation": 2}},  # the step's loss is normalised over the whole minibatch, not per micro-batch
])
def test_speed_and_memory_options_leave_the_numbers_unchanged(tiny_model_dir, reward_dir, tmp_path, options):
    """The default (separate backward on one device, one micro-batch) and every alternative reach the same
    metrics and adapter weights."""
    runs = []
    for kwargs in ({}, options):
        settings = merged({"update": {"num_minibatches": 1}, "loss": {"ent_coef": 0.01}}, kwargs)
        module = make_ppo(tiny_model_dir, reward_dir, **settings)
        _, rows = fit_iterations(module, prompts(module, n=16), tmp_path / str(len(runs)), iterations=2)
        trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
        runs.append((rows, trained, module.last_samples))
    (rows, trained, samples), (other_rows, other_trained, other_samples) = runs
    assert rows[-1].keys() == other_rows[-1].keys()
    # Diagnostics (clip fractions, ratios) are means over micro-batches; the losses are the step's, whatever the split.
    per_micro = ("/clipfrac", "/approx_kl", "/ratio", "/entropy", "/kl_loss")
    for row, other in zip(rows, other_rows, strict=True):
        for name in row:
            if "gradient_accumulation" in options.get("update", {}) and name.endswith(per_micro):
                continue
            assert row[name] == pytest.approx(other[name], rel=1e-4, abs=1e-5), name
    for name, parameter in trained.items():
        torch.testing.assert_close(parameter, other_trained[name], rtol=1e-4, atol=1e-5)
    assert samples.responses == other_samples.responses and samples.iteration == other_samples.iteration == 1


def test_backward_choice(tiny_model_dir, reward_dir):
    assert not make_ppo(tiny_model_dir, reward_dir).joint_backward  # one device: separate backward
    assert make_ppo(tiny_model_dir, reward_dir, critic={"backward": "joint"}).joint_backward
    with pytest.raises(ValueError, match="backward must be"):
        make_ppo(tiny_model_dir, reward_dir, critic={"backward": "twice"})


def test_rlhf_reward_is_score_minus_kl_even_with_whitened_rewards_and_adam_eps_is_used(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir, advantages=GAE(whiten_rewards=True), kl={"coef": 0.5},
                      optimizer={"adam_eps": 1e-5})
    perturb(module, "policy")
    experience, stats = module.collect_and_prepare(first_batch(module))
    kl = (experience.logprobs - experience.ref_logprobs).where(experience.response_mask, 0.0).sum(-1)  # k1
    torch.testing.assert_close(stats["objective/rlhf_reward"], (experience.scores - 0.5 * kl).mean())
    optimizer = module.configure_optimizers()["optimizer"]
    assert {group["eps"] for group in optimizer.param_groups} == {1e-5}
    assert {group["name"] for group in optimizer.param_groups} == {"policy", "critic"}
