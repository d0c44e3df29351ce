"""Where a run writes, in one setting, and the refusal to write over another run there.

A run's files follow Lightning's ``trainer.default_root_dir``, the *run folder* (the shipped configs set it to
``outputs/<stage>``): checkpoints go to ``<run folder>/checkpoints`` (our checkpoint callbacks without a
``dirpath``), the W&B run to ``<run folder>/wandb`` (our ``WandbLogger`` without a ``save_dir``) and the exported
models to ``<run folder>/<export_dir>`` (a relative ``export_dir``; an absolute one is used as it is). Moving a run
elsewhere is one override: ``--trainer.default_root_dir=outputs/my-run``.

A ``fit`` that would write over another run's exports or checkpoints stops before it starts, with one line naming
them and the two ways on: ``--ckpt_path last`` continues that run in its folder, another
``--trainer.default_root_dir`` starts this one elsewhere. So does a ``fit`` whose run folder, checkpoint folder or
export folder could not take its files (not writable, or a file where a folder must be): the export is written at
the very end, and a fit should not run for hours to lose its result at the last step.
"""

from __future__ import annotations

import os
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


def shown_folder(trainer: Any, folder: Path) -> Path:
    """``folder`` as a line shows it: under the run folder as the user wrote it (a checkpoint callback resolves its
    folder to an absolute path: ``outputs/ppo/checkpoints`` is shown, not ``/home/.../outputs/ppo/checkpoints``)."""
    root = Path(trainer.default_root_dir)
    try:
        return root / Path(os.path.realpath(folder)).relative_to(os.path.realpath(root))
    except ValueError:
        return folder


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
            found.append(f"{shown_folder(trainer, folder)} ({len(checkpoints)} checkpoint"
                         f"{'s' if len(checkpoints) > 1 else ''})")
    return found


def earlier_run(trainer: Any, export: Path | None) -> list[str]:
    """What shows that a run already ran in the run folder: exports, W&B runs."""
    found = [f"{export} (exports)"] if export is not None and export.is_dir() and any(export.iterdir()) else []
    runs = sorted(Path(trainer.default_root_dir).glob("wandb/*run-*/run-*.wandb"))
    if runs:
        found.append(f"{Path(trainer.default_root_dir) / 'wandb'} ({len(runs)} W&B run{'s' if len(runs) > 1 else ''})")
    return found


def resume_without_checkpoint(trainer: Any, export: Path | None) -> None:
    """``--ckpt_path last`` that found no checkpoint: refused in a run folder that holds a run (continuing it is
    impossible, and starting from zero behind its back would mix two runs); in an empty or missing folder (a job's
    first start under SLURM, whose requeued starts continue; or a misspelt folder) a new run starts, and one line
    says so and where."""
    found = earlier_run(trainer, export)
    folder = Path(trainer.default_root_dir)
    if found:
        raise FileNotFoundError(
            f"--ckpt_path last: run folder {folder} holds a run ({', '.join(found)}) but no "
            "checkpoint to continue it from (it stopped before its first); start afresh in another folder with "
            "--trainer.default_root_dir=DIR, or remove those files to start afresh there")
    if getattr(trainer, "is_global_zero", True):
        state = "holds no run" if folder.is_dir() else "does not exist"
        print(f"--ckpt_path last: no checkpoint to resume from (run folder {folder} {state}): a new run starts "
              f"there", flush=True)


# What the command line writes into a run folder before anything runs (LightningCLI's saved config).
SAVED_CONFIG = "config.yaml"


def holds_files(folder: Path) -> bool:
    """Whether ``folder`` (or a folder under it) holds a file besides the saved config."""
    return folder.is_dir() and any(path.is_file() and path != folder / SAVED_CONFIG for path in folder.rglob("*"))


def remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` when nothing under it is a file but the saved config (a fit that failed before writing
    anything leaves no run folder behind)."""
    if folder.is_dir() and not holds_files(folder):
        (folder / SAVED_CONFIG).unlink(missing_ok=True)
        for path in sorted(folder.rglob("*"), key=lambda path: len(path.parts), reverse=True):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
        folder.rmdir()


def refuse_overwrite(trainer: Any, export: Path | None) -> None:
    """Stop a fresh fit (no ``--ckpt_path``) whose run folder already holds another run's files."""
    found = another_runs_files(trainer, export)
    if found:
        raise FileExistsError(
            f"run folder {trainer.default_root_dir} already holds a run: {', '.join(found)}; continue that run with "
            "--ckpt_path last, or give this one its own folder with --trainer.default_root_dir=DIR (or remove "
            "those files)")


def why_unwritable(folder: Path) -> tuple[type[OSError], str] | None:
    """Why files cannot be written into ``folder`` (made when missing, with its missing parents), as the error
    to raise and the reason; None when they can. Permissions are the process's own (root's included)."""
    if folder.exists():
        if not folder.is_dir():
            return NotADirectoryError, "is a file, not a folder"
        return None if os.access(folder, os.W_OK | os.X_OK) else (PermissionError, "is not writable")
    existing = folder.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return NotADirectoryError, f"cannot be made ({existing} is a file)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return PermissionError, f"cannot be made ({existing} is not writable)"
    return None


def refuse_unwritable(trainer: Any, export: Path | None) -> None:
    """Stop a fit before anything is built whose files could not be written: the run folder (the resolved config,
    checkpoints and logs go there from the start), the checkpoint callbacks' folders, the export folder (written at
    the end of the fit). One line names the folder, what is wrong, and the setting that moves it."""
    folders = [(Path(trainer.default_root_dir), "run folder", "the fit writes its config, checkpoints and logs there",
                "--trainer.default_root_dir=DIR")]
    folders += [(folder, "checkpoint folder", "the fit writes its checkpoints there",
                 "the checkpoint callback's dirpath") for folder in checkpoint_folders(trainer)]
    if export is not None:
        folders.append((export, "export folder", "the fit writes the trained model there at its end",
                        "--model.init_args.export_dir=DIR"))
    for folder, what, use, setting in folders:
        problem = why_unwritable(folder)
        if problem is not None:
            error, reason = problem
            remedy = "make it writable" if error is PermissionError else "move that file away"
            raise error(f"{what} {shown_folder(trainer, folder)} {reason}: {use}; {remedy}, or give another with "
                        f"{setting}")
