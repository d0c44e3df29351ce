"""A shared base's adapters on disk: loading one in peft's format with its head, after checking that it fits the
base, and writing one (adapter, head and the fingerprint of the base's weights) or the base with an adapter merged in.
Sharded, every rank takes part in a write (the weights are gathered) and one writes."""

from __future__ import annotations

import json
from pathlib import Path

from peft import PeftConfig, PeftModel

from rlhf_lightning.models.adapter_fit import check_adapter_fits, check_same_base
from rlhf_lightning.models.fingerprint import write_base_record
from rlhf_lightning.models.heads import ScalarHead
from rlhf_lightning.models.loading import looks_local
from rlhf_lightning.models.merging import adapter_of, merged_state_dict
from rlhf_lightning.models.sharding import full_tensor
from rlhf_lightning.utils.file_modes import readable_as_umask_allows
from rlhf_lightning.utils.nonfinite import check_finite_weights


def adapters_below(folder: str | Path, marker: str = "adapter_config.json", depth: int = 3) -> list[Path]:
    """The folders under ``folder`` (itself excluded, ``depth`` levels at most) that hold ``marker``: where an
    adapter is when a path names the folder above it (``outputs/reward`` for ``outputs/reward/adapters/reward``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [path.parent for level in range(2, depth + 2)
             for path in folder.glob("/".join(["*"] * (level - 1) + [marker]))]
    return sorted(found)

def recorded_base(adapter: str | Path) -> str | None:
    """The base model an adapter folder's ``adapter_config.json`` records (None when it records none); one line
    when the folder is no adapter."""
    adapter = Path(adapter)
    config_path = adapter / "adapter_config.json"
    if not config_path.exists():
        where = "does not exist" if not adapter.exists() else "is not a peft adapter folder"
        raise FileNotFoundError(f"{config_path} not found: {adapter} {where}")
    return json.loads(config_path.read_text()).get("base_model_name_or_path")


def adapter_base(adapter: str | Path, base: str | None = None) -> str:
    """The base model to load a saved adapter on: ``base`` when given, else the one it records
    (:func:`recorded_base`); one line when it records none, or a local folder that is not there."""
    recorded = recorded_base(adapter)
    if base is not None:
        return base
    if not recorded:
        raise ValueError(f"{Path(adapter) / 'adapter_config.json'} does not name its base model; pass --base")
    if looks_local(recorded) and not Path(recorded).expanduser().is_dir():
        where = "relative to the folder it was trained from, " if not Path(recorded).is_absolute() else ""
        raise FileNotFoundError(
            f"the adapter {adapter} records its base as {recorded} ({where}not a folder from here): give the "
            "base with --base PATH (the model the adapter was trained on, e.g. the SFT stage's export)")
    return recorded


class AdapterFiles:
    """The file methods of :class:`~rlhf_lightning.models.shared_base.SharedBase`, which derives from this class:
    they read and write its ``model``, ``heads``, ``trainable_adapters`` and ``base_fingerprint``."""

    def load_adapter(self, directory: str | Path, name: str, trainable: bool = False) -> None:
        """Load an adapter saved by :meth:`save_adapter` (peft format), and its head if one is beside it, after
        checking that it fits this base: its layers' shapes, and the weights it was trained on (see
        :func:`~rlhf_lightning.models.adapter_fit.check_same_base`; the adapter is named ``<name> adapter``)."""
        directory = str(directory)
        if not (Path(directory) / "adapter_config.json").exists():
            raise FileNotFoundError(f"{directory}/adapter_config.json not found: not a peft adapter folder")
        check_adapter_fits(directory, self.hf_model, self.hf_model.config.name_or_path)
        check_same_base(directory, self.hf_model.config.name_or_path, self.base_fingerprint, f"{name} adapter")
        if self.is_empty:
            # The shapes without the values, which rank 0 sends once the base is sharded.
            config = PeftConfig.from_pretrained(directory)
            config.inference_mode = not trainable
            self._inject_adapter(name, config)
        elif isinstance(self.model, PeftModel):
            self.model.load_adapter(directory, adapter_name=name, is_trainable=trainable)
        else:
            self.model = PeftModel.from_pretrained(self.model, directory, adapter_name=name, is_trainable=trainable)
        if trainable:
            self.trainable_adapters.add(name)
        if ScalarHead.exists(directory):
            if self.is_empty:
                self.heads[name] = ScalarHead(ScalarHead.saved_hidden_size(directory, self.hidden_size)).to("meta")
            else:
                self.heads[name] = ScalarHead.load(directory, expected_hidden_size=self.hidden_size)
            self.heads[name].requires_grad_(trainable)
        self._adapters_changed()

    def save_adapter(self, name: str, directory: str | Path, write: bool = True) -> Path:
        """Write adapter ``name`` in peft format (readable by ``PeftModel.from_pretrained``) plus its head, and the
        fingerprint of the base's weights it was trained on (a base from a local folder).

        Sharded, every rank must call it (the weights are gathered) and only the one with ``write`` writes.
        Returns the folder holding the adapter: ``directory/name``.
        """
        directory = Path(directory)
        weights = {key: full_tensor(value.detach()) for key, value in self.model.named_parameters()
                   if adapter_of(key) == name}
        head = ({key: full_tensor(value.detach()) for key, value in self.heads[name].named_parameters()}
                if name in self.heads else {})
        # peft writes every adapter but "default" into a sub-folder named after it.
        adapter_dir = directory if name == "default" else directory / name
        if not write:
            return adapter_dir
        check_finite_weights({**weights, **{f"heads.{name}.{key}": value for key, value in head.items()}},
                             f"adapter {name!r} to {directory}")
        self.model.save_pretrained(str(directory), selected_adapters=[name], state_dict=weights)
        if head:
            ScalarHead.save_state(adapter_dir, head, self.heads[name].hidden_size)
        if self.base_fingerprint is not None:
            write_base_record(adapter_dir, self.hf_model.config.name_or_path, self.base_fingerprint)
        readable_as_umask_allows(adapter_dir)
        return adapter_dir

    def save_merged(self, adapter: str | None, directory: str | Path, tokenizer=None, write: bool = True) -> Path:
        """Write a standalone transformers model (``from_pretrained``-able) with ``adapter`` merged in.

        Sharded, every rank must call it (the weights are gathered) and only the one with ``write`` writes.
        """
        directory = Path(directory)
        state = merged_state_dict(self.hf_model, adapter)
        if not write:
            return directory
        check_finite_weights(state, f"the model to {directory}")
        self.hf_model.save_pretrained(directory, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        readable_as_umask_allows(directory)
        return directory
