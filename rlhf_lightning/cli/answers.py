"""Kept answers: what ``--help`` and ``--print_config`` printed, kept so that the same question is answered again
without the training stack.

Those answers come from LightningCLI's parser, which reads every model, data and trainer class, so building them
imports torch, Lightning, transformers and peft (12-15 s on a 2-core machine). They depend only on what the key
below holds: the command line, the config files' text, the terminal's width, the working folder, this package's
source files and the versions of the libraries that shape the parser. When any of those changes the answer is
built afresh. A command line that names a class outside this package and the libraries (``--model
mypkg.MyPPO``) is never kept: its answer depends on the user's files.

The answers live under ``$RLHF_LIGHTNING_CACHE`` (default ``$XDG_CACHE_HOME/rlhf_lightning`` or
``~/.cache/rlhf_lightning``); ``RLHF_LIGHTNING_CACHE=off`` turns keeping off."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

import yaml

from rlhf_lightning.cli.errors import config_files

# The libraries whose classes and versions make the parser (and so its help and printed configs).
LIBRARIES = ("jsonargparse", "lightning", "torch", "transformers", "peft", "torchmetrics")
PACKAGE = Path(__file__).resolve().parents[1]
DOTTED = re.compile(r"^([A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)+$")
OURS = frozenset({"rlhf_lightning", *LIBRARIES})
KEPT_AT_MOST = 256  # answers; the oldest go first


def asks_to_print(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a question the parser answers by printing and exiting: ``--help``/``-h``, a class's
    ``--model.help``, ``--print_config``."""
    return any(argument in ("-h", "--help") or argument.startswith("--print_config")
               or (argument.startswith("--") and argument.split("=", 1)[0].endswith(".help")) for argument in argv)


def cache_folder() -> Path | None:
    """Where kept answers live, or None when keeping is off."""
    chosen = os.environ.get("RLHF_LIGHTNING_CACHE")
    if chosen is not None and chosen.strip().lower() in ("off", "0", "no", "false", ""):
        return None
    if chosen:
        return Path(chosen) / "answers"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "rlhf_lightning" / "answers"


def strings(value: Any) -> Iterator[str]:
    """Every string inside a parsed YAML value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def names_outside(values: Iterator[str]) -> bool:
    """Whether any value is the import path of a module that is neither this package nor one of the libraries."""
    for value in values:
        match = DOTTED.match(value.strip())
        if match and match.group(1) not in OURS and importlib.util.find_spec(match.group(1)) is not None:
            return True
    return False


def package_fingerprint() -> list[tuple[str, int, int]]:
    """This package's source files with their sizes and modification times."""
    return sorted((str(path.relative_to(PACKAGE)), stat.st_size, stat.st_mtime_ns)
                  for path in PACKAGE.rglob("*.py") for stat in [path.stat()])


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def answer_key(argv: Sequence[str]) -> str | None:
    """The key of ``argv``'s answer, or None when it must not be kept (it names a user's class, or a file cannot be
    read)."""
    texts = {}
    for path in config_files(list(argv)):
        try:
            texts[str(path)] = Path(str(path)).read_text()
            parsed = yaml.safe_load(texts[str(path)])
        except (OSError, yaml.YAMLError):
            return None
        if names_outside(strings(parsed)):
            return None
    values = [argument.split("=", 1)[-1] for argument in argv]
    if names_outside(iter(values)):
        return None
    for argument in values:  # a value that is a file (``--model my_model.yaml``) answers by its text
        if argument not in texts and os.path.isfile(argument):
            texts[argument] = Path(argument).read_text(errors="replace")
    described = {
        "argv": list(argv), "files": texts, "cwd": os.getcwd(), "columns": shutil.get_terminal_size().columns,
        "python": [sys.executable, sys.version], "libraries": library_versions(), "package": package_fingerprint(),
        "environment": {name: value for name, value in os.environ.items() if name.startswith("JSONARGPARSE_")},
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def kept_answer(argv: Sequence[str]) -> str | None:
    """The kept answer to ``argv``, or None."""
    folder = cache_folder()
    if folder is None or not asks_to_print(argv):
        return None
    key = answer_key(argv)
    if key is None:
        return None
    try:
        return (folder / f"{key}.txt").read_text()
    except OSError:
        return None


class Tee(io.TextIOBase):
    """Writes through to ``stream`` and keeps a copy."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


@contextmanager
def keeping_the_answer(argv: Sequence[str]) -> Iterator[None]:
    """Run the body with standard output copied; when ``argv`` is a question (:func:`asks_to_print`) and the body
    ends with status 0, keep what it printed for :func:`kept_answer`."""
    folder = cache_folder()
    key = answer_key(argv) if folder is not None and asks_to_print(argv) else None
    if key is None:
        yield
        return
    original, tee = sys.stdout, Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield
    except SystemExit as exit:
        if exit.code in (None, 0):
            keep(folder, key, tee.copy.getvalue())
        raise
    else:
        keep(folder, key, tee.copy.getvalue())
    finally:
        sys.stdout = original


def keep(folder: Path, key: str, answer: str) -> None:
    if not answer:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{key}.{os.getpid()}.partial"
        partial.write_text(answer)
        partial.replace(folder / f"{key}.txt")  # whole or not at all, however many commands answer at once
        kept = sorted(folder.glob("*.txt"), key=lambda path: path.stat().st_mtime_ns)
        for old in kept[:-KEPT_AT_MOST]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home: the answer is built again next time
