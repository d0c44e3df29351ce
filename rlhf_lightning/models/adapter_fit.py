"""Does a saved LoRA adapter fit a base model? Checked from the adapter's files, before peft loads it.

peft loads an adapter of another shape with a long ``size mismatch`` traceback from deep inside torch; one
trained on another base of the same shape loads silently and computes nonsense. Shapes are compared here and
refused with one line; so are weights other than those the adapter was trained on, by the content fingerprint
recorded beside it (:mod:`~rlhf_lightning.models.fingerprint`), in :func:`check_same_base`, which
:meth:`~rlhf_lightning.models.shared_base.SharedBase.load_adapter` calls for every trained adapter it loads (a
reward adapter, a distillation teacher, a merge). An adapter exported before fingerprints were recorded keeps the
path check: a warning when it records another base path.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors import safe_open
from torch import nn
from transformers.pytorch_utils import Conv1D

from rlhf_lightning.models.fingerprint import BASE_RECORD, recorded_fingerprint

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def layer_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer (peft-wrapped or not; GPT-2's ``Conv1D`` too)."""
    module = getattr(module, "base_layer", module)
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        rows, columns = module.weight.shape  # stored transposed: [in, out]
        return rows, columns
    return None


def adapter_shapes(directory: Path) -> dict[str, tuple[int, int]]:
    """``module name -> (in_features, out_features)`` that a saved adapter's LoRA matrices were made for."""
    shapes: dict[str, list[int]] = {}
    with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
            for part, index in ((".lora_A.", 1), (".lora_B.", 0)):
                if part in key:
                    module = key.split(part)[0].removeprefix(PEFT_PREFIX)
                    shape = weights.get_slice(key).get_shape()
                    shapes.setdefault(module, [0, 0])[1 - index] = shape[index]
    return {module: (fan_in, fan_out) for module, (fan_in, fan_out) in shapes.items()}


def check_adapter_fits(directory: str | Path, model: nn.Module, base_name: str | None = None) -> None:
    """Raise a one-line ``ValueError`` if the adapter in ``directory`` targets a layer ``model`` lacks, or one of
    another shape. ``model`` is the transformers model (adapter layers may be injected already); ``base_name``
    its path, for the message. An adapter without a safetensors file is left to peft."""
    directory = Path(directory)
    if not (directory / ADAPTER_WEIGHTS).exists():
        return
    trained_on = json.loads((directory / "adapter_config.json").read_text()).get("base_model_name_or_path")
    origin = f"trained on {trained_on or 'an unrecorded base'}, loaded on {base_name or 'this base'}"
    modules = dict(model.named_modules())
    for name, (fan_in, fan_out) in adapter_shapes(directory).items():
        if name not in modules:
            raise ValueError(f"adapter {directory} does not fit the base ({origin}): it adapts layer {name}, "
                             "which the base lacks; load it on the model it was trained on")
        shape = layer_shape(modules[name])
        if shape is not None and shape != (fan_in, fan_out):
            raise ValueError(f"adapter {directory} does not fit the base ({origin}): layer {name} maps "
                             f"{fan_in} -> {fan_out} features in the adapter but {shape[0]} -> {shape[1]} in the "
                             "base; load it on the model it was trained on")


def check_same_base(directory: str | Path, base_name: str | None, fingerprint: str | None, what: str) -> None:
    """Refuse with one line an adapter whose recorded base fingerprint differs from ``fingerprint``, the loaded
    base's: the base was retrained or replaced since the adapter was trained (``what`` names the adapter). Without
    two fingerprints to compare (an adapter exported before they were recorded, a base named by a hub id), warn
    when the adapter records another base path than ``base_name``, as before."""
    recorded = recorded_fingerprint(directory)
    if recorded is not None and fingerprint is not None:
        if recorded != fingerprint:
            raise ValueError(
                f"the {what} {directory} was trained on other weights than base {base_name} holds now (its "
                f"{BASE_RECORD} says {recorded[:12]}, the base's files give {fingerprint[:12]}): the base was "
                f"retrained or replaced since; train the {what} again on this base, or load the base it was trained "
                f"on (if only the base's file format changed, delete {BASE_RECORD} there to compare paths only)")
        return  # the same weights, wherever the base now lies
    trained_on = json.loads((Path(directory) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if trained_on and base_name and Path(trained_on).resolve() != Path(base_name).resolve():
        log.warning("the %s in %s was trained on %s, but the base is %s: they must hold the same weights", what,
                    directory, trained_on, base_name)
