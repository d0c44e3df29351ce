"""The embedded tasks, built from a seed with no download: ``synthetic`` (a small language with a hidden gold
reward; its parts in ``synthetic_grammar``, ``synthetic_gold`` and ``synthetic_data``), ``arithmetic`` (additions
with a checkable answer), ``calculator`` (large additions with a tool), ``arithmetic_judge`` (verdicts on
arithmetic answers, to train a judge) and ``guess_number`` (an OpenEnv game, whose module is
``rlhf_lightning.environments.guess_number``); the exact checker of the addition tasks is ``checking``, and the
word-level chat tokenizer that ``calculator`` and ``reasoning_gym`` build is ``chat_tokenizer``.
``dataset: <name>`` in a data module generates the task's rows and ``tokenizer: <name>`` in a base model builds its
tokenizer. reasoning-gym's procedural tasks (an optional package) are rows made from task names, their settings, a
size and a seed (``reasoning_gym_rows``, whose data modules are ``rlhf_lightning.data.reasoning_gym_data``),
scored by each task's own checker (``reasoning_gym_checker``); ``tokenizer: reasoning_gym`` is a character-level one
for tiny models on them."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# name -> (module, task class); each module also defines `build_tokenizer()`.
_TASKS = {"synthetic": ("rlhf_lightning.tasks.synthetic", "SyntheticTask"),
          "arithmetic": ("rlhf_lightning.tasks.arithmetic", "ArithmeticTask"),
          "calculator": ("rlhf_lightning.tasks.calculator", "CalculatorTask"),
          "arithmetic_judge": ("rlhf_lightning.tasks.arithmetic_judge", "ArithmeticJudgeTask"),
          # an OpenEnv game: its module lives with the environments and needs the optional openenv package
          "guess_number": ("rlhf_lightning.environments.guess_number", "GuessNumberTask")}
TASKS = tuple(_TASKS)
# Tokenizers by name: each task's, and reasoning-gym's (whose rows come from its data modules, not `dataset:`).
TOKENIZERS = (*TASKS, "reasoning_gym")


def _module(name: str) -> ModuleType:
    if name not in _TASKS:
        raise ValueError(f"no embedded task {name!r}; the tasks are {', '.join(TASKS)}")
    return importlib.import_module(_TASKS[name][0])


def make_task(name: str, seed: int) -> Any:
    """The task ``name`` with ``seed``: an object with ``sft_rows``, ``prompt_rows`` and ``preference_rows``."""
    return getattr(_module(name), _TASKS[name][1])(seed=seed)


def build_task_tokenizer(name: str):
    """The tokenizer of task ``name`` (one of :data:`TOKENIZERS`)."""
    if name == "reasoning_gym":
        return importlib.import_module("rlhf_lightning.tasks.reasoning_gym_rows").build_tokenizer()
    return _module(name).build_tokenizer()
