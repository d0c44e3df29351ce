"""Our own errors reach the user as one line, not under the parser's or the Trainer's traceback.

A ``ValueError``/``TypeError``/``OSError``/``KeyError``/``RuntimeError``/``FloatingPointError`` (``DataFormatError``
and ``CheckpointError`` are ``ValueError``, ``NonFiniteError`` a ``FloatingPointError``) that a ``raise`` statement of
this package threw is a message written for the user: it names the
file, row, key or argument and what was expected. jsonargparse wraps an error raised in a module's
constructor into a ~150-line "Does not validate against any of the Union subtypes" report; the message the
user needs is the innermost cause from this package. Anything else (a bug, a library's error) keeps its full
traceback. ``RLHF_LIGHTNING_TRACEBACK=1`` shows the full traceback of every error.
"""

from __future__ import annotations

import difflib
import importlib
import linecache
import os
import re
from pathlib import Path
from types import TracebackType

import yaml

from rlhf_lightning.utils.compatibility import MOVED_ARGUMENTS, MOVED_INTO_GROUPS, moved_module

TRACEBACK_ENV = "RLHF_LIGHTNING_TRACEBACK"
# What a `raise` of ours throws for the user (NonFiniteError is a FloatingPointError; a module used before its model
# is built raises RuntimeError); an AssertionError or a library's error keeps its traceback.
USER_ERRORS = (ValueError, TypeError, OSError, KeyError, FloatingPointError, RuntimeError)
PACKAGE = Path(__file__).resolve().parents[1]
RAISE = re.compile(r"\braise\b")


def want_traceback() -> bool:
    """Whether the user asked for full tracebacks (``RLHF_LIGHTNING_TRACEBACK`` set to anything but 0/empty)."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _raising_frame(traceback: TracebackType | None) -> TracebackType | None:
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback


def raised_by_us(error: BaseException) -> bool:
    """Whether ``error`` was thrown by a ``raise`` statement in this package (not by Python or a library)."""
    frame = _raising_frame(error.__traceback__)
    if frame is None:
        return False
    filename = Path(frame.tb_frame.f_code.co_filename).resolve()
    if PACKAGE not in filename.parents:
        return False
    return bool(RAISE.search(linecache.getline(str(filename), frame.tb_lineno)))


def user_error(error: BaseException) -> BaseException | None:
    """The first error in ``error``'s chain (itself, then its causes) that is one of ours, or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, USER_ERRORS) and raised_by_us(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def process_rank() -> int:
    """This process's rank in a distributed run (0 outside one), from the launcher's environment."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def error_message(error: BaseException) -> str:
    """The message of a user error as the user reads it (a ``KeyError``'s quotes dropped)."""
    return error.args[0] if isinstance(error, KeyError) and error.args else str(error)


def one_line(error: BaseException) -> str:
    """``error: <message>``, the line printed for a user error; the other ranks of a distributed run prefix theirs
    with ``[rank N]``, so that the job's log holds one ``error:`` line."""
    rank = process_rank()
    return f"{f'[rank {rank}] ' if rank else ''}error: {error_message(error)}"


class ConfigFile(str):
    """A ``--config`` path as the user wrote it (how lines show it: relative stays relative), which remembers the
    file it named when the command started (:attr:`absolute`): jsonargparse reads a config file from inside its
    folder, so a relative path read during parsing would name another file."""

    absolute: str

    def __new__(cls, path: str) -> ConfigFile:
        made = super().__new__(cls, path)
        made.absolute = os.path.abspath(os.path.expanduser(path))
        return made


def config_files(argv: list[str]) -> list[str]:
    """The files given to ``--config``/``-c`` in ``argv`` (as :class:`ConfigFile`)."""
    files = []
    for index, argument in enumerate(argv):
        if argument in ("--config", "-c") and index + 1 < len(argv):
            files.append(ConfigFile(argv[index + 1]))
        elif argument.startswith("--config="):
            files.append(ConfigFile(argument.split("=", 1)[1]))
    return files


def config_file_problem(path: str) -> str | None:
    """One line saying why the config file ``path`` cannot be read as YAML (file, line, column), or None."""
    file = Path(path)
    if not file.is_file():
        return f"config file {path}: it does not exist" if not file.exists() else f"config file {path}: not a file"
    try:
        yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        context = getattr(error, "context", None)
        return f"config file {path}{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")
    return None


