"""Every numeric argument with a range is checked in the constructor, before any model is loaded, with one line
naming the argument, the value and what was expected; the rollout's minibatch split is checked at setup, before
the first rollout."""

from __future__ import annotations

import math
import re

import lightning as L
import pytest

from rlhf_lightning import (
    DPO,
    GRPO,
    PPO,
    RLOO,
    SFT,
    AdapterReward,
    PreferenceDataModule,
    PromptDataModule,
    REINFORCEPlusPlus,
    RewardModel,
    SFTDataModule,
)
from rlhf_lightning.algorithms.policy_losses import CISPO, Clip
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from tests.helpers.models import LORA

# A base that does not exist: a check that ran after loading would fail with FileNotFoundError instead.
MISSING = BaseModelSpec(name_or_path="/nonexistent/model")
REWARD = AdapterReward("/nonexistent/reward")

BAD_MODULE_ARGUMENTS = [
    (PPO, dict(policy_lr=0.0), "policy_lr must be > 0, got 0.0"),
    (PPO, dict(policy_lr=-1e-4), "policy_lr must be > 0, got -0.0001"),
    (PPO, dict(critic_lr=0.0), "critic_lr must be > 0, got 0.0"),
    (PPO, dict(epochs=0), "epochs must be an integer >= 1, got 0"),
    (PPO, dict(num_minibatches=0), "num_minibatches must be an integer >= 1, got 0"),
    (PPO, dict(gradient_accumulation=0), "gradient_accumulation must be an integer >= 1, got 0"),
    (PPO, dict(micro_batch_tokens=0), "micro_batch_tokens must be an integer >= 1 or null, got 0"),
    (PPO, dict(micro_batch_tokens=512, gradient_accumulation=2), "micro_batch_tokens=512 and gradient_accumulation=2 "
     "both split each minibatch into micro-batches: by tokens, or into equal parts; set gradient_accumulation: 1 or "
     "micro_batch_tokens: null"),
    (PPO, dict(samples_per_prompt=0), "samples_per_prompt must be an integer >= 1, got 0"),
    (PPO, dict(clip_range_value=-0.2), "clip_range_value must be >= 0 or null, got -0.2"),
    (PPO, dict(gamma=1.5), r"gamma must lie in [0.0, 1.0], got 1.5"),
    (PPO, dict(lam=-0.1), r"lam must lie in [0.0, 1.0], got -0.1"),
    (PPO, dict(kl_coef=-0.05), "kl_coef must be >= 0, got -0.05"),
    (PPO, dict(kl_target=0.0), "kl_target must be > 0 or null, got 0.0"),
    (PPO, dict(kl_horizon=0), "kl_horizon must be an integer >= 1, got 0"),
    (PPO, dict(kl_estimator="k4"), "kl_estimator must be one of k1, k2, k3, got 'k4'"),
    (PPO, dict(vf_coef=-0.1), "vf_coef must be >= 0, got -0.1"),
    (PPO, dict(ent_coef=-0.01), "ent_coef must be >= 0, got -0.01"),
    (PPO, dict(ptx_coef=-1.0), "ptx_coef must be >= 0, got -1.0"),
    (PPO, dict(target_kl=0.0), "target_kl must be > 0 or null, got 0.0"),
    (PPO, dict(max_grad_norm=0.0), "max_grad_norm must be > 0 or null, got 0.0"),
    (PPO, dict(reward_clip=-1.0), "reward_clip must be > 0 or null, got -1.0"),
    (PPO, dict(missing_eos_penalty=-1.0), "missing_eos_penalty must be >= 0 or null, got -1.0"),
    (PPO, dict(reward_weights=[math.nan]), "reward_weights[0] must be a number, got nan"),
    (PPO, dict(adam_eps=0.0), "adam_eps must be > 0, got 0.0"),
    (PPO, dict(weight_decay=-0.1), "weight_decay must be >= 0, got -0.1"),
    (PPO, dict(warmup_iterations=-1), "warmup_iterations must be an integer >= 0, got -1"),
    (PPO, dict(lr_schedule="step"), "lr_schedule must be one of constant, linear, cosine, got 'step'"),
    (PPO, dict(nonfinite="ignore"), "nonfinite must be one of raise, skip, got 'ignore'"),
    (PPO, dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (PPO, dict(temperature=0.0), "temperature must be > 0, got 0.0"),
    (PPO, dict(logprob_chunk=0), "logprob_chunk must be an integer >= 1 or null, got 0"),
    (GRPO, dict(samples_per_prompt=1), "GRPO needs samples_per_prompt >= 2"),
    (GRPO, dict(kl_target=1.0), "kl_target=1.0 with kl_coef=0: the adaptive controller multiplies the coefficient"),
    (GRPO, dict(std_eps=-1e-4), "std_eps must be >= 0, got -0.0001"),
    (GRPO, dict(scale_rewards="mean"), "scale_rewards must be one of group, batch, none, got 'mean'"),
    (RLOO, dict(samples_per_prompt=1), "RLOO needs samples_per_prompt >= 2"),
    (REINFORCEPlusPlus, dict(gamma=2.0), r"gamma must lie in [0.0, 1.0], got 2.0"),
    (REINFORCEPlusPlus, dict(baseline="group"), "baseline: group needs samples_per_prompt >= 2, got 1"),
    (DPO, dict(lr=-1.0), "lr must be > 0, got -1.0"),
    (DPO, dict(simpo_gamma=-0.5), "simpo_gamma must be >= 0, got -0.5"),
    (DPO, dict(warmup_steps=-1), "warmup_steps must be an integer >= 0, got -1"),
    (DPO, dict(nonfinite="zero"), "nonfinite must be one of raise, skip, got 'zero'"),
    (DPO, dict(top_p=0.0), r"top_p must lie in (0.0, 1.0], got 0.0"),
    (SFT, dict(lr=0.0), "lr must be > 0, got 0.0"),
    (SFT, dict(lr=-3e-4), "lr must be > 0, got -0.0003"),
    (SFT, dict(weight_decay=-0.01), "weight_decay must be >= 0, got -0.01"),
    (SFT, dict(lr_schedule="exp"), "lr_schedule must be one of constant, linear, cosine, got 'exp'"),
    (RewardModel, dict(lr=0.0), "lr must be > 0, got 0.0"),
    (RewardModel, dict(center_coef=-0.01), "center_coef must be >= 0, got -0.01"),
    (RewardModel, dict(warmup_steps=1.5), "warmup_steps must be an integer >= 0, got 1.5"),
]


@pytest.mark.parametrize("cls, bad, message", BAD_MODULE_ARGUMENTS,
                         ids=[f"{cls.__name__}-{next(iter(bad))}" for cls, bad, _ in BAD_MODULE_ARGUMENTS])
def test_bad_module_arguments_fail_before_the_model_loads(cls, bad, message):
    kwargs = {"reward": REWARD} if cls in (PPO, GRPO, RLOO, REINFORCEPlusPlus) else {}
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        cls(base=MISSING, **kwargs, **bad)


BAD_DATA_ARGUMENTS = [
    (PromptDataModule, dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (PromptDataModule, dict(val_batch_size=0), "val_batch_size must be an integer >= 1 or null, got 0"),
    (PromptDataModule, dict(max_length=0), "max_length must be an integer >= 1, got 0"),
    (PromptDataModule, dict(ptx_batch_size=0), "ptx_batch_size must be an integer >= 1, got 0"),
    (PromptDataModule, dict(val_fraction=1.0), "val_fraction must lie in [0.0, 1.0), got 1.0"),
    (SFTDataModule, dict(synthetic_rows=0), "synthetic_rows must be an integer >= 1, got 0"),
    (SFTDataModule, dict(num_workers=-1), "num_workers must be an integer >= 0, got -1"),
    (PreferenceDataModule, dict(on_too_long="truncate"), "on_too_long must be one of skip, error, got 'truncate'"),
]


@pytest.mark.parametrize("cls, bad, message", BAD_DATA_ARGUMENTS,
                         ids=[f"{cls.__name__}-{next(iter(bad))}" for cls, bad, _ in BAD_DATA_ARGUMENTS])
def test_bad_data_arguments_fail_in_the_constructor(cls, bad, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        cls(**bad)


@pytest.mark.parametrize("make, message", [
    (lambda: LoraSpec(r=0).check(), "lora.r must be an integer >= 1, got 0"),
    (lambda: LoraSpec(alpha=0).to_peft(), "lora.alpha must be > 0, got 0"),
    (lambda: LoraSpec(dropout=1.0).check("policy_lora"), "policy_lora.dropout must lie in [0.0, 1.0), got 1.0"),
    (lambda: DPO(base=BaseModelSpec(), policy_lora=LoraSpec(r=0)), "policy_lora.r must be an integer >= 1, got 0"),
    (lambda: BaseModelSpec(dtype="float8"), "base.dtype must be one of auto, float32, bfloat16, float16, got 'float8'"),
    (lambda: Clip(clip_range=-0.1), "policy_loss.clip_range must be >= 0, got -0.1"),
    (lambda: Clip(clip_range_high=-0.1), "policy_loss.clip_range_high must be >= 0 or null, got -0.1"),
    (lambda: Clip(ratio_level="group"), "policy_loss.ratio_level must be one of token, sequence, sequence_sum, got"),
    (lambda: CISPO(max_weight=0.0), "policy_loss.max_weight must be > 0, got 0.0"),
    (lambda: CISPO(max_weight=2.0, min_weight=3.0), "policy_loss: min_weight=3.0 must be below max_weight=2.0"),
])
def test_bad_model_specs_and_policy_losses_fail_when_checked_or_used(make, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make()


def test_a_policy_loss_that_is_not_one_is_refused_before_the_model_loads():
    with pytest.raises(TypeError, match=r"^policy_loss must be a PolicyLoss \(one of Clip, CISPO"):
        PPO(base=MISSING, reward=REWARD, policy_loss="cispo")


def test_a_rollout_that_does_not_split_fails_at_setup(tiny_model_dir, reward_dir):
    module = GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward(str(reward_dir)),
                  policy_lora=LORA, samples_per_prompt=2, num_minibatches=4, max_new_tokens=4)
    data = PromptDataModule(synthetic_rows=12, batch_size=3, val_fraction=0.0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    with pytest.raises(ValueError, match=re.escape(
            "the rollout batch of 6 responses (data.init_args.batch_size=3 prompts x samples_per_prompt=2) must "
            "split into num_minibatches=4 minibatches of gradient_accumulation=1 equal micro-batches")):
        trainer.fit(module, datamodule=data)
    assert module.last_samples is None  # no rollout was sampled
