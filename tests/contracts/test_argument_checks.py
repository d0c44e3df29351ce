"""Every numeric argument with a range is checked in the constructor, before any model is loaded, with one line
naming the argument, the value and what was expected; the rollout's minibatch split is checked at setup, before
the first rollout."""

from __future__ import annotations

import dataclasses
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
    Asynchronous,
    Episodes,
    LossSettings,
    OnlineDPO,
    OnPolicyDistillation,
    PreferenceDataModule,
    PromptDataModule,
    REINFORCEPlusPlus,
    RewardModel,
    SFTDataModule,
)
from rlhf_lightning.algorithms.advantage_estimators import GAE, GroupRelative, WhitenedReturns
from rlhf_lightning.algorithms.policy_losses import CISPO, Clip
from rlhf_lightning.core.policy import Policy
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from tests.helpers.episodes import Feedback
from tests.helpers.models import LORA, tiny_spec
from tests.helpers.modules import unbuilt

# A base that does not exist: a check that ran after loading would fail with FileNotFoundError instead.
MISSING = BaseModelSpec(name_or_path="/nonexistent/model")
REWARD = AdapterReward("/nonexistent/reward")

BAD_MODULE_ARGUMENTS = [
    (PPO, dict(optimizer={"lr": 0.0}), "optimizer.lr must be > 0, got 0.0"),
    (PPO, dict(optimizer={"lr": -1e-4}), "optimizer.lr must be > 0, got -0.0001"),
    (PPO, dict(critic={"lr": 0.0}), "critic.lr must be > 0, got 0.0"),
    (PPO, dict(update={"epochs": 0}), "update.epochs must be an integer >= 1, got 0"),
    (PPO, dict(update={"num_minibatches": 0}), "update.num_minibatches must be an integer >= 1, got 0"),
    (PPO, dict(update={"gradient_accumulation": 0}), "update.gradient_accumulation must be an integer >= 1, got 0"),
    (PPO, dict(update={"micro_batch_tokens": 0}), "update.micro_batch_tokens must be an integer >= 1 or null, got 0"),
    (PPO, dict(update={"micro_batch_tokens": 512, "gradient_accumulation": 2}), "update.micro_batch_tokens=512 and "
     "update.gradient_accumulation=2 both split each minibatch into micro-batches: by tokens, or into equal parts; "
     "set update.gradient_accumulation: 1 or update.micro_batch_tokens: null"),
    (PPO, dict(samples_per_prompt=0), "samples_per_prompt must be an integer >= 1, got 0"),
    (PPO, dict(critic={"clip_range_value": -0.2}), "critic.clip_range_value must be >= 0 or null, got -0.2"),
    (PPO, dict(kl={"coef": -0.05}), "kl.coef must be >= 0, got -0.05"),
    (PPO, dict(kl={"target": 0.0}), "kl.target must be > 0 or null, got 0.0"),
    (PPO, dict(kl={"horizon": 0}), "kl.horizon must be an integer >= 1, got 0"),
    (PPO, dict(kl={"estimator": "k4"}), "kl.estimator must be one of k1, k2, k3, got 'k4'"),
    (PPO, dict(critic={"vf_coef": -0.1}), "critic.vf_coef must be >= 0, got -0.1"),
    (PPO, dict(loss={"ent_coef": -0.01}), "loss.ent_coef must be >= 0, got -0.01"),
    (PPO, dict(loss={"ptx_coef": -1.0}), "loss.ptx_coef must be >= 0, got -1.0"),
    (GRPO, dict(loss={"aggregation": "sum"}),
     "loss.aggregation must be one of token_mean, sequence_mean, constant, got 'sum'"),
    (GRPO, dict(loss={"mask_truncated_completions": True}, sampling={"stop_token": None}),
     "loss.mask_truncated_completions needs a sampling.stop_token: without one no response ever stops"),
    (GRPO, dict(episodes={"max_turns": 0}), "episodes.max_turns must be an integer >= 1, got 0"),
    (GRPO, dict(episodes={"max_tokens": 0}), "episodes.max_tokens must be > 0 or null, got 0"),
    (GRPO, dict(episodes={"max_turns": 3}), "episodes.max_turns=3, episodes.max_tokens=None: they bound episodes, and "
     "there is no episodes.environment; set it, or leave them at 4 and null"),
    (RLOO, dict(episodes={"max_tokens": 64}), "episodes.max_turns=4, episodes.max_tokens=64: they bound episodes"),
    (PPO, dict(asynchronous={"max_staleness": -1}), "asynchronous.max_staleness must be an integer >= 0, got -1"),
    (PPO, dict(asynchronous={"rollout_timeout": 0.0}), "asynchronous.rollout_timeout must be > 0, got 0.0"),
    (GRPO, dict(asynchronous={"max_staleness": 1}), "asynchronous.max_staleness=1: the engine Auto draws in the "
     "trainer's own process"),
    (PPO, dict(update={"target_kl": 0.0}), "update.target_kl must be > 0 or null, got 0.0"),
    (PPO, dict(update={"max_grad_norm": 0.0}), "update.max_grad_norm must be > 0 or null, got 0.0"),
    (PPO, dict(reward_shaping={"clip": -1.0}), "reward_shaping.clip must be > 0 or null, got -1.0"),
    (PPO, dict(reward_shaping={"missing_eos_penalty": -1.0}),
     "reward_shaping.missing_eos_penalty must be >= 0 or null, got -1.0"),
    (PPO, dict(reward_shaping={"weights": [math.nan]}), "reward_shaping.weights[0] must be a number, got nan"),
    (PPO, dict(optimizer={"adam_eps": 0.0}), "optimizer.adam_eps must be > 0, got 0.0"),
    (PPO, dict(optimizer={"weight_decay": -0.1}), "optimizer.weight_decay must be >= 0, got -0.1"),
    (PPO, dict(optimizer={"warmup": -1}), "optimizer.warmup must be an integer >= 0, got -1"),
    (PPO, dict(optimizer={"schedule": "step"}),
     "optimizer.schedule must be one of constant, linear, cosine, got 'step'"),
    (PPO, dict(optimizer={"nonfinite": "ignore"}), "optimizer.nonfinite must be one of raise, skip, got 'ignore'"),
    (PPO, dict(sampling={"max_new_tokens": 0}), "sampling.max_new_tokens must be an integer >= 1, got 0"),
    (PPO, dict(sampling={"temperature": 0.0}), "sampling.temperature must be > 0, got 0.0"),
    (PPO, dict(logprob_chunk=0), "logprob_chunk must be an integer >= 1 or null, got 0"),
    (GRPO, dict(samples_per_prompt=1), "GRPO needs samples_per_prompt >= 2"),
    (GRPO, dict(kl={"target": 1.0}), "kl.target=1.0 with kl.coef=0: the adaptive controller multiplies the "
     "coefficient"),
    (RLOO, dict(samples_per_prompt=1), "RLOO needs samples_per_prompt >= 2"),
    (REINFORCEPlusPlus, dict(advantages=WhitenedReturns(baseline="group")),
     "advantages.baseline: group needs samples_per_prompt >= 2, got 1"),
    (GRPO, dict(advantages=GAE()), "advantages: GAE needs a critic's values, and GRPO has no critic (PPO has one)"),
    (DPO, dict(optimizer={"lr": -1.0}), "optimizer.lr must be > 0, got -1.0"),
    (DPO, dict(beta=-1.0), "beta must be > 0, got -1.0."),
    (DPO, dict(optimizer={"warmup": -1}), "optimizer.warmup must be an integer >= 0, got -1"),
    (DPO, dict(optimizer={"nonfinite": "zero"}), "optimizer.nonfinite must be one of raise, skip, got 'zero'"),
    (DPO, dict(sampling={"top_p": 0.0}), r"sampling.top_p must lie in (0.0, 1.0], got 0.0"),
    (SFT, dict(optimizer={"lr": 0.0}), "optimizer.lr must be > 0, got 0.0"),
    (SFT, dict(optimizer={"lr": -3e-4}), "optimizer.lr must be > 0, got -0.0003"),
    (SFT, dict(optimizer={"weight_decay": -0.01}), "optimizer.weight_decay must be >= 0, got -0.01"),
    (SFT, dict(optimizer={"schedule": "exp"}),
     "optimizer.schedule must be one of constant, linear, cosine, got 'exp'"),
    (RewardModel, dict(optimizer={"lr": 0.0}), "optimizer.lr must be > 0, got 0.0"),
    (RewardModel, dict(center_coef=-0.01), "center_coef must be >= 0, got -0.01"),
    (RewardModel, dict(optimizer={"warmup": 1.5}), "optimizer.warmup must be an integer >= 0, got 1.5"),
]


