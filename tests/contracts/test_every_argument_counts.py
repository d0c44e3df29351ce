"""No argument is silently ignored: every argument of every module (the on-policy family, DPO, KTO, SFT, the reward
model, the process reward model: every LightningModule the package exports), set to a value other than its default, changes what the module does, or is refused in one line.

Each argument has a row in :data:`CASES`: the value, the setting it needs to matter in (a KL coefficient for the KL
estimator, a rollout correction for its bounds, a moved policy for the clip ranges, an environment for the episode
bounds) and what shows the change: the rollout and its loss terms (``rollout``), one iteration or step of training
and, for the offline stages, one validation batch with its samples (``fit``: the trained weights, the logged
metrics, the KL coefficient, the files written, the phases run), or a named observation for
the settings that by design change no number (which engine samples, how many micro-batches, how many backward
passes). A module argument without a row fails the test: a new argument must say how it takes effect. A typed
group (``sampling``, ``kl``, ``optimizer``, ``critic``, ``correction``, ``reward_shaping``, ``update``,
``episodes``, ``asynchronous``, ``loss``) has a row per field, each set alone (``kl.coef``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import rlhf_lightning as rl
from rlhf_lightning.algorithms.advantage_estimators import GAE, GroupRelative, LeaveOneOut, WhitenedReturns
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.algorithms.policy_losses import CISPO, Clip
from rlhf_lightning.algorithms.preference_losses import IPO, Sigmoid, SimPO
from rlhf_lightning.cli.errors import accepted_arguments
from rlhf_lightning.core.held_out_pass_at_k import PassAtK
from rlhf_lightning.environments import Environment, Step, ToolEnvironment
from rlhf_lightning.models.fingerprint import BASE_RECORD
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rollout.engines import Generate
from rlhf_lightning.rollout.settings import Sampling
from rlhf_lightning.tasks.calculator import correct_answer
from rlhf_lightning.tasks.synthetic import gold_rewards
from rlhf_lightning.utils.checks import GROUP_CLASSES
from rlhf_lightning.utils.optim import OptimizerSettings
from rlhf_lightning.utils.timing import record_phases
from tests.helpers.models import LORA, built, make_likely, with_random_adapter
from tests.helpers.modules import GROUPS, merged

ONLINE = [rl.GRPO, rl.RLOO, rl.REINFORCEPlusPlus, rl.PPO, rl.OnPolicyDistillation, rl.OnlineDPO]
OFFLINE = [rl.DPO, rl.KTO, rl.SFT, rl.RewardModel, rl.ProcessRewardModel]
MODULES = ONLINE + OFFLINE
# Documented as taking effect only where a single process cannot show it; the named test shows it there.
ELSEWHERE = {
    "sharded_rollout": "only under FSDP2 (ignored without sharding, as documented): tests/contracts/test_distributed_equivalence.py runs "
                       "GRPO with per_layer and checks it equals one process",
    "asynchronous.rollout_timeout": (
        "only with asynchronous.max_staleness > 0, which needs vLLM's server: tests/rollout/test_async_training.py::"
        "test_a_stuck_server_and_a_draw_from_a_version_it_does_not_hold_are_one_line times a wait out"),
    "export_format": "only in the files of the export: tests/rewards/test_judge.py::"
                     "test_the_sft_stage_exports_a_judge_adapter_for_the_same_base reads the adapter it writes",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """An argument's non-default ``value``, the ``setting`` (other arguments, and flags: ``perturb`` the adapters
    before the rollout, ``moved``: after it, ``stale`` sampler log-probs, a ``ptx`` batch, ``calculator`` prompts,
    ``groups`` of 2 responses per prompt)
    it needs, and what shows its effect."""

    value: Any
    setting: tuple[tuple[str, Any], ...] = ()
    shows: str = "rollout"  # rollout | fit | refused | the name of an OBSERVATIONS entry


def case(value: Any, shows: str = "rollout", **setting: Any) -> Case:
    return Case(value, tuple(setting.items()), shows)


class Feedback(Environment):
    """Answers every turn and never ends an episode: only ``episodes.max_turns`` and ``episodes.max_tokens`` do."""

    def step(self, messages):
        return Step([{"role": "user", "content": "try again"}], reward=0.25)


KL = {"kl": {"coef": 0.5}, "perturb": True}
MOVED = {"moved": True, "perturb": True, "update": {"epochs": 2}}  # the update's policy is not the sampler's: ratios away from 1
EPISODES = {"calculator": True, "episodes": {"environment": Feedback}}
CASES: dict[str, Case] = {
    # the policy, its sampling and its base
    "base": case("other base"),
    "policy_lora": case(LoraSpec(r=2, alpha=8), "fit"),
    "sampling.max_new_tokens": case(3),
    "sampling.temperature": case(0.7),
    "sampling.top_k": case(5, "refused"),
    "sampling.top_p": case(0.9, "refused"),
    "sampling.kv_cache": case("dynamic", "engine"),
    "engine": case(Generate(), "engine"),
    "sampling.stop_token": case(None),
    "logprob_chunk": case(2, "saved_for_backward"),
    "seed": case(1, "fit"),
    "seed_scope": case("prompt"),
    "gold_reward": case(gold_rewards),
    "export_dir": case("adapters", "fit"),
    "pass_at_k": case(PassAtK(samples=2), "validation", gold_reward=gold_rewards),
    # collection
    "reward": case(rl.FunctionReward(gold_rewards)),
    "reward_shaping.weights": case([2.0]),
    "samples_per_prompt": case(4),
    "reward_shaping.missing_eos_penalty": case(1.0),
    "reward_shaping.normalize": case(True),
    "reward_shaping.clip": case(0.01),
    "episodes.environment": case(lambda: ToolEnvironment(["rlhf_lightning.tasks.calculator.add"]), calculator=True),
    "episodes.max_turns": case(2, **EPISODES),
    "episodes.max_tokens": case(12, **EPISODES),
    "share_prompt": case(False, "decoded_tokens", groups=True),  # the same numbers, each prompt read twice
    # the loop's update
    "update.epochs": case(2, "fit"),
    "update.num_minibatches": case(2, "fit"),
    "update.gradient_accumulation": case(2, "micro_batches"),
    "update.micro_batch_tokens": case(8, "micro_batches"),  # every row (or pair) is longer: a micro-batch each
    "update.target_kl": case(1e-9, "fit", update={"epochs": 2}),
    "update.max_grad_norm": case(1e-4, "fit"),
    "optimizer.lr": case(1e-2, "fit"),
    "optimizer.adam_eps": case(0.1, "fit"),
    "optimizer.weight_decay": case(0.5, "fit"),
    "optimizer.warmup": case(1, "fit"),
    "optimizer.schedule": case("linear", "fit"),
    "optimizer.nonfinite": case("skip", "nonfinite"),
    # the policy-gradient loss, its KL penalty and corrections
    "policy_loss": case(CISPO(max_weight=1.01), **MOVED),
    "policy_loss.clip_range": case(Clip(clip_range=0.01), **MOVED),
    "policy_loss.clip_range_high": case(Clip(clip_range_high=0.5), **MOVED),
    "policy_loss.ratio_level": case(Clip(ratio_level="sequence"), **MOVED),
    "policy_loss.max_weight": case(CISPO(max_weight=1.01), **MOVED, policy_loss=CISPO()),
    "policy_loss.min_weight": case(CISPO(min_weight=0.99), **MOVED, policy_loss=CISPO()),
    "loss.aggregation": case("sequence_mean"),
    "loss.mask_truncated_completions": case(True),
    "kl.coef": case(0.5, perturb=True),
    "kl.estimator": case("k2", **KL),
    "kl.clamp": case(1e-3, **KL),
    "kl.added_to": case("swap", **KL),
    "kl.ratio_weighting": case(False, **{**KL, **MOVED, "kl": {"coef": 0.5, "added_to": "loss"}}),
    "kl.target": case(1.0, "fit", kl={"coef": 0.1}, perturb=True),
    "kl.horizon": case(100, "fit", kl={"coef": 0.1, "target": 1.0}, perturb=True),
    "loss.ent_coef": case(0.1),
    "loss.ptx_coef": case(0.5, ptx=True),
    "correction.mode": case("token_truncate", stale=True),
    "policy_loss.clip_against": case(Clip(clip_against="sampler"), stale=True),  # the ratio against the sampler's
    # refused by the default engine; VLLMServer's runs: tests/rollout/test_async_training.py
    "asynchronous.max_staleness": case(1, "refused"),
    "correction.min_weight": case(2.0, stale=True, correction={"mode": "token_truncate"}),
    "correction.max_weight": case(1.1, stale=True, correction={"mode": "token_truncate"}),
    # the algorithms' own; an advantage estimator's fields, each on the estimator a module takes by default
    "advantages.GroupRelative.scale_rewards": case(GroupRelative(scale_rewards="none")),
    "advantages.GroupRelative.std_eps": case(GroupRelative(std_eps=0.5)),
    "advantages.LeaveOneOut.whiten_advantages": case(LeaveOneOut(whiten_advantages=True)),
    "advantages.WhitenedReturns.baseline": case(WhitenedReturns(baseline="group"), samples_per_prompt=2),
    "advantages.WhitenedReturns.gamma": case(WhitenedReturns(gamma=0.5)),
    "advantages.GAE.gamma": case(GAE(gamma=0.5)),
    "advantages.GAE.lam": case(GAE(lam=0.5)),
    "advantages.GAE.whiten_rewards": case(GAE(whiten_rewards=True)),
    "advantages.GAE.whiten_advantages": case(GAE(whiten_advantages=False)),
    "critic.lora": case(LoraSpec(r=2, alpha=8), "fit"),
    "critic.from_reward": case(True),
    "critic.clip_range_value": case(0.01, **MOVED),
    "critic.vf_coef": case(0.5),
    "critic.lr": case(1e-2, "fit"),
    "critic.backward": case("joint", "backward_passes"),
    "teacher": case("other teacher"),
    "teacher_dtype": case("bfloat16", teacher="model"),
    "reward_coef": case(0.5),
    "beta": case(0.5, perturb=True),
    "preference_loss": case(IPO(), perturb=True),
    "preference_loss.label_smoothing": case(Sigmoid(label_smoothing=0.2), perturb=True),
    "preference_loss.gamma": case(SimPO(gamma=1.0), perturb=True, preference_loss=SimPO()),
}


# The offline stages sample only to evaluate: what their sampling arguments change shows in a validation batch, and
# every other argument in a training step.
OFFLINE_CASES: dict[str, Case] = {
    **{name: dataclasses.replace(CASES[name], shows="fit") for name in (
        "sampling.max_new_tokens", "sampling.temperature", "sampling.stop_token", "seed", "seed_scope", "gold_reward",
        "base", "policy_lora", "export_dir", "optimizer.weight_decay", "optimizer.adam_eps")},
    "pass_at_k": dataclasses.replace(CASES["pass_at_k"], shows="fit"),
    "optimizer.nonfinite": CASES["optimizer.nonfinite"], "sampling.kv_cache": CASES["sampling.kv_cache"],
    "engine": CASES["engine"], "logprob_chunk": CASES["logprob_chunk"],
    "sampling.top_k": case(5, "fit"),
    "sampling.top_p": case(0.5, "fit"),
    "lora": case("swap lora", "fit"),
    "optimizer.lr": case(1e-2, "fit"),
    "optimizer.warmup": case(1, "fit"),
    "optimizer.schedule": case("swap schedule", "fit"),
    "beta": case(0.5, "fit"),
    "loss_type": case("swap loss", "fit", perturb=True),  # KTO's losses part once its reference point is not 0
    "preference_loss": case(IPO(), "fit"),
    "preference_loss.label_smoothing": case(Sigmoid(label_smoothing=0.2), "fit"),
    "preference_loss.gamma": case(SimPO(gamma=1.0), "fit", preference_loss=SimPO()),
    "rpo_alpha": case(0.5, "fit"),
    "precompute_reference": case(True, "fit"),
    "sample_eval_batches": case(0, "fit"),
    "desirable_weight": case(2.0, "fit"),
    "undesirable_weight": case(2.0, "fit"),
    "center_coef": case(0.5, "fit"),
    "members": case(2, "fit"),  # two reward adapters and heads trained, each from its own initialisation
    "member_data": case("partition", "fit", members=2),  # each pair trains one member, not a Poisson count of each
    "separator": case("add", "fit"),  # the PRM's steps end at another token: other labels, another loss
}
# the other choice than the module's default
SWAPS: dict[str, Callable[[Any], Any]] = {
    "swap": lambda default: {"reward": "loss", "loss": "reward", True: False, False: True}[default],
    "swap lora": lambda default: LoraSpec(r=4, alpha=8) if default is None else LoraSpec(r=2, alpha=8),
    "swap schedule": lambda default: "linear" if default == "constant" else "constant",
    "swap loss": lambda default: {"kto": "apo_zero_unpaired"}[default],
}


# ---- running a module ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_model_dir, reward_dir, calculator_model_dir, tiny_arithmetic_dir, tmp_path_factory) -> dict[str, Path]:
    """The base (the tiny GPT-2 with its EOS made likely, so that responses stop at varied lengths), a second base, the
    reward adapter, a second adapter (another teacher), the calculator's model and the arithmetic task's two bases
    (the process reward model's: its steps end at a token of that tokenizer)."""
    from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer

    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    folders = {}
    for name, seed in (("base", None), ("other base", 7)):
        model = load_causal_lm(spec, tokenizer)
        with torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
                for parameter in model.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))
            make_likely(model, tokenizer.eos_token_id, 2.0, len(tokenizer), 12)  # about half stop in 6 tokens
        folders[name] = tmp_path_factory.mktemp(name.replace(" ", "-"))
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    base, _ = with_random_adapter(tiny_model_dir, "teacher", seed=8)
    teacher = base.save_adapter("teacher", tmp_path_factory.mktemp("teacher"))

    def unrecorded(adapter: Path) -> Path:
        """A copy of ``adapter`` without the record of its base's weights: these adapters were trained on the tiny
        base and serve the bases above on purpose (as an older export, they get the path check only)."""
        copy = tmp_path_factory.mktemp(f"unrecorded-{adapter.name}") / adapter.name
        shutil.copytree(adapter, copy)
        (copy / BASE_RECORD).unlink(missing_ok=True)
        return copy

    arithmetic = load_causal_lm(BaseModelSpec(name_or_path=str(tiny_arithmetic_dir)),
                                load_tokenizer(BaseModelSpec(name_or_path=str(tiny_arithmetic_dir))))
    torch.manual_seed(7)
    with torch.no_grad():
        for parameter in arithmetic.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    folders["other arithmetic"] = tmp_path_factory.mktemp("other-arithmetic")
    arithmetic.save_pretrained(folders["other arithmetic"])
    load_tokenizer(BaseModelSpec(name_or_path=str(tiny_arithmetic_dir))).save_pretrained(folders["other arithmetic"])
    reward = unrecorded(reward_dir)
    return {**folders, "reward": reward, "teacher": reward, "other teacher": unrecorded(teacher),
            "calculator": calculator_model_dir, "arithmetic": tiny_arithmetic_dir}


