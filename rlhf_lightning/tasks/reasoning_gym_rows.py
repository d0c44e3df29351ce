"""reasoning-gym's procedural tasks (Stojanovski et al. 2025, https://github.com/open-thought/reasoning-gym) as rows:
task names (one, or a weighted mix), each with its generator settings, a size and a seed in; questions, reference
answers and the entries the tasks' own checkers read out (:func:`generate_rows`). The checker is
:mod:`rlhf_lightning.tasks.reasoning_gym_checker`; the data modules that serve the rows are in
:mod:`rlhf_lightning.data.reasoning_gym_data`.

reasoning-gym is optional (``pip install -e '.[reasoning-gym]'``): it is imported when rows are made or a task name
is checked, never when this module is.

Determinism: reasoning-gym draws entry ``i`` of a dataset seeded ``s`` from ``random.Random(s + i)``, and a row's task
is drawn from a string-seeded stream (SHA-512, not Python's salted ``hash``), so the rows are a function of the
settings, the size and the seed: every rank, and a resumed run, make the same ones. Held-out rows come from the same
generators seeded ``seed + 2**31``: their entries ``Random(seed + 2**31 + j)`` are never training entries
``Random(seed + i)`` while ``size < 2**31`` (an identical question can still be drawn twice where a task's settings
allow few distinct ones).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import random
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from rlhf_lightning.tasks.chat_tokenizer import word_level_chat_tokenizer

EXTRA_HINT = "pip install -e '.[reasoning-gym]'"
HELD_OUT_SEED_OFFSET = 2**31  # the held-out generators' seed is the training seed plus this
# The settings every reasoning-gym task has, which the data module sets itself (from its own ``seed`` and ``size``).
OWN_SETTINGS = ("seed", "size")

# reasoning-gym's documented answer format: its system prompts ask for the final answer between <answer> tags, and
# its own training code reads the last such span (``reasoning_gym.utils.extract_answer``).
DEFAULT_ANSWER_TAG = "answer"
DEFAULT_SYSTEM_PROMPT = "default"  # a key of reasoning_gym.utils.SYSTEM_PROMPTS


class MissingExtra(ImportError, RuntimeError):
    """An optional package that is not installed: an ``ImportError``, and a ``RuntimeError`` so that the command
    line prints its one line (which names the extra to install) instead of a traceback."""


def reasoning_gym() -> ModuleType:
    """The ``reasoning_gym`` package, or one line saying how to install it."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as error:
        raise MissingExtra(f"reasoning-gym is not installed ({error}); install the extra: {EXTRA_HINT}") from None


def registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's task registry: name -> (dataset class, settings dataclass)."""
    reasoning_gym()
    return importlib.import_module("reasoning_gym.factory").DATASETS


@dataclass
class GymTask:
    """One reasoning-gym task of a mix.

    Args:
        name: the task's registered name (``leg_counting``, ``chain_sum``, ``basic_arithmetic``...; reasoning-gym's
            ``GALLERY.md`` lists them).
        weight: its share of the rows, relative to the other tasks' weights (> 0).
        config: its generator settings, the fields of the task's config dataclass (e.g. ``{min_animals: 1,
            max_animals: 2}`` for ``leg_counting``); ``seed`` and ``size`` come from the data module.
    """

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)


def task_list(tasks: str | GymTask | list[str | GymTask | dict], where: str = "tasks") -> list[GymTask]:
    """``tasks`` as :class:`GymTask` s (a name alone is a task of weight 1 with default settings), checked: a known
    name (else one line listing the close ones), a positive finite weight, no task twice, no ``seed``/``size`` in the
    settings. ``where`` names the setting in messages."""
    items = tasks if isinstance(tasks, list | tuple) else [tasks]
    if not items:
        raise ValueError(f"{where}: expected at least one reasoning-gym task name, got an empty list")
    known = registry()
    made, seen = [], set()
    for index, item in enumerate(items):
        at = f"{where}[{index}]" if isinstance(tasks, list | tuple) else where
        if isinstance(item, str):
            item = GymTask(item)
        elif isinstance(item, dict):
            item = GymTask(**item)
        elif not isinstance(item, GymTask):
            raise TypeError(f"{at}: expected a task name or {{name, weight, config}}, got {item!r}")
        if item.name not in known or item.name == "composite":
            close = difflib.get_close_matches(item.name, [name for name in known if name != "composite"], n=3)
            hint = f"close ones: {', '.join(close)}" if close else f"{len(known) - 1} tasks, e.g. {', '.join(sorted(known)[:4])}"
            raise ValueError(f"{at}.name: {item.name!r} is not a reasoning-gym task ({hint})")
        if not (item.weight > 0 and item.weight != float("inf")):
            raise ValueError(f"{at}.weight: expected a positive finite share of the rows, got {item.weight}")
        if item.name in seen:
            raise ValueError(f"{at}.name: {item.name!r} appears twice; give each task once, with its weight")
        own = [name for name in OWN_SETTINGS if name in (item.config or {})]
        if own:
            raise ValueError(f"{at}.config: {', '.join(own)} set by the data module (its seed and size); leave "
                             f"{'them' if len(own) > 1 else 'it'} out of the task's settings")
        seen.add(item.name)
        made.append(GymTask(item.name, float(item.weight), dict(item.config or {})))
    return made