def argument_id(cls: type, bad: dict) -> str:
    """``PPO-epochs``, or the dotted key of a group's field: ``PPO-kl.coef``."""
    name, value = next(iter(bad.items()))
    return f"{cls.__name__}-{name}" + (f".{next(iter(value))}" if isinstance(value, dict) else "")


@pytest.mark.parametrize("cls, bad, message", BAD_MODULE_ARGUMENTS,
                         ids=[argument_id(cls, bad) for cls, bad, _ in BAD_MODULE_ARGUMENTS])
def test_bad_module_arguments_fail_before_the_model_loads(cls, bad, message):
    kwargs = {"reward": REWARD} if cls in (PPO, GRPO, RLOO, REINFORCEPlusPlus) else {}
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        cls(base=MISSING, **kwargs, **bad)


# The arguments that became fields of a typed group: one old flat name of each group, given to a constructor.
OLD_FLAT_NAMES = [
    (GRPO, dict(kl_coef=0.1), "GRPO(kl_coef=...): kl_coef is now kl.coef; pass kl={'coef': ...} (its other fields "
     "keep the module's defaults) or KLPenalty(...), or write kl: {coef: ...} in a config"),
    (PPO, dict(temperature=0.7), "PPO(temperature=...): temperature is now sampling.temperature; pass "
     "sampling={'temperature': ...} (its other fields keep the module's defaults) or Sampling(...), or write "
     "sampling: {temperature: ...} in a config"),
    (SFT, dict(lr=1e-3), "SFT(lr=...): lr is now optimizer.lr; pass optimizer={'lr': ...} (its other fields keep the "
     "module's defaults) or OptimizerSettings(...), or write optimizer: {lr: ...} in a config"),
    (GRPO, dict(max_turns=3), "GRPO(max_turns=...): max_turns is now episodes.max_turns; pass episodes={'max_turns': "
     "...} (its other fields keep the module's defaults) or Episodes(...), or write episodes: {max_turns: ...} in a "
     "config"),
    (PPO, dict(max_staleness=1), "PPO(max_staleness=...): max_staleness is now asynchronous.max_staleness; pass "
     "asynchronous={'max_staleness': ...} (its other fields keep the module's defaults) or Asynchronous(...), or "
     "write asynchronous: {max_staleness: ...} in a config"),
    (RLOO, dict(loss_aggregation="constant"), "RLOO(loss_aggregation=...): loss_aggregation is now loss.aggregation; "
     "pass loss={'aggregation': ...} (its other fields keep the module's defaults) or LossSettings(...), or write "
     "loss: {aggregation: ...} in a config"),
]


