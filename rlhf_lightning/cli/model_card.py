"""The model card of an export: what trained it, on what, with which command and hyper-parameters, when, with
which version of the package, how long it took, and with what result; and the card of a merged model.

peft writes an empty template (``README.md`` with "[More Information Needed]") beside the adapters it saves; the
command line replaces it, and writes the same card beside SFT's merged model, once the fit has exported.
``python -m rlhf_lightning merge`` writes a card beside the model it merges (:func:`merge_card`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

from rlhf_lightning.callbacks.progress_lines import duration, held_out, metric_text
from rlhf_lightning.callbacks.run_report import RunReport
from rlhf_lightning.callbacks.run_shape import batches_done
from rlhf_lightning.core.offline import OfflinePreference
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.runs.resume import class_path
from rlhf_lightning.stages.sft import SFT

CARD = "README.md"
PACKAGE = "rlhf-lightning"  # the distribution's name (pyproject.toml)


def package_version() -> str:
    """The installed version of the package, ``unknown`` when it runs from a folder that was not installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def made_on(today: datetime.date | None = None) -> str:
    """``- **Made**: 2026-11-25 with rlhf_lightning 0.1.0``: the card's date and the package's version."""
    return f"- **Made**: {(today or datetime.date.today()).isoformat()} with rlhf_lightning {package_version()}"


def plain(value: Any) -> Any:
    """``value`` as YAML data: mappings, lists and scalars as they are, a dataclass as its fields, any other
    object as its class's import path (a reward function object, say)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Path):
        return str(value)
    return public_name(value if isinstance(value, type) else type(value))


def hyperparameters_block(settings: Mapping[str, Any]) -> str:
    """The model's arguments as a compact YAML block (a short list or mapping on one line), keys sorted."""
    return yaml.safe_dump(plain(settings), sort_keys=True, default_flow_style=None, width=110).rstrip()


POLICY_STAGES = (OnlineRL, OfflinePreference)  # the stages that optimise a policy (the module's policy part)


def change_label(module: Any) -> str:
    """What the card compares the last validation with: the starting policy for the policy stages, the base
    model for SFT, the untrained head for a reward model (which has no policy)."""
    if isinstance(module, POLICY_STAGES):
        return "Change from the starting policy"
    if isinstance(module, SFT):
        return "Change from the base model (its validation before the first step)"
    return "Change from the untrained head (its validation before the first step)"


def fit_seconds(trainer: L.Trainer) -> float | None:
    """The fit's wall time in seconds, as :class:`RunReport` measured it (None without one)."""
    return next((callback.fit_seconds for callback in trainer.callbacks
                 if isinstance(callback, RunReport) and callback.fit_seconds is not None), None)


def command_line(argv: Sequence[str]) -> str:
    """The command as a user would type it again: ``python -m rlhf_lightning fit --config ...``."""
    return "python -m rlhf_lightning " + " ".join(shlex.quote(word) for word in argv)


def public_name(cls: type) -> str:
    """``rlhf_lightning.PPO`` for a class the package exports at its top, else its full import path."""
    import rlhf_lightning

    return f"rlhf_lightning.{cls.__name__}" if getattr(rlhf_lightning, cls.__name__, None) is cls else class_path(cls)


def hardware(trainer: L.Trainer) -> str:
    """``- **Hardware**: cpu, 1 device x 1 node, 2 CPU threads per process``: what the run ran on, the thread count
    included (``torch.get_num_threads()``: a CPU run's reductions, and so its numbers, depend on it)."""
    device = trainer.strategy.root_device.type
    devices, nodes = trainer.num_devices, trainer.num_nodes
    return (f"- **Hardware**: {device}, {devices} device{'s' if devices != 1 else ''} x {nodes} "
            f"node{'s' if nodes != 1 else ''}, {torch.get_num_threads()} CPU thread"
            f"{'s' if torch.get_num_threads() != 1 else ''} per process")


