"""Which lm-evaluation-harness tasks to run: lm-eval's own tasks by name (or glob), task YAML files, and folders of
them (``include_paths``); every one found and its data loaded before a model is, or refused in one line.

lm-eval indexes its own tasks (thousands of YAML files, seconds) only when a name is not among the local ones; a task
of lm-eval reads its data from the Hugging Face hub, which offline (``HF_DATASETS_OFFLINE``) or without a network
fails: that is said in one line with the way out (a local task YAML on local files). A local task's
``dataset_kwargs.data_files`` are read relative to where the command runs, as lm-eval reads them.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

YAML_SUFFIXES = (".yaml", ".yml")
GLOB_CHARACTERS = "*?["


class _AnyTagLoader(yaml.SafeLoader):
    """Reads a task YAML whatever its tags (lm-eval's ``!function``): only its ``task``/``group`` name is needed."""


_AnyTagLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def task_name_in(path: Path) -> str:
    """The task (or group) a task YAML file defines: its ``task:`` or ``group:``."""
    try:
        config = yaml.load(path.read_text(), Loader=_AnyTagLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"task file {path} is not valid YAML: {str(error).splitlines()[0]}") from error
    name = config.get("task", config.get("group")) if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"task file {path} names no task: it needs a `task: NAME` (or `group: NAME`) key")
    return name


@dataclass(frozen=True)
class TaskSelection:
    """The tasks of an evaluation: lm-eval names (``names``) and the folders of task YAMLs they may come from."""

    names: tuple[str, ...]
    include_paths: tuple[str, ...] = field(default=())


def select_tasks(specs: Sequence[str], include_paths: Sequence[str] = ()) -> TaskSelection:
    """``specs``: lm-eval task names, globs or task YAML files (a comma-separated list each); ``include_paths``:
    folders of task YAMLs. A YAML file's folder is included, and its task is named by its ``task:`` key."""
    names: list[str] = []
    folders = []
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"task folder {folder} not found (include_path: a folder of task YAML files)")
        folders.append(str(Path(folder).resolve()))
    for spec in (part.strip() for given in specs for part in str(given).split(",")):
        if not spec:
            continue
        if spec.endswith(YAML_SUFFIXES):
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"task file {spec} not found (a task is an lm-eval task name or a task "
                                        "YAML file)")
            names.append(task_name_in(path))
            folder = str(path.resolve().parent)
            if folder not in folders:
                folders.append(folder)
        else:
            names.append(spec)
    if not names:
        raise ValueError("no task to evaluate: name lm-eval tasks or task YAML files (e.g. --tasks hellaswag or "
                         "--tasks my_task.yaml)")
    return TaskSelection(tuple(dict.fromkeys(names)), tuple(folders))


def known(manager: Any, name: str) -> bool:
    """Whether ``manager`` (lm-eval's ``TaskManager``) has a task, group or tag ``name`` (or one a glob matches)."""
    if any(character in name for character in GLOB_CHARACTERS):
        return bool(fnmatch.filter(manager.all_tasks, name))
    return name in manager.all_tasks


def task_manager(selection: TaskSelection) -> Any:
    """An lm-eval ``TaskManager`` that knows every selected task: the local folders' alone when they hold them all
    (no indexing of lm-eval's own tasks), else lm-eval's tasks and the local ones; a name neither holds is refused
    with the closest names."""
    from lm_eval.tasks import TaskManager

    paths = list(selection.include_paths) or None
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(known(local, name) for name in selection.names):
            return local
    manager = TaskManager(include_path=paths)
    for name in selection.names:
        if not known(manager, name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hint = f" (closest: {', '.join(close)})" if close else ""
            raise ValueError(f"no lm-eval task {name!r}{hint}: give one of lm-eval's tasks (`lm-eval ls tasks` "
                             "lists them), a task YAML file, or a folder of task YAMLs (include_path)")
    return manager


def load_tasks(manager: Any, selection: TaskSelection) -> list[Any]:
    """lm-eval's task (and group) objects of ``selection``, their data loaded: a task whose data cannot be read (a
    hub dataset offline, a missing local file) is refused in one line."""
    built = []
    for name in selection.names:
        try:
            loaded = manager.load([name])
        except Exception as error:  # noqa: BLE001 - datasets' and the hub's errors vary; the cause is kept
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(
                f"task {name}: its data cannot be loaded ({first}); a task of lm-eval reads its dataset from the "
                "Hugging Face hub, which needs a network (and HF_DATASETS_OFFLINE unset) or the dataset in the local "
                "cache: offline, give a task YAML on local files (dataset_path: json, dataset_kwargs: {data_files: "
                "...})") from error
        groups, tasks = loaded["groups"], loaded["tasks"]
        built += [groups[name]] if name in groups else list(tasks.values())
    return built
