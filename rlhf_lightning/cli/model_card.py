"""The model card of an export: what trained it, on what, with which command, and with what result.

peft writes an empty template (``README.md`` with "[More Information Needed]") beside the adapters it saves; the
command line replaces it, and writes the same card beside SFT's merged model, once the fit has exported.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L

from rlhf_lightning.callbacks.progress_lines import held_out, metric_text
from rlhf_lightning.callbacks.run_shape import batches_done
from rlhf_lightning.runs.resume import class_path

CARD = "README.md"


def command_line(argv: Sequence[str]) -> str:
    """The command as a user would type it again: ``python -m rlhf_lightning fit --config ...``."""
    return "python -m rlhf_lightning " + " ".join(shlex.quote(word) for word in argv)


def public_name(cls: type) -> str:
    """``rlhf_lightning.PPO`` for a class the package exports at its top, else its full import path."""
    import rlhf_lightning

    return f"rlhf_lightning.{cls.__name__}" if getattr(rlhf_lightning, cls.__name__, None) is cls else class_path(cls)


def model_card(trainer: L.Trainer, module: Any, argv: Sequence[str], change: str = "",
               data_settings: dict[str, Any] | None = None) -> str:
    """The card's text (YAML front matter as the hub reads it, then the run's facts); ``data_settings``: the data
    module's arguments (its scalar ones are listed)."""
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
        f"- **Data**: `{public_name(type(datamodule))}`" + (
            " (" + ", ".join(f"{key}: {value}" for key, value in data_settings.items()) + ")" if data_settings else ""),
        f"- **Command**: `{command_line(argv)}`",
        f"- **Run folder**: `{trainer.default_root_dir}` (its `config.yaml` is the fully resolved config)",
    ]
    result = held_out(trainer.callback_metrics)
    if result:
        lines.append(f"- **Result** (the last validation): {metric_text(result)}")
    if change:
        lines.append(f"- **Change from the starting policy**: {change}")
    return "\n".join(lines) + "\n"


def write_model_card(trainer: L.Trainer, module: Any, argv: Sequence[str] | None = None, change: str = "",
                     data_settings: dict[str, Any] | None = None) -> Path:
    """Write the card into the module's export folder (over peft's template); returns its path."""
    path = Path(module.export_folder) / CARD
    path.write_text(model_card(trainer, module, sys.argv[1:] if argv is None else argv, change, data_settings))
    return path
