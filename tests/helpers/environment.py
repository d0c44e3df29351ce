"""The environment of a subprocess that imports this checkout: the repository first on ``PYTHONPATH``, the
caller's own entries kept after it (a machine whose packages live on ``PYTHONPATH``, such as a lent GPU's carried
wheels, keeps them)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def with_repo_on_path(**variables: str) -> dict[str, str]:
    """``os.environ`` with the repository prepended to ``PYTHONPATH``, then ``variables`` set."""
    inherited = os.environ.get("PYTHONPATH")
    path = str(REPO) if not inherited else os.pathsep.join([str(REPO), inherited])
    return {**os.environ, "PYTHONPATH": path, **variables}
