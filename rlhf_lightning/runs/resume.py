"""Resuming from a checkpoint under the config the user gave: same module class, differences listed.

LightningCLI, given ``--ckpt_path``, replaces the config's model arguments with the ones saved in the
checkpoint, silently: a reward-stage checkpoint turned a PPO run into a reward-model run, and a resumed run
exported into the ``export_dir`` of the run that wrote the checkpoint. Here the config wins, always — what is
typed is what runs, and what the W&B run records — and every model argument that differs from the
checkpoint's is listed in one warning, so a resume that does not continue the same run never goes unnoticed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf_lightning.utils.atomic_io import CheckpointError, check_checkpoint

# The checkpoint key that records which LightningModule wrote it (StageModule.on_save_checkpoint).
CLASS_KEY = "rlhf_lightning_module_class"
# Keys LightningCLI adds to the saved hyper-parameters for its own use.
INTERNAL_HPARAMS = {"_class_path", "_instantiator"}


def class_path(cls: type) -> str:
    """``module.QualifiedName`` of ``cls``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def import_class(path: str) -> type | None:
    """The class named by a dotted ``path`` (``rlhf_lightning.PPO``), or None when it cannot be imported."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def class_mismatch(ckpt_path: str | Path, saved_class: str | None, model_class: type) -> str | None:
    """The one-line refusal when a checkpoint written by ``saved_class`` cannot resume a ``model_class``, else
    None. A subclass may resume its parent's checkpoint (a researcher's variant of PPO continuing a PPO run)."""
    if not saved_class:
        return None
    saved = import_class(saved_class)
    if saved is not None and issubclass(model_class, saved):
        return None
    shown = class_path(saved) if saved is not None else saved_class
    return (f"checkpoint {ckpt_path} was written by {shown}, but this run's model is {class_path(model_class)}; "
            f"give a checkpoint of a {model_class.__name__} run, or the config of the run that wrote it")


def saved_class_of(checkpoint: dict[str, Any]) -> str | None:
    """The module class recorded in a loaded checkpoint (ours, else LightningCLI's ``_class_path``)."""
    return checkpoint.get(CLASS_KEY) or (checkpoint.get("hyper_parameters") or {}).get("_class_path")


def load_for_comparison(ckpt_path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``ckpt_path``, checked first (a broken file is named in the error); tensors are
    memory-mapped, not read."""
    check_checkpoint(ckpt_path)
    try:
        return torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # weights_only refuses a pickled object; the file is the user's own run's
        if "weights_only" not in str(error):
            raise CheckpointError(f"checkpoint {ckpt_path}: cannot be read ({error})") from error
        return torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)


def saved_state_keys(ckpt_path: str | Path) -> set[str]:
    """The weight names in the checkpoint at ``ckpt_path`` (memory-mapped: no tensor is read)."""
    return set(load_for_comparison(ckpt_path).get("state_dict", {}))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _compare(saved: Any, given: Any, key: str, out: list[str]) -> None:
    if isinstance(saved, dict) and isinstance(given, dict):
        for name in given:
            if name in saved:  # what the checkpoint lacks (arguments its module left out of hparams) is not compared
                _compare(saved[name], given[name], f"{key}.{name}", out)
    elif saved != given and not _same_number(saved, given):
        out.append(f"{key}: checkpoint {saved!r}, config {given!r}")


def hparam_differences(saved: dict[str, Any], given: dict[str, Any], prefix: str = "model.init_args") -> list[str]:
    """``key: checkpoint X, config Y`` for every argument of ``given`` (the config's ``init_args``) whose
    value differs from the checkpoint's saved hyper-parameters ``saved``, nested keys dotted as on the command
    line."""
    out: list[str] = []
    _compare(_plain({k: v for k, v in saved.items() if k not in INTERNAL_HPARAMS}), _plain(given), prefix, out)
    return out


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and float(a) == float(b)


def differences_warning(ckpt_path: str | Path, lines: list[str]) -> str:
    """The warning that lists the differences (empty when there are none)."""
    if not lines:
        return ""
    return (f"checkpoint {ckpt_path} was saved with other model arguments than the config; the config's are used "
            f"(outputs go where the config says):\n  " + "\n  ".join(lines))


def finished_run(checkpoint: dict[str, Any], max_epochs: int | None, max_steps: int) -> str | None:
    """Why the run saved in ``checkpoint`` has nothing left to train under these bounds (Lightning's: either one
    stops a fit), as a short text; None when a fit from it would train."""
    steps = int(checkpoint.get("global_step", 0))
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs = int(((fit_loop.get("epoch_progress") or {}).get("total") or {}).get("completed", 0))
    if max_steps is not None and max_steps >= 0 and steps >= max_steps:
        return f"trainer.max_steps={max_steps} reached after {steps} optimizer step{'s' if steps != 1 else ''}"
    if max_epochs is not None and max_epochs >= 0 and epochs >= max_epochs:
        return f"trainer.max_epochs={max_epochs} reached after {epochs} epoch{'s' if epochs != 1 else ''}"
    return None


def last_checkpoint(trainer: Any, subcommand: str) -> str | None:
    """``--ckpt_path last`` resolved as Lightning resolves it (the checkpoint callbacks' last files), or None,
    without Lightning's hint to set ``save_last`` when there is none: the command line says what happens then."""
    from lightning.pytorch.trainer.states import TrainerFn

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r'.*ckpt_path="last"\) is set, but there is no last checkpoint')
        return trainer._checkpoint_connector._parse_ckpt_path(TrainerFn(subcommand), "last", model_provided=True,
                                                              model_connected=False)


@contextlib.contextmanager
def quiet_resume(ckpt_path: str | Path | None) -> Iterator[None]:
    """While a fit runs: with a ``ckpt_path`` (a resumed run), without Lightning's warning that the checkpoint
    folder exists and is not empty (it holds the run's own checkpoints, as it should); a fresh fit keeps it."""
    with warnings.catch_warnings():
        if ckpt_path:
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        yield