PARSER_KEY = re.compile(r'^(\s*)Parser key "([^"]+)":\s*$')
CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
UNKNOWN_OPTION = re.compile(r"Option '([^']+)' is not accepted")
UNKNOWN_NESTED = re.compile(r"^unrecognized arguments: --([\w.]+)")  # a group's field on a class without the group
# What TRL calls our arguments: a name taken from a TRL config gets its name here.
TRL_NAMES = {
    "beta": "kl.coef",
    "num_generations": "samples_per_prompt",
    "learning_rate": "optimizer.lr",
    "max_completion_length": "sampling.max_new_tokens",
    "max_prompt_length": "data.init_args.max_length",
    "epsilon": "policy_loss.clip_range",
    "cliprange": "policy_loss.clip_range",
    "epsilon_high": "policy_loss.clip_range_high",
    "num_iterations": "update.epochs",
    "num_ppo_epochs": "update.epochs",
    "importance_sampling_level": "policy_loss.ratio_level",
    "per_device_train_batch_size": "data.init_args.batch_size",
    "gradient_accumulation_steps": "update.gradient_accumulation",
    "cliprange_value": "critic.clip_range_value",
    "output_dir": "trainer.default_root_dir",
}


UNRECOGNIZED = re.compile(r"^unrecognized arguments: (\S+)")


def condense_parser_error(message: str, options: list[str] = ()) -> str:
    """jsonargparse's report of a bad value, down to one line: the full key as typed on the command line and
    the innermost problem, e.g. ``model.init_args.lr: Expected a <class 'float'>. Got value: abc``.

    The report nests ``Parser key "k":`` blocks, one level per group or class (with ``Problem with given
    class_path`` where a subclass's ``init_args`` start) inside "Does not validate against any of the Union
    subtypes" lists; a message without that shape comes back unchanged. An unrecognized option gets the closest
    of ``options`` (the parser's own).
    """
    lines = message.splitlines()
    unrecognized = UNRECOGNIZED.match(lines[0]) if lines else None
    if unrecognized and options:
        given = unrecognized.group(1).split("=")[0]
        return f"{lines[0]}{suggestion(given, list(options))}"
    path: list[str] = []
    depth, in_class, detail, last_class, key_index = -1, False, "", 0, 0
    for index, line in enumerate(lines):
        if CLASS_PATH.search(line):
            in_class = True  # the next key is one of the subclass's init_args
            last_class = index
            continue
        key = PARSER_KEY.match(line)
        if key is None:
            continue
        if len(key.group(1)) <= depth:
            break  # a sibling report (another union member): the deepest chain is complete
        depth, key_index = len(key.group(1)), index
        path += ["init_args", key.group(2)] if path and in_class else [key.group(2)]
        in_class = False
        detail = next((rest.strip() for rest in lines[index + 1:] if rest.strip()), "")
    if not path or not detail or PARSER_KEY.match(detail):
        return message if len(lines) < 2 else lines[0]
    callable_class = CALLABLE_CLASS.search(message)
    if callable_class is not None:  # a class given for a factory argument (an environment) that is not one
        return callable_class_problem(".".join(path), callable_class.group(2), callable_class.group(1))
    given = EXPECTED_PATH.search(detail)
    if given is not None:  # a class or function named by a string that imports nothing
        return unknown_class(".".join(path), given.group(1))
    if "Does not validate against any of the Union subtypes" in detail and (
            simple := simple_union_problem(lines[key_index + 1:])):  # an optional number, say: what it takes
        return f"{'.'.join(path)}: {simple}"
    if "Does not validate against any of the Union subtypes" in detail or CLASS_PATH.search(detail):
        # the innermost class given by class_path (a policy loss inside a module) is the one with the problem
        return class_problem(lines[last_class:], path) or f"{'.'.join(path)}: {detail}"
    return f"{'.'.join(path)}: {detail}"


