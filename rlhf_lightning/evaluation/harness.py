"""Running lm-evaluation-harness tasks on a model of ours and reading the results: the settings an evaluation takes
(:class:`HarnessSettings`), the run itself (:func:`run_tasks`: lm-eval's ``simple_evaluate``, the caller's random
streams left as they were), the metrics as flat names (:func:`metric_values`: ``<task>/<metric>``), the results as a
JSON file and as lm-eval's printed table."""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_lightning.utils.atomic_io import atomic_write

SKIPPED_KEYS = ("alias", "samples", "name", "sample_len", "sample_count")


@dataclass(frozen=True)
class HarnessSettings:
    """How lm-eval runs the tasks (its ``simple_evaluate``'s arguments of the same names).

    Args:
        limit: examples per task (an int), or a share of them (a float below 1); null = all.
        num_fewshot: examples given in each prompt; null = each task's own (0 when it names none).
        apply_chat_template: wrap prompts in the tokenizer's chat template (true, or a template's name when the
            tokenizer has several).
        fewshot_as_multiturn: with a chat template, give the few-shot examples as turns of the conversation.
        system_instruction: a system message before every prompt.
        gen_kwargs: generation settings over the tasks' own (``temperature``, ``do_sample``, ``max_gen_toks``,
            ``until``, ``top_p``, ``top_k``), e.g. ``{max_gen_toks: 64}``.
        bootstrap_iters: bootstrap draws of the standard errors of metrics without a closed form; 0 = no standard
            errors at all.
        seed: Python, NumPy, torch and few-shot seed; null = lm-eval's (0, 1234, 1234, 1234).
        log_samples: keep every example's prompt and answers in the results (``samples``).
    """

    limit: int | float | None = None
    num_fewshot: int | None = None
    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool = True
    system_instruction: str | None = None
    gen_kwargs: dict[str, Any] | None = None
    bootstrap_iters: int = 100_000
    seed: int | None = None
    log_samples: bool = False

    def check(self) -> HarnessSettings:
        """Raise a one-line error for a value out of range."""
        if self.limit is not None and (self.limit <= 0 or (isinstance(self.limit, float) and self.limit > 1)):
            raise ValueError(f"limit must be a count > 0 or a share in (0, 1], got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.bootstrap_iters < 0:
            raise ValueError(f"bootstrap_iters must be >= 0, got {self.bootstrap_iters}")
        return self


def parse_gen_kwargs(text: str | None) -> dict[str, Any] | None:
    """``temperature=0,max_gen_toks=64`` (lm-eval's spelling) as a dict of numbers, booleans and strings."""
    if not text:
        return None
    settings: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"gen_kwargs: {item!r} is not KEY=VALUE (e.g. temperature=0,max_gen_toks=64)")
        settings[key.strip()] = yaml_scalar(value.strip())
    return settings


def yaml_scalar(value: str) -> Any:
    """A command-line value as YAML reads it (``0`` an int, ``true`` a bool, ``0.7`` a float), else the text."""
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    return parsed if isinstance(parsed, int | float | bool | str) else value


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """The block may reseed Python's, NumPy's and torch's random streams (lm-eval does); they are as before
    after it, so that a fit that evaluates draws what it would have drawn without."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def run_tasks(lm: Any, tasks: Sequence[Any], settings: HarnessSettings, manager: Any = None) -> dict[str, Any]:
    """lm-eval's results of ``tasks`` (task objects or names) on ``lm``, an lm-eval model."""
    from lm_eval import simple_evaluate

    names = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    seeds = {} if settings.seed is None else dict.fromkeys(names, settings.seed)
    with random_state_kept():
        results = simple_evaluate(
            model=lm, tasks=list(tasks), num_fewshot=settings.num_fewshot, limit=settings.limit,
            bootstrap_iters=settings.bootstrap_iters, apply_chat_template=settings.apply_chat_template,
            fewshot_as_multiturn=settings.fewshot_as_multiturn and bool(settings.apply_chat_template),
            system_instruction=settings.system_instruction, gen_kwargs=settings.gen_kwargs,
            log_samples=settings.log_samples, task_manager=manager, **seeds)
    if results is None:  # not the first rank
        return {}
    return results


def metric_values(results: dict[str, Any]) -> dict[str, float]:
    """Every numeric result as ``<task>/<metric>``: lm-eval's ``acc,none`` is ``acc``, ``exact_match,strict-match``
    ``exact_match/strict-match`` (a filter other than ``none`` follows its metric); groups' aggregates included."""
    values: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                metric, _, filter_name = key.partition(",")
                if metric in SKIPPED_KEYS or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                if not math.isfinite(float(value)):
                    continue
                name = metric if filter_name in ("", "none") else f"{metric}/{filter_name}"
                values[f"{task}/{name}"] = float(value)
    return values


def jsonable(value: Any) -> Any:
    """What ``json`` cannot write, as lm-eval writes it: NumPy numbers as numbers, sets as lists, the rest as text."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def write_results(results: dict[str, Any], path: str | Path, model: dict[str, Any],
                  settings: HarnessSettings) -> Path:
    """``results`` as JSON at ``path`` (replaced atomically), with what was evaluated (``model``) and how."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"model": model, "settings": asdict(settings), **results}
    text = json.dumps(document, indent=2, default=jsonable, ensure_ascii=False) + "\n"
    atomic_write(path, lambda stream: stream.write(text.encode()))
    return path


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own table of the results (and of the groups', when there are groups)."""
    from lm_eval.utils import make_table

    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)