@pytest.mark.parametrize("cls, old, message", OLD_FLAT_NAMES,
                         ids=[f"{cls.__name__}-{next(iter(old))}" for cls, old, _ in OLD_FLAT_NAMES])
def test_an_old_flat_argument_is_refused_in_one_line_naming_its_new_key(cls, old, message):
    with pytest.raises(TypeError) as raised:
        unbuilt(cls, **old)
    assert str(raised.value) == message
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("cls, old, message", [
    (PPO, dict(gamma=0.9), "PPO(gamma=...): gamma moved into the advantages argument: advantages.gamma"),
    (GRPO, dict(clip_against="sampler"),
     "GRPO(clip_against=...): clip_against moved into the policy_loss argument: policy_loss.clip_against"),
    (DPO, dict(simpo_gamma=0.5),
     "DPO(simpo_gamma=...): simpo_gamma moved into the preference_loss argument: preference_loss: SimPO with "
     "preference_loss.gamma"),
], ids=["PPO-gamma", "GRPO-clip_against", "DPO-simpo_gamma"])
def test_an_old_name_of_a_registered_class_s_argument_is_refused_in_one_line_naming_where_it_went(cls, old, message):
    with pytest.raises(TypeError) as raised:
        unbuilt(cls, **old)
    assert str(raised.value) == message