def arguments(cls: type, models: dict[str, Path], setting: dict[str, Any]) -> dict[str, Any]:
    """The module's constructor arguments: small defaults for a fast run, then the ``setting``'s."""
    calculator = setting.get("calculator", False)
    base = "arithmetic" if cls is rl.ProcessRewardModel else "calculator" if calculator else "base"
    kwargs: dict[str, Any] = {"base": BaseModelSpec(name_or_path=str(models[base])), "optimizer": {"lr": 1e-3}}
    if cls is rl.ProcessRewardModel:
        kwargs |= {"lora": LORA, "separator": ","}
    elif cls in (rl.DPO, rl.KTO):
        kwargs |= {"policy_lora": LORA, "sampling": {"max_new_tokens": 6}}
    elif cls is rl.RewardModel:
        kwargs |= {"lora": LORA}
    elif cls is not rl.SFT:
        kwargs |= {"reward": rl.FunctionReward(correct_answer) if calculator else rl.AdapterReward(str(models["reward"])),
                   "policy_lora": LORA, "sampling": {"max_new_tokens": 6}}
    if cls in (rl.GRPO, rl.RLOO) or (setting.get("groups") and cls is not rl.OnlineDPO):  # online DPO: pairs anyway
        kwargs["samples_per_prompt"] = 2
    if cls is rl.PPO:
        kwargs |= {"critic": {"lora": LORA}, "update": {"epochs": 1}}
    if cls is rl.OnPolicyDistillation:
        kwargs["teacher"] = str(models["teacher"])
    for name, value in setting.items():
        if name in ("perturb", "moved", "stale", "ptx", "calculator", "groups"):
            continue
        if name == "teacher" and value == "model":
            value = str(models["base"])
        kwargs = merged(kwargs, {name: value})
    return kwargs