def model_card(trainer: L.Trainer, module: Any, argv: Sequence[str], change: str = "",
               data_settings: dict[str, Any] | None = None, model_settings: Mapping[str, Any] | None = None) -> str:
    """The card's text (YAML front matter as the hub reads it, then the run's facts); ``data_settings``: the data
    module's arguments (its scalar ones are listed); ``model_settings``: the model's arguments as the config
    resolved them (default: the module's saved hyper-parameters)."""
    base = str(module.base_spec.name_or_path)
    datamodule = trainer.datamodule
    data_settings = {key: value for key, value in (data_settings or {}).items()
                     if isinstance(value, str | int | float | bool)}
    done = batches_done(trainer)
    unit = "batches" if module.automatic_optimization else "iterations"
    roles = sorted(path.name for path in Path(module.export_folder).iterdir() if path.is_dir())
    built_from_config = module.base_spec.name_or_path is None  # a base built from an architecture: no folder
    lines = [
        "---",
        *([] if built_from_config else [f"base_model: {base}"]),
        "library_name: peft" if roles else "library_name: transformers",
        "tags:",
        "- rlhf_lightning",
        f"- {module.metric_prefix}",
        "---",
        "",
        f"# {module.metric_prefix}: trained with rlhf_lightning",
        "",
        f"- **Stage**: `{public_name(type(module))}`, {done} {unit}, {trainer.global_step} optimizer steps",
        ("- **Base model**: built from its architecture" if built_from_config else f"- **Base model**: `{base}`")
        + (f"; adapters here: {', '.join(f'`{r}/`' for r in roles)}" if roles else ""),
        ("- **Data**: dataloaders given to `fit`" if datamodule is None else f"- **Data**: `{public_name(type(datamodule))}`")
        + (" (" + ", ".join(f"{key}: {value}" for key, value in data_settings.items()) + ")" if data_settings else ""),
        f"- **Command**: `{command_line(argv)}`",
        f"- **Run folder**: `{trainer.default_root_dir}` (its `config.yaml` is the fully resolved config)",
    ]
    seconds = fit_seconds(trainer)
    if seconds is not None:
        lines.append(f"- **Wall time**: {duration(seconds)}" + (" (since the fit resumed)" if trainer.ckpt_path else ""))
    lines.append(hardware(trainer))
    lines.append(made_on())
    result = held_out(trainer.callback_metrics)
    accuracy = {name: value for name, value in result.items() if name.endswith("accuracy")}
    if accuracy and not isinstance(module, (*POLICY_STAGES, SFT)):  # what a reward model is judged by
        lines.append(f"- **Held-out accuracy**: {metric_text(accuracy)} (share of held-out pairs it orders as "
                     "labelled" + ("; gold_accuracy: as the noise-free gold reward orders them)"
                                   if any("gold" in name for name in accuracy) else ")"))
    if result:
        lines.append(f"- **Result** (the last validation): {metric_text(result)}")
    if change:
        lines.append(f"- **{change_label(module)}**: {change}")
    settings = {key: value for key, value in (module.hparams if model_settings is None else model_settings).items()
                if not str(key).startswith("_")}  # LightningCLI's own entries (_class_path, _instantiator)
    if settings:
        source = ("as the config resolved them: `model.init_args` of the run folder's `config.yaml`"
                  if model_settings is not None else "its saved hyper-parameters; the run folder's `config.yaml` "
                  "holds the whole config")
        lines += ["", "## Hyper-parameters", "", f"The model's arguments ({source}):", "",
                  "```yaml", hyperparameters_block(settings), "```"]
    return "\n".join(lines) + "\n"


def write_model_card(trainer: L.Trainer, module: Any, argv: Sequence[str] | None = None, change: str = "",
                     data_settings: dict[str, Any] | None = None,
                     model_settings: Mapping[str, Any] | None = None) -> Path:
    """Write the card into the module's export folder (over peft's template); returns its path."""
    path = Path(module.export_folder) / CARD
    path.write_text(model_card(trainer, module, sys.argv[1:] if argv is None else argv, change, data_settings,
                               model_settings))
    return path


def merge_card(adapter: str | Path, base: str, argv: Sequence[str]) -> str:
    """The card of a merged model: which adapter was folded into which base, by which command, when, and, from
    the adapter's own card (beside it, or in its parent folder, where the command line writes it), how the
    adapter was trained."""
    adapter = Path(adapter)
    lines = ["---", f"base_model: {base}", "library_name: transformers", "tags:", "- rlhf_lightning", "- merged", "---",
             "", "# A merged model, made with rlhf_lightning", "",
             f"- **Merged**: the LoRA adapter `{adapter}` folded into its base `{base}` (a standalone transformers "
             "model: `AutoModelForCausalLM.from_pretrained` reads it without peft)",
             f"- **Command**: `{command_line(argv)}`", made_on()]
    # Ours, not peft's empty template (which the command line replaces; a Python run may leave it).
    trained = next((folder / CARD for folder in (adapter, adapter.parent) if (folder / CARD).is_file()
                    and "More Information Needed" not in (folder / CARD).read_text()), None)
    facts = [line for line in trained.read_text().splitlines() if line.startswith("- **")] if trained else []
    if facts:
        lines += ["", f"## How the adapter was trained (from `{trained}`)", "", *facts]
    return "\n".join(lines) + "\n"