EXPECTED_TYPE = re.compile(r"^\s*- Expected a <class '(\w+)'>\s*$")
GIVEN_VALUE = re.compile(r"^\s*Given value: (.*)$")
TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "NoneType": "null"}


def simple_union_problem(block: list[str]) -> str | None:
    """``expected an integer or null, got 512.5`` for a union of plain types (``int | None``) that a value fits
    none of; None for a union with a class among its members (reported by :func:`class_problem`)."""
    expected, given = [], None
    for line in block:
        if CLASS_PATH.search(line) or PARSER_KEY.match(line):
            return None
        if match := EXPECTED_TYPE.match(line):
            expected.append(TYPE_NAMES.get(match.group(1), match.group(1)))
        elif match := GIVEN_VALUE.match(line):
            given = match.group(1).strip()
            break
    if not expected or given is None:
        return None
    return f"expected {' or '.join(dict.fromkeys(expected))}, got {given}"


EXPECTED_PATH = re.compile(r"Expected a path but (\S+) either not accessible or invalid")
# A class given by class_path for an argument typed as a factory (``environment: Callable[[], Environment]``).
CALLABLE_CLASS = re.compile(r"expects a function or a callable class: (.+?)\. Got value: Namespace\(class_path='([^']+)'")
NOT_A_SUBCLASS = re.compile(r"Expected '[^']+' to be a subclass of <class '([^']+)'>")


def callable_class_problem(key: str, given: str, problem: str) -> str:
    """The one line for a class given by ``class_path`` to a factory argument: not a subclass of the base it must
    extend (what that base is and asks for), or a name its module does not have."""
    from rlhf_lightning.environments.environment import not_an_environment

    base = NOT_A_SUBCLASS.search(problem)
    module, _, attribute = given.rpartition(".")
    if base is not None and base.group(1) == "Environment":
        return f"{key}: {not_an_environment(given)}"
    if base is not None:
        return f"{key}: {given} is not a subclass of {base.group(1)}, as {key} requires"
    if "has no attribute" in problem:
        return f"{key}.class_path {given}: {module} has no {attribute!r}{suggestion(attribute, module_names(module))}"
    return f"{key}.class_path {given}: {problem}"


def unknown_class(key: str, given: str) -> str:
    """The one line for ``key`` given ``given``, a name that imports no class: a module that moved, a policy loss
    by an old name, or where classes of one's own must be."""
    module, _, attribute = given.rpartition(".")
    moved = moved_module(module)
    if moved is not None:
        return f"{key}: {given}: {module} moved to {moved}; write {moved}.{attribute}"
    if key.endswith(("policy_loss", "preference_loss")):
        from rlhf_lightning.algorithms.policy_losses import PolicyLoss
        from rlhf_lightning.algorithms.preference_losses import PreferenceLoss

        family = PolicyLoss if key.endswith("policy_loss") else PreferenceLoss
        names = list(family.registry)
        # A registered loss by its class name in any case, or by TRL's loss_type name (sigmoid_norm: SigmoidNorm)
        close = ([name for name in names if name.lower() in (given.lower(), given.lower().replace("_", ""))]
                 or difflib.get_close_matches(given, names, n=1))
        hint = f" (did you mean {close[0]}?)" if close else ""
        return (f"{key}: {given!r} is not a {family.family}{hint}; the registered ones are {', '.join(names)}, or "
                f"give the import path of a {family.__name__} subclass of your own")
    names = module_names(module) if module else []
    if names and attribute not in names:  # the module imports: the name is misspelled (`--model rlhf_lightning.GRPOO`)
        return f"{key}: {given!r}: {module} has no {attribute!r}{suggestion(attribute, names)}"
    return (f"{key}: {given!r} cannot be imported: a class or function of your own must be importable from where "
            "you run (its module in the current folder, or on PYTHONPATH)")


