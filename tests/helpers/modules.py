"""The one way the tests build a module: :func:`make`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlhf_lightning import PPO, AdapterReward, FunctionReward
from rlhf_lightning.cli.errors import accepted_arguments
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks.synthetic import gold_rewards
from rlhf_lightning.utils.checks import GROUP_CLASSES
from tests.helpers.models import LORA, built, tiny_spec

GROUPS = tuple(GROUP_CLASSES)  # the modules' typed groups, given from Python as dicts of some fields


def merged(*settings: dict[str, Any]) -> dict[str, Any]:
    """Module arguments, later ones over earlier ones, the groups' dicts merged field by field (a test's
    ``sampling={"temperature": 0.7}`` keeps a helper's ``sampling={"max_new_tokens": 6}``)."""
    out: dict[str, Any] = {}
    for arguments in settings:
        for name, value in arguments.items():
            if name in GROUPS and isinstance(value, dict) and isinstance(out.get(name), dict):
                value = {**out[name], **value}
            out[name] = value
    return out


def make(cls: type, model_dir: str | Path, reward: Any = None, defaults: dict[str, Any] | None = None,
         **arguments: Any):
    """``cls`` built (``configure_model``) on the base saved in ``model_dir``, with the tests' small adapters
    (:data:`LORA` for the policy, and the critic of PPO) and a learning rate of 1e-2, after ``torch.manual_seed(0)``
    so that its adapters start alike in every test.

    ``reward``: a reward source, or the folder of a reward adapter (an :class:`AdapterReward` of it); none for the
    offline stages. ``defaults``: a test file's own settings (those the class does not take are left out: online
    DPO fixes its ``samples_per_prompt``); ``arguments`` override everything.
    """
    torch.manual_seed(0)
    accepted = set(accepted_arguments(cls))
    assert accepted, f"the arguments of {cls} cannot be read"
    settings = {"policy_lora": LORA, "optimizer": {"lr": 1e-2}}
    if issubclass(cls, PPO):
        settings["critic"] = {"lora": LORA}
    settings = merged(settings, {name: value for name, value in (defaults or {}).items() if name in accepted})
    if reward is not None:
        settings["reward"] = AdapterReward(str(reward)) if isinstance(reward, (str, Path)) else reward
    return built(cls(base=BaseModelSpec(name_or_path=str(model_dir)), **merged(settings, arguments)))


def unbuilt(cls: type, **arguments: Any):
    """``cls`` constructed on the tiny GPT-2, scored by the synthetic task's gold reward, with nothing loaded (what
    the constructor and the settings decide needs no model)."""
    return cls(base=tiny_spec(), reward=FunctionReward(gold_rewards), **arguments)
