"""Checkpoint files that are either complete or absent: written beside their final name, then renamed."""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

log = logging.getLogger(__name__)

# Temp files are named `.<final name>.tmp-<pid>`: hidden, never matched by `*.ckpt` (so never taken for a
# checkpoint by Lightning's "last" lookup), and recognisable as leftovers of a crashed write.
TEMP_MARKER = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: missing, cut short, corrupt or from another run."""


def temp_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: the same folder, so the rename is atomic."""
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}")


def is_leftover(path: Path) -> bool:
    """Whether ``path`` is the temp file of a checkpoint write (``.<name>.ckpt.tmp-<pid>``)."""
    return path.name.startswith(".") and TEMP_MARKER in path.name


def remove_leftovers(folder: Path, keep: Path | None = None) -> list[Path]:
    """Delete the temp files that interrupted writes left in ``folder`` (all but ``keep``); returns them."""
    removed = []
    for path in folder.glob(f".*{TEMP_MARKER}*"):
        if path != keep and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("removed %d leftover(s) of interrupted checkpoint writes in %s", len(removed), folder)
    return removed


def fsync_folder(folder: Path) -> None:
    """Make a rename inside ``folder`` durable (its directory entry reaches the disk)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` with ``write(file)`` so that a crash at any moment leaves either the old file or the new.

    The bytes go to a temp file in the destination folder (a temp folder on another filesystem would turn the
    final rename into a copy that can be cut short), are flushed and fsynced, then ``os.replace`` swaps the
    file in and the folder is fsynced. Leftovers of earlier interrupted writes in the folder are removed
    first; an error during the write (a full disk) removes its own temp file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(path)
    remove_leftovers(path.parent)
    try:
        with open(temp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)  # kill -9 never gets here: its leftover goes at the next save
        raise
    fsync_folder(path.parent)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a complete checkpoint file, or None when it is.

    Reads the whole file once: ``torch.save`` writes a zip archive whose central directory is at the end (a
    file cut short has none) and whose members carry CRC-32 checksums (flipped bytes fail them). Cheaper than
    unpickling and safe on untrusted files.
    """
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if path.is_dir():
        return "it is a folder (sharded checkpoints are not checked here)"
    try:
        with zipfile.ZipFile(path) as archive:
            broken = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        size = path.stat().st_size
        return f"it is cut short or not a torch checkpoint ({size} bytes; {error})"
    if broken is not None:
        return f"it is corrupt (checksum of {broken} does not match)"
    return None


def check_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming ``path`` unless it is a complete checkpoint file."""
    problem = checkpoint_problem(path)
    if problem is not None:
        if problem == "it does not exist":
            raise FileNotFoundError(f"checkpoint {path}: it does not exist")
        raise CheckpointError(f"checkpoint {path}: {problem}{_alternatives(Path(path))}")


def readable_checkpoints(folder: str | Path) -> list[Path]:
    """The complete ``*.ckpt`` files in ``folder``, newest first (by modification time)."""
    files = sorted(Path(folder).glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    return [path for path in files if path.is_file() and checkpoint_problem(path) is None]


def _alternatives(path: Path) -> str:
    others = [p for p in readable_checkpoints(path.parent) if p != path] if path.parent.is_dir() else []
    return f"; the newest complete checkpoint beside it is {others[0]}" if others else ""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic local writes and loads that name the file when it fails.

    Remote paths (``s3://``...) go through Lightning's own writer unchanged.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_write(path, lambda file: self.write(checkpoint, file))

    def write(self, checkpoint: dict[str, Any], file: BinaryIO) -> None:
        """Serialise ``checkpoint`` into the open temp ``file``."""
        torch.save(checkpoint, file)

    def load_checkpoint(self, path: _PATH, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if isinstance(get_filesystem(path), LocalFileSystem) and not Path(path).is_dir():
            check_checkpoint(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