def test_an_old_flat_name_of_a_group_the_class_does_not_take_is_not_said_to_have_moved():
    """DPO has no ``update`` group: ``DPO(epochs=3)`` is an unknown argument, not one that moved to update.epochs."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'epochs'") as raised:
        DPO(base=MISSING, epochs=3)
    assert "update" not in str(raised.value)
    with pytest.raises(TypeError, match=r"^PPO\(epochs=\.\.\.\): epochs is now update\.epochs"):
        PPO(base=MISSING, reward=REWARD, epochs=3)


# The nine arguments that became fields of episodes, asynchronous and loss: old flat name -> its new key.
EPISODES_ASYNCHRONOUS_AND_LOSS = {
    "environment": "episodes.environment", "max_turns": "episodes.max_turns", "max_episode_tokens": "episodes.max_tokens",
    "max_staleness": "asynchronous.max_staleness", "rollout_timeout": "asynchronous.rollout_timeout",
    "loss_aggregation": "loss.aggregation", "mask_truncated_completions": "loss.mask_truncated_completions",
    "ent_coef": "loss.ent_coef", "ptx_coef": "loss.ptx_coef"}


@pytest.mark.parametrize("cls", [PPO, GRPO, RLOO, REINFORCEPlusPlus, OnPolicyDistillation, OnlineDPO],
                         ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("old", sorted(EPISODES_ASYNCHRONOUS_AND_LOSS))
def test_each_old_name_of_episodes_asynchronous_and_loss_is_refused_naming_its_new_key(cls, old):
    """Every online module takes ``episodes`` and ``asynchronous``; the policy-gradient ones ``loss`` too. Online DPO
    has no ``loss`` group (its loss is the preference loss): ``OnlineDPO(ent_coef=...)`` is an unknown argument, not
    one that moved."""
    new = EPISODES_ASYNCHRONOUS_AND_LOSS[old]
    group, field = new.split(".")
    value = 0.1
    with pytest.raises(TypeError) as raised:
        cls(base=MISSING, reward=REWARD, **({"teacher": "/nonexistent/teacher"} if cls is OnPolicyDistillation else {}),
            **{old: value})
    if cls is OnlineDPO and group == "loss":
        assert f"unexpected keyword argument '{old}'" in str(raised.value) and new not in str(raised.value)
        return
    assert str(raised.value).startswith(f"{cls.__name__}({old}=...): {old} is now {new}; pass {group}={{'{field}': ...}} ")
    assert str(raised.value).endswith(f", or write {group}: {{{field}: ...}} in a config")
    assert "\n" not in str(raised.value)


def test_a_dict_of_some_fields_keeps_the_modules_other_defaults():
    grpo = unbuilt(GRPO, kl={"coef": 0.1})
    assert grpo.kl == dataclasses.replace(GRPO.default_kl, coef=0.1)
    assert (grpo.kl.estimator, grpo.kl.added_to) == ("k3", "loss")  # GRPO's own, not KLPenalty's k1 in the reward
    assert grpo.hparams["kl"] == dataclasses.asdict(grpo.kl)  # saved plain
    reward_model = RewardModel(base=tiny_spec(), optimizer={"lr": 1e-3})
    assert reward_model.optimizer_settings == dataclasses.replace(RewardModel.default_optimizer, lr=1e-3)
    assert reward_model.optimizer_settings.schedule == "linear"
    sampled = unbuilt(PPO, sampling={"max_new_tokens": 6})
    assert sampled.sampling == dataclasses.replace(Policy.default_sampling, max_new_tokens=6)


def test_an_unknown_field_of_a_group_is_one_line_naming_it_and_the_fields():
    with pytest.raises(ValueError) as raised:
        unbuilt(GRPO, kl={"coeff": 1})
    assert str(raised.value) == ("kl.coeff: KLPenalty has no such field (its fields: coef, estimator, clamp, added_to, "
                                 "ratio_weighting, target, horizon)")
    with pytest.raises(ValueError) as raised:
        unbuilt(GRPO, episodes={"max_episode_tokens": 40})
    assert str(raised.value) == ("episodes.max_episode_tokens: Episodes has no such field (its fields: environment, "
                                 "max_turns, max_tokens)")
    with pytest.raises(ValueError) as raised:
        unbuilt(PPO, asynchronous={"staleness": 1})
    assert str(raised.value) == ("asynchronous.staleness: Asynchronous has no such field (its fields: max_staleness, "
                                 "rollout_timeout)")
    with pytest.raises(ValueError) as raised:
        unbuilt(RLOO, loss={"loss_aggregation": "constant"})
    assert str(raised.value) == ("loss.loss_aggregation: LossSettings has no such field (its fields: aggregation, "
                                 "mask_truncated_completions, ent_coef, ptx_coef)")


def test_episodes_asynchronous_and_loss_are_kept_typed_and_saved_plain():
    """A dict of some fields, or the dataclass itself: kept typed on the module (``episodes``, ``asynchronous``,
    ``loss_settings``: ``loss`` is the module's loss method), saved plain in the hyper-parameters; the episodes'
    environment is code, named by the config, so only their bounds are saved, and the policy's turn loop reads them."""
    grpo = unbuilt(GRPO, episodes={"environment": Feedback, "max_turns": 3}, loss={"aggregation": "constant"},
                   asynchronous={"rollout_timeout": 60.0})
    assert grpo.episodes == Episodes(environment=Feedback, max_turns=3)
    assert grpo.episodes.environment is Feedback and grpo.episodes.max_tokens is None
    assert grpo.hparams["episodes"] == {"max_turns": 3, "max_tokens": None}  # the bounds, not the environment
    assert "environment" not in grpo.hparams
    assert grpo.loss_settings == LossSettings(aggregation="constant") and callable(grpo.loss)
    assert grpo.hparams["loss"] == {"aggregation": "constant", "mask_truncated_completions": False, "ent_coef": 0.0,
                                    "ptx_coef": 0.0}
    assert grpo.asynchronous == Asynchronous(rollout_timeout=60.0)
    assert grpo.hparams["asynchronous"] == {"max_staleness": 0, "rollout_timeout": 60.0}
    assert grpo.policy.episodes is grpo.episodes  # the one place the environment is set: the policy's turns read it

    given = Episodes(environment=Feedback, max_turns=2, max_tokens=30)
    ppo = unbuilt(PPO, episodes=given, loss=LossSettings(ent_coef=0.01), asynchronous=Asynchronous())
    assert ppo.episodes is given and ppo.hparams["episodes"] == {"max_turns": 2, "max_tokens": 30}
    assert ppo.loss_settings.ent_coef == 0.01 and ppo.hparams["loss"]["ent_coef"] == 0.01
    single = unbuilt(OnlineDPO)  # single-turn: the defaults, saved too; no loss group
    assert single.episodes == Episodes() and single.episodes.environment is None
    assert single.hparams["episodes"] == {"max_turns": 4, "max_tokens": None} and "loss" not in single.hparams
    assert single.hparams["asynchronous"] == {"max_staleness": 0, "rollout_timeout": 1800.0}


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
    (lambda: GAE(gamma=1.5), "advantages.gamma must lie in [0.0, 1.0], got 1.5"),
    (lambda: GAE(lam=-0.1), "advantages.lam must lie in [0.0, 1.0], got -0.1"),
    (lambda: GroupRelative(std_eps=-1e-4), "advantages.std_eps must be >= 0, got -0.0001"),
    (lambda: GroupRelative(scale_rewards="mean"), "advantages.scale_rewards must be one of group, batch, none, got 'mean'"),
    (lambda: WhitenedReturns(gamma=2.0), "advantages.gamma must lie in [0.0, 1.0], got 2.0"),
    (lambda: WhitenedReturns(baseline="mean"), "advantages.baseline must be one of none, group, got 'mean'"),
])
def test_bad_model_specs_policy_losses_and_advantage_estimators_fail_when_checked_or_used(make, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make()


def test_a_policy_loss_that_is_not_one_is_refused_before_the_model_loads():
    with pytest.raises(TypeError, match=r"^policy_loss must be a PolicyLoss \(one of Clip, CISPO"):
        PPO(base=MISSING, reward=REWARD, policy_loss="cispo")


def test_an_advantage_estimator_that_is_not_one_is_refused_before_the_model_loads():
    with pytest.raises(TypeError, match=r"^advantages must be a AdvantageEstimator \(one of GAE, GroupRelative, "):
        GRPO(base=MISSING, reward=REWARD, advantages="gae")


def test_a_preference_loss_that_is_not_one_is_refused_before_the_model_loads():
    with pytest.raises(TypeError, match=r"^preference_loss must be a PreferenceLoss \(one of Sigmoid, Robust, IPO"):
        DPO(base=MISSING, preference_loss="ipo")


def test_a_rollout_that_does_not_split_fails_at_setup(tiny_model_dir, reward_dir):
    module = GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=AdapterReward(str(reward_dir)),
                  policy_lora=LORA, samples_per_prompt=2, update={"num_minibatches": 4}, sampling={"max_new_tokens": 4})
    data = PromptDataModule(synthetic_rows=12, batch_size=3, val_fraction=0.0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    with pytest.raises(ValueError, match=re.escape(
            "the rollout batch of 6 responses (data.init_args.batch_size=3 prompts x samples_per_prompt=2) must "
            "split into update.num_minibatches=4 minibatches of update.gradient_accumulation=1 equal micro-batches")):
        trainer.fit(module, datamodule=data)
    assert module.last_samples is None  # no rollout was sampled
