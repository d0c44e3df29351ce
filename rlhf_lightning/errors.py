"""Our own errors reach the user as one line, not under the parser's or the Trainer's traceback.

A ``ValueError``/``TypeError``/``FileNotFoundError``/``KeyError`` (``DataFormatError`` and ``CheckpointError`` are
``ValueError``) that a ``raise`` statement of this package threw is a message written for the user: it names the
file, row, key or argument and what was expected. jsonargparse wraps an error raised in a module's
constructor into a ~150-line "Does not validate against any of the Union subtypes" report; the message the
user needs is the innermost cause from this package. Anything else (a bug, a library's error) keeps its full
traceback. ``RLHF_LIGHTNING_TRACEBACK=1`` shows the full traceback of every error.
"""

from __future__ import annotations

import linecache
import os
import re
from pathlib import Path
from types import TracebackType

import yaml

TRACEBACK_ENV = "RLHF_LIGHTNING_TRACEBACK"
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, KeyError)
PACKAGE = Path(__file__).resolve().parent
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


def one_line(error: BaseException) -> str:
    """``error: <message>``, the line printed for a user error (a ``KeyError``'s quotes dropped)."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return f"error: {message}"


def config_files(argv: list[str]) -> list[str]:
    """The files given to ``--config``/``-c`` in ``argv``."""
    files = []
    for index, argument in enumerate(argv):
        if argument in ("--config", "-c") and index + 1 < len(argv):
            files.append(argv[index + 1])
        elif argument.startswith("--config="):
            files.append(argument.split("=", 1)[1])
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


def condense_parser_error(message: str) -> str:
    """jsonargparse's report of a bad value, down to one line: the full key as typed on the command line and
    the innermost problem, e.g. ``model.init_args.lr: Expected a <class 'float'>. Got value: abc``.

    The report nests ``Parser key "k":`` blocks, one level per group or class (with ``Problem with given
    class_path`` where a subclass's ``init_args`` start) inside "Does not validate against any of the Union
    subtypes" lists; a message without that shape comes back unchanged.
    """
    lines = message.splitlines()
    path: list[str] = []
    depth, in_class, detail = -1, False, ""
    for index, line in enumerate(lines):
        if CLASS_PATH.search(line):
            in_class = True  # the next key is one of the subclass's init_args
            continue
        key = PARSER_KEY.match(line)
        if key is None:
            continue
        if len(key.group(1)) <= depth:
            break  # a sibling report (another union member): the deepest chain is complete
        depth = len(key.group(1))
        path += ["init_args", key.group(2)] if path and in_class else [key.group(2)]
        in_class = False
        detail = next((rest.strip() for rest in lines[index + 1:] if rest.strip()), "")
    if not path or not detail or PARSER_KEY.match(detail):
        return message if len(lines) < 2 else lines[0]
    return f"{'.'.join(path)}: {detail}"