def prompt_data(module, calculator: bool) -> rl.PromptDataModule:
    """The stage's data: 4 prompts for the on-policy family; 4 training and 4 held-out examples otherwise."""
    if isinstance(module, rl.ProcessRewardModel):
        data = rl.StepwiseDataModule(dataset="arithmetic", synthetic_rows=8, batch_size=4, val_fraction=0.5)
        data.tokenizer, data.separator = module.tokenizer, module.separator
        data.setup("fit")
        return data
    offline = {rl.DPO: rl.PreferenceDataModule, rl.RewardModel: rl.PreferenceDataModule, rl.KTO: rl.UnpairedPreferenceDataModule,
               rl.SFT: rl.SFTDataModule}.get(type(module))
    if offline is not None:
        data = offline(synthetic_rows=8, batch_size=4, val_fraction=0.5, max_length=64)
        data.tokenizer = module.tokenizer
        data.setup("fit")
        return data
    data = rl.PromptDataModule(dataset="calculator" if calculator else "synthetic", synthetic_rows=4, batch_size=4,
                            val_fraction=0.0)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    return data


def perturb(module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.model.model.named_parameters():
            if "lora_B" in name and (".policy." in name or ".critic." in name):
                parameter.normal_(0, 0.3)


def rollout_values(module, setting: dict[str, Any]) -> dict[str, float]:
    """The statistics and loss terms of one rollout (every value a float); for an offline stage, the loss terms of
    one training batch."""
    if type(module) in OFFLINE:
        loss, values = module.batch_losses(next(iter(prompt_data(module, False).train_dataloader())), "train")
        return {"loss": float(loss), **{name: float(value.float().sum()) for name, value in values.items()}}
    if setting.get("perturb"):
        perturb(module, 1)
    data = prompt_data(module, setting.get("calculator", False))
    torch.manual_seed(0)
    experience, stats = module.collect_and_prepare(next(iter(data.train_dataloader()["prompts"])))
    if setting.get("moved"):
        perturb(module, 2)  # the policy moves after sampling: ratios away from 1
    if setting.get("stale"):  # a sampler whose log-probs disagree with the trainer's
        experience = dataclasses.replace(experience, sampler_logprobs=experience.sampler_logprobs - 0.5)
    ptx = None
    if setting.get("ptx"):
        ptx_data = rl.PromptDataModule(synthetic_rows=4, batch_size=4, val_fraction=0.0, ptx_dataset="synthetic",
                                    ptx_batch_size=2)
        ptx_data.tokenizer = module.tokenizer
        ptx_data.setup("fit")
        ptx = next(iter(ptx_data.train_dataloader()["ptx"]))
    values = {**stats, **module.losses(experience, ptx)}
    if experience.advantages is not None:
        values["advantages"] = experience.advantages.float().abs().sum()
    values["sequences"] = experience.input_ids.float().sum()
    values["scores"] = experience.scores.sum()
    return {name: float(value) for name, value in values.items()}


def fit_values(module, setting: dict[str, Any], directory: Path) -> dict[str, Any]:
    """One iteration of training: the trained weights, the logged metrics, the KL coefficient, the files written,
    and how many times each phase ran."""
    if setting.get("perturb"):
        perturb(module, 1)
    phases: Counter = Counter()
    offline = type(module) in OFFLINE  # with a validation batch: what the offline stages sample shows there
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=int(offline), logger=False,
                        num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=directory)
    torch.manual_seed(0)
    with record_phases(lambda name, seconds: phases.update([name])):
        trainer.fit(module, datamodule=prompt_data(module, setting.get("calculator", False)))
    trained = {name: round(float(p.detach().double().abs().sum()), 12) for name, p in module.named_parameters()
               if p.requires_grad}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if not TIMING.search(k)}
    return {"weights": trained, "metrics": metrics,
            "kl_coef": getattr(getattr(module, "kl_controller", None), "value", None), "phases": dict(phases),
            "learning_rates": [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups],
            "files": sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())}


