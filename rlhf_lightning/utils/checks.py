"""Argument checks that run in constructors (which load nothing: the model is built in ``configure_model``): one
line each, naming the argument, its value and what was expected, so a typo in a config fails in a second rather
than after minutes of loading."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

# What the command line's parser hands over for `--...=null` inside a nested dataclass (e.g. BaseModelSpec):
# the string "None", which would otherwise reach the hub as a repository id.
NULL_STRINGS = frozenset({"none", "null", "~"})


def optional_str(value: str | None) -> str | None:
    """``value``, with the strings ``None``/``null``/``~`` (any case) read as None."""
    if isinstance(value, str) and value.strip().lower() in NULL_STRINGS:
        return None
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan")
    return value


def positive(name: str, value: float | None, optional: bool = False) -> None:
    """``value > 0`` (None allowed with ``optional``)."""
    if value is None and optional:
        return
    if not _number(name, value) > 0:
        raise ValueError(f"{name} must be > 0{' or null' if optional else ''}, got {value}")


def non_negative(name: str, value: float | None, optional: bool = False) -> None:
    """``value >= 0`` (None allowed with ``optional``)."""
    if value is None and optional:
        return
    if not _number(name, value) >= 0:
        raise ValueError(f"{name} must be >= 0{' or null' if optional else ''}, got {value}")


def at_least(name: str, value: int | None, minimum: int = 1, optional: bool = False) -> None:
    """An integer count ``>= minimum`` (None allowed with ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' or null' if optional else ''}, got {value!r}")


def in_range(name: str, value: float, low: float, high: float, low_open: bool = False,
             high_open: bool = False) -> None:
    """``low <= value <= high``; ``low_open``/``high_open`` exclude the bounds."""
    value = _number(name, value)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value}")


def finite(name: str, value: float | None, optional: bool = False) -> None:
    """A finite number (None allowed with ``optional``)."""
    if value is None and optional:
        return
    if not math.isfinite(_number(name, value)):
        raise ValueError(f"{name} must be a finite number, got {value}")


def one_of(name: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` is one of ``choices`` (what the CLI's Literal types enforce, for Python callers too)."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, kv_cache: str,
                   prefix: str = "") -> None:
    """The sampling settings (``prefix``: how their names are spelt before them, e.g. ``sampling.``)."""
    at_least(f"{prefix}max_new_tokens", max_new_tokens)
    positive(f"{prefix}temperature", temperature)
    at_least(f"{prefix}top_k", top_k, minimum=0)
    in_range(f"{prefix}top_p", top_p, 0.0, 1.0, low_open=True)
    one_of(f"{prefix}kv_cache", kv_cache, ("static", "dynamic"))


def check_vllm(kv_cache_gib: float | None, gpu_memory_utilization: float, max_model_len: int | None) -> None:
    """The vLLM engine's settings (its init args)."""
    positive("engine.init_args.kv_cache_gib", kv_cache_gib, optional=True)
    in_range("engine.init_args.gpu_memory_utilization", gpu_memory_utilization, 0.0, 1.0, low_open=True)
    at_least("engine.init_args.max_model_len", max_model_len, optional=True)


GROUP_CLASSES = {"sampling": "Sampling", "kl": "KLPenalty", "optimizer": "OptimizerSettings", "critic": "Critic",
                 "correction": "RolloutCorrection", "reward_shaping": "RewardShaping", "update": "UpdateSettings",
                 "episodes": "Episodes", "asynchronous": "Asynchronous", "loss": "LossSettings"}


def group_settings(name: str, value: Any, default: Any) -> Any:
    """A group argument (``sampling``, ``kl``, ``optimizer``): an instance of ``default``'s dataclass as it is, or a
    mapping of some of its fields taken over ``default`` (the module's own defaults), as a config's are."""
    cls = type(default)
    if isinstance(value, cls):
        return value.check(name)
    if isinstance(value, Mapping):
        fields = [field.name for field in dataclasses.fields(cls)]
        unknown = [key for key in value if key not in fields]
        if unknown:
            raise ValueError(f"{name}.{unknown[0]}: {cls.__name__} has no such field (its fields: {', '.join(fields)})")
        return dataclasses.replace(default, **value).check(name)
    raise TypeError(f"{name} must be a {cls.__name__} (rlhf_lightning.{cls.__name__}) or a dict of some of its "
                    f"fields, got {value!r}")
