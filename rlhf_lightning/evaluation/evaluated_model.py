"""What ``evaluate`` evaluates: a transformers model folder (a merged model, the SFT stage's export), a peft adapter
folder on its base (the one it records, or one given), or a run folder, whose export is found in it (the policy
adapter, else the exported model); loaded as the shared base with the adapter on, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.models.adapter_files import adapter_base, adapters_below
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer, looks_local
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
EVALUATED_ROLE = "policy"  # the name the adapter gets on the base
# Where a run folder keeps what it exported, in the order looked for: the policy adapter of the online algorithms
# and DPO's family, the SFT stage's merged model.
RUN_EXPORTS = ("adapters/policy", "model")


@dataclass(frozen=True)
class ModelToEvaluate:
    """A base model (a folder or a hub id) and, optionally, an adapter folder to put on it."""

    base: str
    adapter: Path | None = None

    def describe(self) -> dict[str, Any]:
        """What the results file records of the model."""
        return {"base": self.base, "adapter": None if self.adapter is None else str(self.adapter)}


def model_to_evaluate(path: str, base: str | None = None) -> ModelToEvaluate:
    """``path`` as a model to evaluate: an adapter folder (on ``base``, else its recorded base), a model folder, a
    run folder (its export, :data:`RUN_EXPORTS`) or a hub id; one line when it is none of these."""
    folder = Path(path).expanduser()
    if not folder.exists():
        if looks_local(path):
            raise FileNotFoundError(f"{path} does not exist: give a model folder, an adapter folder (e.g. "
                                    "outputs/ppo/adapters/policy) or a run folder (e.g. outputs/ppo)")
        if base is not None:
            raise ValueError(f"--base {base} is for an adapter, and {path} is not an adapter folder")
        return ModelToEvaluate(path)  # a hub id
    if not folder.is_dir():
        raise ValueError(f"{path} is a file: give a model folder, an adapter folder or a run folder")
    if (folder / ADAPTER_CONFIG).is_file():
        return ModelToEvaluate(adapter_base(folder, base), folder)
    if (folder / MODEL_CONFIG).is_file():
        if base is not None:
            raise ValueError(f"--base {base} is for an adapter, and {path} is a model folder (config.json)")
        return ModelToEvaluate(str(folder))
    for export in RUN_EXPORTS:
        if (folder / export / ADAPTER_CONFIG).is_file() or (folder / export / MODEL_CONFIG).is_file():
            return model_to_evaluate(str(folder / export), base)
    found = adapters_below(folder)
    listed = f"; it holds the adapters {', '.join(str(p) for p in found)}: name one" if found else ""
    raise FileNotFoundError(
        f"{path} holds no model to evaluate: not a model folder (config.json), not an adapter folder "
        f"(adapter_config.json), and not a run folder with an export ({' or '.join(RUN_EXPORTS)}){listed}")


def load_model(model: ModelToEvaluate, device: str | None = None, dtype: str = "auto"
               ) -> tuple[SharedBase, PreTrainedTokenizerBase, str | None]:
    """``(shared base, tokenizer, role)``: ``model``'s base loaded once with its adapter on as the role ``policy``
    (checked to fit the base and to have been trained on its weights), on ``device`` (default: CUDA when there is
    one); the role is None for a model without adapter."""
    spec = BaseModelSpec(name_or_path=model.base, dtype=dtype)
    tokenizer = load_tokenizer(spec)
    shared = SharedBase(load_causal_lm(spec, tokenizer))
    role = None
    if model.adapter is not None:
        shared.load_adapter(model.adapter, EVALUATED_ROLE)
        role = EVALUATED_ROLE
    shared.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shared.eval()
    return shared, tokenizer, role