def make_dataset(task: GymTask, size: int, seed: int, where: str = "tasks[0].config") -> Any:
    """The task's reasoning-gym dataset of ``size`` entries from ``seed``; settings the task rejects (an unknown
    field, or one its ``validate`` refuses) are one line naming the task, the setting and what it accepts."""
    dataset_class, config_class = registry()[task.name]
    fields = [f.name for f in dataclasses.fields(config_class) if f.name not in OWN_SETTINGS]
    unknown = sorted(set(task.config) - set(fields))
    if unknown:
        raise ValueError(f"{where}: task {task.name!r} has no setting {', '.join(map(repr, unknown))} (its "
                         f"settings: {', '.join(fields)})")
    try:
        config = config_class(**task.config, seed=seed, size=size)
        if hasattr(config, "validate"):
            config.validate()
        return dataset_class(config=config)
    except (AssertionError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{where}: task {task.name!r} rejects the settings {task.config}: {reason}") from None


def _mix(tasks: list[GymTask], size: int, seed: int, stream: str) -> list[int]:
    """Each row's task (its position in ``tasks``), drawn by weight from a stream of the seed's own."""
    if len(tasks) == 1:
        return [0] * size
    weights = [task.weight for task in tasks]
    return [random.Random(f"reasoning_gym:{seed}:{stream}:{row}").choices(range(len(tasks)), weights)[0]
            for row in range(size)]


def generate_rows(tasks: list[GymTask], size: int, seed: int, held_out: bool = False,
                  where: str = "tasks") -> list[dict[str, Any]]:
    """``size`` rows of the mix ``tasks`` (checked by :func:`task_list`): ``task`` (its name), ``question``,
    ``answer`` (the reference) and ``entry`` (reasoning-gym's whole entry: what its checker reads). ``held_out``:
    from the held-out generators (``seed + 2**31``), disjoint from the training entries."""
    if held_out:
        seed += HELD_OUT_SEED_OFFSET
    stream = "held_out" if held_out else "train"
    datasets = [make_dataset(task, size, seed, f"{where}[{index}].config") for index, task in enumerate(tasks)]
    rows = []
    for index, choice in enumerate(_mix(tasks, size, seed, stream)):
        try:
            entry = datasets[choice][index]
        except Exception as error:  # a generator that fails on some index: say which task, row and settings
            raise ValueError(f"{where}[{choice}]: task {tasks[choice].name!r} with settings {tasks[choice].config} failed to "
                             f"generate row {index} ({type(error).__name__}: {error})") from None
        rows.append({"task": tasks[choice].name, "question": entry["question"], "answer": str(entry["answer"]),
                     "entry": entry})
    return rows


def system_prompt_text(system_prompt: str | None) -> str | None:
    """The system prompt: a key of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, ``simple``, ``direct``,
    ``DeepSeekZero``, ``chain_of_draft``) is that prompt, other text is itself, null or empty is none."""
    if not system_prompt:
        return None
    reasoning_gym()
    prompts = importlib.import_module("reasoning_gym.utils").SYSTEM_PROMPTS
    return prompts.get(system_prompt, system_prompt)


def answer_text(answer: str, answer_tag: str | None) -> str:
    """A reference answer written as the checker reads it: ``<answer>42</answer>``, or bare without a tag."""
    return f"<{answer_tag}>{answer}</{answer_tag}>" if answer_tag else answer


# ---- the tokenizer of tiny models on these tasks --------------------------------------------------------------

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK, "<|im_start|>", "<|im_end|>")
WORDS = ("<answer>", "</answer>", "<think>", "</think>", "system", "user", "assistant")
CHARACTERS = ("\n", "\t", *(chr(code) for code in range(32, 127)))  # printable ASCII: what the arithmetic tasks write
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def build_tokenizer():
    """A character-level tokenizer of printable ASCII (the text of reasoning-gym's arithmetic and counting tasks),
    the answer and think tags and the chat roles as single tokens, a ChatML-style chat template (``<|im_end|>``
    ends a turn), left padding. Built locally, no download: ``tokenizer: reasoning_gym`` in a base model."""
    return word_level_chat_tokenizer(SPECIAL_TOKENS, WORDS, CHARACTERS, CHAT_TEMPLATE, model_max_length=1024,
                                     other=r"[\s\S]")  # newlines too: the tasks' questions hold them
