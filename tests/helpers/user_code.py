"""A user's own module, as a page tells them to write it: saved in a folder of the test's and imported by name."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


@contextlib.contextmanager
def user_module(folder: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Iterator[ModuleType]:
    """``source`` saved as ``folder/<name>.py`` and imported as ``name`` with ``folder`` on ``sys.path`` (as a
    config's import path finds it); forgotten again afterwards, so the next test imports its own."""
    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop(name, None)
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)
