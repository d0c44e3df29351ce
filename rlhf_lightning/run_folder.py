"""Where a run writes, in one setting, and the refusal to write over another run there.

A run's files follow Lightning's ``trainer.default_root_dir``, the *run folder* (the shipped configs set it to
``outputs/<stage>``): checkpoints go to ``<run folder>/checkpoints`` (our checkpoint callbacks without a
``dirpath``), the W&B run to ``<run folder>/wandb`` (our ``WandbLogger`` without a ``save_dir``) and the exported
models to ``<run folder>/<export_dir>`` (a relative ``export_dir``; an absolute one is used as it is). Moving a run
elsewhere is one override: ``--trainer.default_root_dir=outputs/my-run``.

A ``fit`` that would write over another run's exports or checkpoints stops before it starts, with one line naming
them and the two ways on: ``--ckpt_path last`` continues that run in its folder, another
``--trainer.default_root_dir`` starts this one elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def export_path(trainer: Any, export_dir: str | None) -> Path | None:
    """The folder ``export_dir`` names: under the run folder when relative, as given when absolute; None when
    there is no export."""
    if not export_dir:
        return None
    path = Path(export_dir).expanduser()
    if path.is_absolute() or trainer is None:
        return path
    return Path(trainer.default_root_dir) / path


def checkpoint_folders(trainer: Any) -> list[Path]:
    """The folders the Trainer's checkpoint callbacks write into."""
    return [Path(callback.dirpath) for callback in getattr(trainer, "checkpoint_callbacks", [])
            if getattr(callback, "dirpath", None)]


def another_runs_files(trainer: Any, export: Path | None) -> list[str]:
    """What a new fit would write over: a non-empty export folder, checkpoint folders holding checkpoints."""
    found = []
    if export is not None and export.is_dir() and any(export.iterdir()):
        found.append(f"{export} (exports)")
    for folder in checkpoint_folders(trainer):
        checkpoints = sorted(folder.glob("*.ckpt")) if folder.is_dir() else []
        if checkpoints:
            found.append(f"{folder} ({len(checkpoints)} checkpoint{'s' if len(checkpoints) > 1 else ''})")
    return found


def refuse_overwrite(trainer: Any, export: Path | None) -> None:
    """Stop a fresh fit (no ``--ckpt_path``) whose run folder already holds another run's files."""
    found = another_runs_files(trainer, export)
    if found:
        raise FileExistsError(
            f"run folder {trainer.default_root_dir} already holds a run: {', '.join(found)}; continue that run with "
            "--ckpt_path last, or give this one its own folder with --trainer.default_root_dir=DIR (or remove "
            "those files)")
