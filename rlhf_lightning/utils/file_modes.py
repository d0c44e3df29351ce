"""Exported files readable by the people a machine is shared with, as the user's umask allows."""

from __future__ import annotations

import os
from pathlib import Path


def readable_as_umask_allows(folder: str | Path) -> None:
    """Give the files under ``folder`` the permissions a new file gets (``0o666`` less the umask, as ``open``
    gives): safetensors writes its files ``0o600``, which another user of a shared machine (a colleague, a serving
    account) cannot read."""
    mask = os.umask(0)
    os.umask(mask)  # read without changing it: umask can only be read by setting it
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)