def class_problem(lines: list[str], path: list[str]) -> str | None:
    """The one line for a union report whose cause is a class given by ``class_path``: an argument it does not
    take (with the closest names it does, and TRL's name where the user took one from TRL), or a class that
    cannot be imported. None when the report is about something else."""
    for index, line in enumerate(lines):
        found = CLASS_PATH.search(line)
        if found is None:
            continue
        class_name = found.group(1)
        problem = next((rest.strip() for rest in lines[index + 1:] if rest.strip()), "")
        key = ".".join(path)
        unknown = UNKNOWN_OPTION.search(problem) or UNKNOWN_NESTED.search(problem)
        if unknown:
            name = unknown.group(1)
            if name.split(".")[1:2] in (["class_path"], ["init_args"]):  # environment.class_path: environment
                name = name.split(".")[0]
            accepted = accepted_arguments(class_name)
            # vllm.kv_cache_gib: vllm
            group, place = MOVED_INTO_GROUPS.get(name, MOVED_INTO_GROUPS.get(name.split(".")[0], (None, None)))
            fields = [new for new in MOVED_ARGUMENTS.values() if new.split(".")[0] in accepted]  # kl.coef...
            hint = f" (it moved: {place})" if group in accepted else suggestion(name, [*accepted, *fields])
            return (f"{key}.init_args.{name}: {class_name} takes no argument {name!r}{hint}; --{key}.help "
                    f"{class_name} lists them all")
        module, _, attribute = class_name.rpartition(".")
        moved = moved_module(module)
        if moved is not None:
            return f"{key}.class_path {class_name}: {module} moved to {moved}; write {moved}.{attribute}"
        if "has no attribute" in problem:
            return (f"{key}.class_path {class_name}: {module} has no {attribute!r}"
                    f"{suggestion(attribute, module_names(module))}")
        if "No module named" in problem or "does not have" in problem or "Unable to" in problem:
            return (f"{key}.class_path {class_name}: it cannot be imported ({problem.rstrip('.')}); a class of your "
                    f"own must be importable from where you run: {module}.py in the current folder, or its "
                    "folder on PYTHONPATH")
        return f"{key}: {class_name}: {problem}"
    return None


def accepted_arguments(class_path: str | type) -> list[str]:
    """Every argument ``class_path``'s constructor takes, as the command line reads it: its parents' included where
    it passes ``**kwargs`` up, less those it fixes itself in that call (online DPO's ``samples_per_prompt``).
    ``class_path``: the class's import path, or the class itself."""
    from rlhf_lightning.core.stage import constructor_arguments
    from rlhf_lightning.runs.resume import import_class

    cls = import_class(class_path) if isinstance(class_path, str) else class_path
    return [] if cls is None else constructor_arguments(cls)


def module_names(module: str) -> list[str]:
    """The public names of ``module`` (nothing when it cannot be imported)."""
    try:
        return [name for name in dir(importlib.import_module(module)) if not name.startswith("_")]
    except ImportError:
        return []


def suggestion(name: str, accepted: list[str]) -> str:
    """`` (did you mean kl.coef?)`` for a misspelled name, TRL's equivalent for a TRL name, or ``""``."""
    if name in TRL_NAMES:
        return f" (TRL's {name} is {TRL_NAMES[name]} here)"
    close = difflib.get_close_matches(name, accepted, n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close[:-1]) + ' or ' if len(close) > 1 else ''}{close[-1]}?)" if close else ""
