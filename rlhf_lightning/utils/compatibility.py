"""Every old name the package still answers, in one module that goes in :data:`REMOVED_IN`.

Five tables, each read where the name is met: :data:`MOVED_MODULES` (a module path before it moved: imports, a
config's ``class_path``, a checkpoint's class), :data:`MOVED_ARGUMENTS` and :data:`MOVED_INTO_GROUPS` (a module
argument before it became a field of a group: the constructors and the command line's one-line errors), and
:data:`RENAMED_HOOKS` and :data:`RENAMED_ENGINE_METHODS` (a member the on-policy loop or an engine had before it was
renamed: a subclass that defines one).
``tests/utils/test_compatibility.py`` fails once the package's version reaches :data:`REMOVED_IN`: this module and
the lines that import it are then deleted, and an old name gets the error any unknown name gets.

The import hook. ``import rlhf_lightning.ppo`` (and jsonargparse reading ``class_path: rlhf_lightning.ppo.PPO``, and
``torch.load`` of a checkpoint that names that class) asks Python's finders on ``sys.meta_path`` for the submodule;
Python never asks the parent package (a module ``__getattr__`` answers ``rlhf_lightning.ppo`` as an attribute, not
an import), and a stub file per old name would be 27 files to delete. So :func:`install_old_names` appends one
finder when the package is imported, the last moment before an old path can be: it comes after Python's own
finders (it sees only the imports they failed), answers only the names of :data:`MOVED_MODULES` (and of the modules inside
a moved package) and gives the module now at the new place -- the same object, so classes, checkpoints and pickles
keep working -- with a ``FutureWarning`` naming that place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Iterable
from types import ModuleType

from rlhf_lightning.utils.checks import GROUP_CLASSES

# The release that deletes this module (and the test that says so once the package's version reaches it): the
# names below were kept for one release after the one that renamed them.
REMOVED_IN = "0.3.0"

_STAGES = ("ppo", "grpo", "rloo", "reinforce_pp", "distill", "online_dpo", "dpo", "kto", "sft", "reward_model")

# An old module (or package) -> where it is now: the layer-table release moved the package root's modules into
# stages/, cli/, runs/ and utils/ (older entries first); configs, checkpoints and users' code name the old paths.
MOVED_MODULES: dict[str, str] = {
    "rlhf_lightning.episodes": "rlhf_lightning.environments",
    "rlhf_lightning.tasks.reasoning_gym": "rlhf_lightning.tasks.reasoning_gym_rows",
    "rlhf_lightning.data.reasoning_gym": "rlhf_lightning.data.reasoning_gym_data",
    "rlhf_lightning.rewards.reasoning_gym": "rlhf_lightning.rewards.reasoning_gym_reward",
    **{f"rlhf_lightning.{name}": f"rlhf_lightning.stages.{name}" for name in _STAGES},
    "rlhf_lightning.prm": "rlhf_lightning.stages.process_reward_model",
    "rlhf_lightning.errors": "rlhf_lightning.cli.errors",
    "rlhf_lightning.quiet": "rlhf_lightning.cli.quiet",
    "rlhf_lightning.rank_failures": "rlhf_lightning.cli.rank_failures",
    "rlhf_lightning.loggers": "rlhf_lightning.cli.loggers",
    "rlhf_lightning.model_card": "rlhf_lightning.cli.model_card",
    "rlhf_lightning.merge": "rlhf_lightning.cli.merge_command",
    "rlhf_lightning.run_folder": "rlhf_lightning.runs.run_folder",
    "rlhf_lightning.resume": "rlhf_lightning.runs.resume",
    "rlhf_lightning.wandb_offline": "rlhf_lightning.runs.wandb_offline",
    "rlhf_lightning.plots": "rlhf_lightning.runs.plots",
    "rlhf_lightning.metrics": "rlhf_lightning.utils.metrics",
    "rlhf_lightning.optim": "rlhf_lightning.utils.optim",
    "rlhf_lightning.timing": "rlhf_lightning.utils.timing",
    "rlhf_lightning.core.pass_at_k": "rlhf_lightning.core.held_out_pass_at_k",
    "rlhf_lightning.rewards.process": "rlhf_lightning.rewards.process_reward",
}

# Module arguments that became fields of a typed group (``sampling``, ``kl``, ``optimizer``, ``correction``,
# ``reward_shaping``, ``update``, ``episodes``, ``asynchronous``, ``loss``, PPO's ``critic``): the old flat names are
# refused in one line naming the new key, in a config file, on the command line and by the constructors.
MOVED_ARGUMENTS = {
    **{name: f"sampling.{name}" for name in ("max_new_tokens", "temperature", "top_k", "top_p", "kv_cache",
                                            "stop_token")},
    **{f"kl_{name}": f"kl.{name}" for name in ("coef", "estimator", "clamp", "ratio_weighting", "target",
                                              "horizon")},
    "kl_in": "kl.added_to",
    "policy_lr": "optimizer.lr", "lr": "optimizer.lr", "warmup_steps": "optimizer.warmup",
    "warmup_iterations": "optimizer.warmup", "lr_schedule": "optimizer.schedule",
    **{name: f"optimizer.{name}" for name in ("weight_decay", "adam_eps", "nonfinite")},
    "critic_lora": "critic.lora", "critic_from_reward": "critic.from_reward", "critic_lr": "critic.lr",
    **{name: f"critic.{name}" for name in ("vf_coef", "clip_range_value", "backward")},
    "rollout_correction": "correction.mode", "rollout_correction_min": "correction.min_weight",
    "rollout_correction_max": "correction.max_weight",
    "reward_weights": "reward_shaping.weights", "reward_normalize": "reward_shaping.normalize",
    "missing_eos_penalty": "reward_shaping.missing_eos_penalty", "reward_clip": "reward_shaping.clip",
    **{name: f"update.{name}" for name in ("epochs", "num_minibatches", "gradient_accumulation", "micro_batch_tokens",
                                          "target_kl", "max_grad_norm")},
    "environment": "episodes.environment", "max_turns": "episodes.max_turns",
    "max_episode_tokens": "episodes.max_tokens",
    "max_staleness": "asynchronous.max_staleness", "rollout_timeout": "asynchronous.rollout_timeout",
    "loss_aggregation": "loss.aggregation",
    **{name: f"loss.{name}" for name in ("mask_truncated_completions", "ent_coef", "ptx_coef")},
}

# Arguments that moved into a group (the policy loss, the advantage estimator, the engine, and the ones above): the
# group, and where each is now, for the command line's one line about a class that takes the group.
MOVED_INTO_GROUPS = {
    "clip_range": ("policy_loss", "policy_loss.clip_range"),
    "clip_range_high": ("policy_loss", "policy_loss.clip_range_high"),
    "ratio_level": ("policy_loss", "policy_loss.ratio_level"),
    "clip_against": ("policy_loss", "policy_loss.clip_against"),
    **{name: ("advantages", f"advantages.{name}") for name in ("gamma", "lam", "whiten_rewards", "whiten_advantages",
                                                               "scale_rewards", "std_eps", "baseline")},
    "cispo_max_weight": ("policy_loss", "policy_loss: CISPO with policy_loss.max_weight"),
    "cispo_min_weight": ("policy_loss", "policy_loss: CISPO with policy_loss.min_weight"),
    "loss_type": ("preference_loss", "preference_loss: Sigmoid, Robust, IPO, Hinge, SigmoidNorm or SimPO (loss_type "
                                     "sigmoid, robust, ipo, hinge, sigmoid_norm, simpo)"),
    "label_smoothing": ("preference_loss", "preference_loss.label_smoothing, of Sigmoid, Robust and SimPO"),
    "simpo_gamma": ("preference_loss", "preference_loss: SimPO with preference_loss.gamma"),
    "decoding": ("engine", "engine: {class_path: rlhf_lightning.rollout.engines.EagerDecoder}; decoding auto, "
                           "compiled, generate and vllm are the engines Auto, CompiledDecoder, Generate and "
                           "rlhf_lightning.rollout.vllm_engine.VLLMEngine"),
    "vllm": ("engine", "engine: {class_path: rlhf_lightning.rollout.vllm_engine.VLLMEngine, init_args: "
                       "{kv_cache_gib: ...}}, the same options"),
    **{name: (place.split(".")[0], place) for name, place in MOVED_ARGUMENTS.items()},
}

# Members the on-policy loop read under another name: a subclass that defines one is refused (the loop no longer
# calls it, so an override would silently stop counting); each value says what took its place.
_PLAN = "return PassSettings from pass_settings() (rlhf_lightning.core.pass_plan) and read pass_plan"
_COLLECTOR = ("step 1 is the module's collector (rlhf_lightning.core.collect.Collector, held as collector): override "
              "extend_experience for an algorithm's own passes, or set a Collector subclass of your own as collector")
_UPDATER = ("step 4 is the module's updater (rlhf_lightning.core.update.PolicyUpdate, held as updater): override "
            "micro_step, loss or step_normalisers, or set a PolicyUpdate subclass of your own as updater")
_POLICY = ("the policy, its sampler, turn loop and forward passes of any role, is the module's part "
           "(rlhf_lightning.core.policy.Policy, held as policy): call module.policy.{name}, or wrap it on the "
           "module's policy after construction")
# Members of the policy stages' former base class (PolicyModule), which the module no longer has: a subclass that
# defines one is refused (nothing calls it now), naming where it went.
MOVED_TO_POLICY = {
    **{name: _POLICY.format(name=name) for name in ("token_logprobs", "response_logprobs", "response_hidden_states",
                                                   "generate", "decode", "check_built", "sampler", "rollouts")},
    "make_rollouts": _POLICY.format(name="rollouts") + "; its episodes are the module's episodes",
    "refuse_engine": _POLICY.format(name="prepare(trainer)") + ", at setup",
    "adapter_parameters": "the parameters of an adapter are the model's: module.model.adapter_parameters(name)",
    "check_positions": "rlhf_lightning.models.loading.check_positions(spec, tokenizer, tokens, what, fix)",
    "environment": "the episodes' environment is module.episodes.environment",
    "skip_iteration": "an iteration not trained on is the updater's: module.updater.skip(module, message)",
}
RENAMED_HOOKS = {
    "rollout": "training_step calls collect_experience (step 1), shape_rewards (2) and prepare_update (3); "
               "collect_and_prepare runs the three for analysis",
    "measure_kl": f"{_PLAN}: dataclasses.replace(super().pass_settings(), measure_kl=True)",
    **{name: _PLAN for name in ("needs_logprobs", "needs_reference", "logprobs_before_update", "reuses_first_pass")},
    **{name: _COLLECTOR for name in ("collect", "training_rollout", "draw_ahead", "early_first_pass",
                                     "sampling_statistics", "reward_inputs", "guard_scores")},
    **{name: _UPDATER for name in ("update", "micro_batches", "minibatch_sizes")},
    **MOVED_TO_POLICY,
}

# Members an engine (rlhf_lightning.rollout.engines.Engine) defined under another name: refused as RENAMED_HOOKS.
RENAMED_ENGINE_METHODS = {
    "overlap_refusal": "an engine that draws ahead returns None from ahead_refusal(staleness), sizes what it keeps in "
                       "keep_versions(staleness) and hands out a PolicyVersion from serve_version",
}


def moved_module(module: str) -> str | None:
    """Where ``module`` (or a module inside a package that moved) is now, or None if it did not move."""
    if module in MOVED_MODULES:
        return MOVED_MODULES[module]
    return next((new + module[len(old):] for old, new in MOVED_MODULES.items() if module.startswith(old + ".")),
                None)


def moved_arguments(owner: str, given: Iterable[str], groups: Iterable[str] | None = None) -> None:
    """Refuse, in one line, module arguments ``given`` to ``owner`` (a class name) under their old flat names;
    ``groups``: the owner's arguments, when known, so that only a name whose group it takes is said to have moved
    (``DPO(epochs=...)`` is left to the constructor's own error: DPO has no ``update``)."""
    groups = None if groups is None else set(groups)
    for name in given:
        group, place = MOVED_INTO_GROUPS.get(name, (None, None))
        if group is None or (groups is not None and (group not in groups or name in groups)):
            continue
        if name in MOVED_ARGUMENTS:  # a field of a typed group: a dict of some fields is enough
            field = place.split(".")[1]
            raise TypeError(f"{owner}({name}=...): {name} is now {group}.{field}; pass {group}={{'{field}': ...}} (its "
                            f"other fields keep the module's defaults) or {GROUP_CLASSES[group]}(...), or write "
                            f"{group}: {{{field}: ...}} in a config")
        raise TypeError(f"{owner}({name}=...): {name} moved into the {group} argument: {place}")


def renamed_hooks(cls: type, renamed: dict[str, str] | None = None, reader: str = "the loop") -> None:
    """Refuse a class that defines a member under an old name of ``renamed`` (:data:`RENAMED_HOOKS` by default),
    naming what took its place; ``reader``: what no longer calls it (the on-policy loop, or the fit's use of an
    engine)."""
    renamed = RENAMED_HOOKS if renamed is None else renamed
    for name in renamed.keys() & vars(cls).keys():
        raise TypeError(f"{cls.__qualname__}.{name}: {reader} no longer reads {name!r}; {renamed[name]}")


class _OldName(importlib.abc.Loader):
    """Loads an old module name as the module at its new place (the same object, under both names)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # Attributed to this file, not to the importer: that is often a library (jsonargparse reading a config,
        # torch.load), whose warnings the command line hides; this one is for the user.
        warnings.warn_explicit(f"{spec.name} moved to {self.new}: import it from there (the old name goes in the "
                               "next release)", FutureWarning, __file__, 0, module=__name__)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # importlib gave it the old name's spec: the module keeps its own


class _OldNames(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED_MODULES` (and of the modules inside a moved package), nothing else."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = moved_module(fullname) if fullname.startswith("rlhf_lightning.") else None
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _OldName(new))


def install_old_names() -> None:
    """Put the finder of old module names last on ``sys.meta_path`` (once): see the module's docstring for why."""
    if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
        sys.meta_path.append(_OldNames())
