"""Every argument of every module and data module, given a bad value the way a user types it on the command line,
stops with one line naming it, or is a value the argument does take (the list below says why). Constructing a
module reads no weights, so this runs the real command line's parsing and construction for each case in well
under a second."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningArgumentParser

from rlhf_lightning import (
    DPO,
    GRPO,
    KTO,
    PPO,
    RLOO,
    SFT,
    OnlineDPO,
    PreferenceDataModule,
    ProcessRewardModel,
    PromptDataModule,
    REINFORCEPlusPlus,
    RewardModel,
    SFTDataModule,
    StepwiseDataModule,
    UnpairedPreferenceDataModule,
)
from rlhf_lightning.algorithms.kl import KLPenalty
from rlhf_lightning.algorithms.loss_settings import LossSettings
from rlhf_lightning.algorithms.rollout_correction import RolloutCorrection
from rlhf_lightning.cli import RLHFCLI
from rlhf_lightning.cli.errors import accepted_arguments, user_error
from rlhf_lightning.core.held_out_pass_at_k import PassAtK
from rlhf_lightning.core.micro_batches import UpdateSettings
from rlhf_lightning.core.offline import OfflinePreference
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.core.policy import Policy
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rewards.combine import RewardShaping
from rlhf_lightning.rollout.ahead import Asynchronous
from rlhf_lightning.rollout.settings import Episodes, Sampling
from rlhf_lightning.stages.ppo import Critic
from rlhf_lightning.utils.checks import GROUP_CLASSES
from rlhf_lightning.utils.optim import OptimizerSettings

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {SFT: "sft.yaml", RewardModel: "reward.yaml", PPO: "ppo.yaml", GRPO: "grpo.yaml", RLOO: "rloo.yaml",
           REINFORCEPlusPlus: "reinforce_pp.yaml", DPO: "dpo.yaml", KTO: "kto.yaml", OnlineDPO: "online_dpo.yaml",
           ProcessRewardModel: "arithmetic_prm.yaml"}
DATA = {SFTDataModule: "sft.yaml", PreferenceDataModule: "reward.yaml", PromptDataModule: "grpo.yaml",
        UnpairedPreferenceDataModule: "kto.yaml", StepwiseDataModule: "arithmetic_prm.yaml"}
# The typed groups of arguments: each of their fields is an argument of its own here, by its dotted key (kl.coef).
GROUP_TYPES = (Sampling, KLPenalty, OptimizerSettings, Critic, RolloutCorrection, RewardShaping, UpdateSettings,
               Episodes, Asynchronous, LossSettings)
# (argument, value) pairs that are valid although they look odd, and why.
VALID = {
    ("seed", "-1"): "any integer seeds the sampler",
}


def bad_values(annotation) -> list[str]:
    """What a user mistypes for an argument of this type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in (int, float) or (origin in (typing.Union, type(int | None)) and {int, float} & set(args)):
        return ["-1", "nan", "abc"]
    if origin is typing.Literal:
        return ["bogus"]
    if annotation is bool:
        return ["maybe"]
    if annotation is LoraSpec or LoraSpec in args:
        return ["{r: 0}", "{alpha: -2}", "{bias: some}"]
    if annotation is BaseModelSpec:
        return ["{dtype: float8}"]
    if annotation is PassAtK:
        return ["{samples: 0}", "{samples: 4, k: [8]}", "{correct_at: nan}"]
    return []


def cases() -> list[tuple[type, str, str, str]]:
    found = []
    for cls, config in [*CONFIGS.items(), *DATA.items()]:
        hints = {}
        # the policy's arguments, which a policy-optimising module passes on to its part, then the chain's own
        parts = [Policy] if issubclass(cls, OnlineRL | OfflinePreference) else []
        for klass in [*parts, *reversed(cls.__mro__)]:
            init = klass.__dict__.get("__init__")
            if init is not None:
                hints.update(typing.get_type_hints(init))
        for name in accepted_arguments(f"{cls.__module__}.{cls.__qualname__}"):
            annotation = hints.get(name, inspect.Parameter.empty)
            if annotation in GROUP_TYPES:  # a typed group: each of its fields, as --model.init_args.kl.coef
                fields = typing.get_type_hints(annotation)
                arguments = [(f"{name}.{field.name}", fields[field.name]) for field in dataclasses.fields(annotation)]
            else:
                arguments = [(name, annotation)]
            for key, hint in arguments:
                for value in bad_values(hint):
                    found.append((cls, config, key, value))
    return found


class OneParserCLI(RLHFCLI):
    """The command line with its parser built once and parsing every case: the parser does not depend on the
    arguments (the model and data classes are chosen by ``class_path`` when parsing), and building it is a third of
    a case's time."""

    parser_built: LightningArgumentParser | None = None

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        if OneParserCLI.parser_built is None:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
            OneParserCLI.parser_built = self.parser
        self.parser = OneParserCLI.parser_built


def outcome(cls: type, config: str, name: str, value: str) -> tuple[str, str]:
    """``("parse", line)``: the parser refused it; ``("constructor", line)``: our check; ``("accepted", "")``."""
    group = "data" if cls in DATA else "model"
    arguments = ["--config", str(REPO / "configs" / config), f"--{group}.class_path={cls.__module__}.{cls.__qualname__}",
                 f"--{group}.init_args.{name}={value}", "--trainer.logger=false"]
    try:
        OneParserCLI(args=arguments, run=False)
    except SystemExit as exit_info:
        return "parse", str(exit_info.code)
    except Exception as error:  # noqa: BLE001 - what the command line's handler would make of it
        ours = user_error(error)
        if ours is None:
            raise
        return "constructor", str(ours)
    return "accepted", ""


def sweep() -> list:
    """:func:`cases`, each class's first in the developer's loop and the rest of the sweep marked slow (838 command
    lines in about 1.5 minutes of one core: the main suite runs them all)."""
    seen: set[type] = set()
    params = []
    for case in cases():
        first = case[0] not in seen
        seen.add(case[0])
        params.append(pytest.param(*case, marks=() if first else pytest.mark.slow))
    return params


@pytest.mark.parametrize("cls, config, name, value", sweep(),
                         ids=lambda item: item.__name__ if isinstance(item, type) else str(item))
def test_a_bad_value_of_every_argument_is_refused_in_one_line(capsys, cls, config, name, value):
    kind, message = outcome(cls, config, name, value)
    if kind == "accepted":
        assert VALID.get((name, value)), f"{cls.__name__}.{name}={value} was accepted silently"
        return
    if kind == "parse":
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert message == "2" and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert name in lines[0] or "init_args" in lines[0], lines[0]
    else:
        assert "\n" not in message and (name in message or name.replace("_", " ") in message), message


def test_every_typed_group_is_checked_field_by_field():
    """Each group the modules take has its class above, so that its fields (``episodes.max_turns``,
    ``asynchronous.max_staleness``, ``loss.ent_coef``) get bad values of their own."""
    assert sorted(cls.__name__ for cls in GROUP_TYPES) == sorted(GROUP_CLASSES.values())
    keys = {name for cls, _, name, _ in cases() if cls is GRPO}
    assert {"episodes.max_turns", "episodes.max_tokens", "asynchronous.max_staleness", "asynchronous.rollout_timeout",
            "loss.aggregation", "loss.mask_truncated_completions", "loss.ent_coef", "loss.ptx_coef"} <= keys