TIMING = re.compile(r"/(time|throughput)/")  # seconds differ from run to run: never evidence of an argument


def engine(module, setting: dict[str, Any]) -> str:
    return type(module.policy.sampler.engine(module.model)).__name__


def saved_for_backward(module, setting: dict[str, Any]) -> int:
    """Elements the loss of one rollout keeps for its backward pass (``logprob_chunk`` recomputes each chunk's
    logits in the backward instead of keeping them)."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        rollout_values(module, setting)
    return sum(saved)


def decoded_tokens(module, setting: dict[str, Any]) -> int:
    """Token positions the base's decoder reads in one rollout and its loss (``share_prompt`` reads a group's prompt
    once)."""
    calls = []
    embedding = module.model.hf_model.get_input_embeddings()
    handle = embedding.register_forward_hook(lambda _module, args, _output: calls.append(args[0].numel()))
    try:
        rollout_values(module, setting)
    finally:
        handle.remove()
    return sum(calls)


def nonfinite(module, setting: dict[str, Any]) -> str:
    """What a non-finite gradient does before an optimizer step: the run stops, or the step is skipped."""
    for parameter in module.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.full_like(parameter, float("nan"))
            break
    try:
        return f"step taken: {module.guard_step('test')}, skipped {module.skipped_steps}"
    except FloatingPointError as error:
        return f"stopped: {type(error).__name__}"


def validation(module, setting: dict[str, Any], directory: Path) -> dict[str, float]:
    """The metrics of one validation batch of 4 held-out prompts (the on-policy family's fits validate nothing)."""
    data = rl.PromptDataModule(synthetic_rows=8, batch_size=4, val_fraction=0.5)
    data.tokenizer = module.tokenizer
    data.setup("fit")
    trainer = L.Trainer(limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=directory)
    trainer.validate(module, datamodule=data)
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


OBSERVATIONS: dict[str, Callable[..., Any]] = {
    "engine": engine, "saved_for_backward": saved_for_backward, "nonfinite": nonfinite, "decoded_tokens": decoded_tokens,
    "micro_batches": lambda module, setting, directory: fit_values(module, setting, directory)["phases"],
    "backward_passes": lambda module, setting, directory: fit_values(module, setting, directory)["phases"],
    "validation": validation,
}


BASELINES: dict[tuple, Any] = {}  # what a module shows in a setting, before the argument is set: computed once


def observe(cls: type, shows: str, models: dict[str, Path], setting: dict[str, Any], directory: Path,
            baseline: bool = False) -> Any:
    key = (cls, shows, tuple(sorted((name, repr(value)) for name, value in setting.items())))
    if baseline and key in BASELINES:
        return BASELINES[key]
    result = observe_once(cls, shows, models, setting, directory)
    if baseline:
        BASELINES[key] = result
    return result


def observe_once(cls: type, shows: str, models: dict[str, Path], setting: dict[str, Any], directory: Path) -> Any:
    torch.manual_seed(0)  # the adapters' and heads' initial weights: the same in every observation
    module = built(cls(**arguments(cls, models, setting)))
    if shows == "rollout":
        return rollout_values(module, setting)
    if shows == "fit":
        return fit_values(module, setting, directory)
    observation = OBSERVATIONS[shows]
    return observation(module, setting, directory) if shows in ("micro_batches", "backward_passes", "validation") \
        else observation(module, setting)


# Each typed group's class: its fields are rows of their own (``episodes.max_turns``).
GROUP_TYPES = {"sampling": Sampling, "kl": KLPenalty, "optimizer": OptimizerSettings, "critic": rl.Critic,
               "correction": rl.RolloutCorrection, "reward_shaping": rl.RewardShaping, "update": rl.UpdateSettings,
               "episodes": rl.Episodes, "asynchronous": rl.Asynchronous, "loss": rl.LossSettings}


def cases() -> list[tuple[type, str]]:
    """Every argument of every module; a typed group's (``sampling``, ``kl``, ``optimizer``, ``critic``,
    ``correction``, ``reward_shaping``, ``update``, ``episodes``, ``asynchronous``, ``loss``) field by field."""
    groups = GROUP_TYPES
    found = []
    for cls in MODULES:
        for name in accepted_arguments(f"{cls.__module__}.{cls.__qualname__}"):
            if name in groups:
                found += [(cls, f"{name}.{field.name}") for field in dataclasses.fields(groups[name])]
                continue
            if name == "advantages":  # each field of the module's own estimator
                estimator = type(inspect.signature(cls).parameters[name].default).__name__
                found += [(cls, key) for key in CASES if key.startswith(f"advantages.{estimator}.")]
                continue
            found.append((cls, name))
            if name in ("policy_loss", "preference_loss"):  # each field of the registered loss too
                found += [(cls, key) for key in CASES if key.startswith(f"{name}.")]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("cls, name", cases(), ids=lambda item: getattr(item, "__name__", item))
def test_every_argument_changes_the_run_or_is_refused(cls, name, models, tmp_path):
    if name in ELSEWHERE:
        print(f"{cls.__name__}.{name}: {ELSEWHERE[name]}")
        return
    table = OFFLINE_CASES if cls in OFFLINE else CASES
    assert name in table, f"{cls.__name__}.{name} has no row in its table: say how the argument takes effect"
    row = table[name]
    setting = dict(row.setting)
    argument, _, field = name.partition(".")
    value = row.value
    if isinstance(value, str) and value.startswith("swap"):
        saved = cls(**arguments(cls, models, setting)).hparams.get(argument)
        value = SWAPS[value](saved[field] if argument in GROUPS else saved)
    elif value in ("other base", "other teacher"):
        value = "other arithmetic" if cls is rl.ProcessRewardModel and value == "other base" else value
        value = BaseModelSpec(name_or_path=str(models[value])) if argument == "base" else str(models[value])
    # a group's field is set alone (the group's other fields keep theirs); policy_loss.* and preference_loss.* rows
    # give the whole loss
    changed = merged(setting, {argument: {field: value} if argument in GROUPS else value})
    if row.shows == "refused":
        with pytest.raises(ValueError) as refusal:
            cls(**arguments(cls, models, changed))
        assert "\n" not in str(refusal.value) and (field or argument) in str(refusal.value)
        return
    before = observe(cls, row.shows, models, setting, tmp_path / "before", baseline=True)
    after = observe(cls, row.shows, models, changed, tmp_path / "after")
    print(f"{cls.__name__}.{name}={value!r}: {row.shows} differs")
    assert before != after, f"{cls.__name__}.{name}={value!r} changed nothing ({row.shows}: {before})"


def test_every_typed_group_is_taken_field_by_field():
    """A group the modules take (``rlhf_lightning.utils.checks.GROUP_CLASSES``) without its class here would be one
    row for the whole group, and its fields would go unchecked; the flat names the groups replaced are no
    arguments any more."""
    assert {name: cls.__name__ for name, cls in GROUP_TYPES.items()} == dict(GROUP_CLASSES)
    found = set(cases())
    moved = {"episodes": ("environment", "max_turns", "max_tokens"), "asynchronous": ("max_staleness", "rollout_timeout"),
             "loss": ("aggregation", "mask_truncated_completions", "ent_coef", "ptx_coef")}
    for cls in ONLINE:
        for group, fields in moved.items():
            taken = cls is not rl.OnlineDPO or group != "loss"  # online DPO's loss is its preference loss
            for field in fields:
                key = f"{group}.{field}"
                assert ((cls, key) in found) == taken, (cls.__name__, key)
                assert key in CASES or key in ELSEWHERE, key
    flat = {"environment", "max_turns", "max_episode_tokens", "max_staleness", "rollout_timeout", "loss_aggregation",
            "mask_truncated_completions", "ent_coef", "ptx_coef"}
    assert not [(cls.__name__, name) for cls, name in found if name in flat]
    assert not flat & set(CASES)


def test_every_module_the_package_exports_is_in_the_table():
    exported = {value for value in vars(rl).values() if isinstance(value, type) and issubclass(value, L.LightningModule)}
    assert exported == set(MODULES), f"modules without rows: {exported - set(MODULES)}"


@pytest.mark.parametrize("cls, shows", [(rl.GRPO, "rollout"), (rl.PPO, "fit"), (rl.DPO, "fit")],
                         ids=lambda item: getattr(item, "__name__", item))
def test_what_is_observed_repeats_exactly_when_no_argument_changes(cls, shows, models, tmp_path):
    """The premise of every case above: two runs with the same arguments show the same thing, so a difference is
    the argument's."""
    assert observe_once(cls, shows, models, {}, tmp_path / "first") == observe_once(cls, shows, models, {},
                                                                                    tmp_path / "second")
