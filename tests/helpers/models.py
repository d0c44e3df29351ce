"""Tiny models, adapters and the modules' build step that the tests share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import (
    BaseModelSpec,
    LoraSpec,
)

LORA = LoraSpec(r=4, alpha=8)


TINY_ARCHITECTURE = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}


def built(module):
    """``module`` with its model built, as Lightning builds it when a fit starts (``configure_model``)."""
    module.configure_model()
    return module


def tiny_spec(**overrides) -> BaseModelSpec:
    """A fresh 2-layer GPT-2 with the synthetic tokenizer."""
    return BaseModelSpec(architecture=dict(TINY_ARCHITECTURE), tokenizer="synthetic", **overrides)


def make_likely(model, token_id: int, scale: float, vocab: int, columns: int) -> None:
    """Point the (tied) embedding of ``token_id`` along the average final hidden state of ``model`` (a GPT-2) on
    random ``[8, columns]`` ids below ``vocab``, times ``scale``: a random tiny model, which would emit it once in ~60
    tokens, then emits it after a few (the bigger ``scale``, the sooner)."""
    with torch.no_grad():
        hidden = model.transformer(torch.randint(0, vocab, (8, columns))).last_hidden_state.mean((0, 1))
        model.transformer.wte.weight[token_id] = scale * hidden / hidden.square().sum()


# Llama-shaped, with attention heads of 32 dimensions: the smallest vLLM's CPU kernels take (its engine's tests).
TINY_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128}


def save_tiny_llama(directory: Path, tokenizer: str = "synthetic") -> Path:
    """A fresh random :data:`TINY_LLAMA` with ``tokenizer`` saved with ``save_pretrained`` in ``directory``."""
    torch.manual_seed(0)
    spec = BaseModelSpec(architecture=dict(TINY_LLAMA), tokenizer=tokenizer)
    tokenizer = load_tokenizer(spec)
    load_causal_lm(spec, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def with_random_adapter(model_dir: Path, role: str = "policy", seed: int = 1) -> tuple[SharedBase, object]:
    """``(model, tokenizer)``: the model of ``model_dir`` with an adapter ``role`` whose ``lora_B`` weights are drawn
    at random (``seed``), so that the adapter changes its outputs."""
    spec = BaseModelSpec(name_or_path=str(model_dir))
    tokenizer = load_tokenizer(spec)
    model = SharedBase(load_causal_lm(spec, tokenizer))
    model.add_adapter(role, LORA)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return model, tokenizer


def save_reward_adapter(model_dir: Path, directory: Path, role: str = "reward", head: bool = True, seed: int = 3,
                        stats: tuple[float, float] = (0.5, 2.0)) -> Path:
    """An adapter ``role`` with a random (non-zero) update drawn from ``seed``, and a head with ``head``, on the base
    in ``model_dir``, saved as the reward stage saves (with its normalisation statistics ``stats`` for a head);
    returns its folder."""
    torch.manual_seed(seed)
    spec = BaseModelSpec(name_or_path=str(model_dir))
    base = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    base.add_adapter(role, LORA)
    if head:
        base.add_head(role)
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    out = base.save_adapter(role, directory)
    if head:
        (out / "reward_stats.json").write_text(json.dumps({"mean": stats[0], "std": stats[1], "count": 10}))
    return out


ENSEMBLE_STATS = [(0.5, 2.0), (-1.0, 0.5), (0.0, 1.0)]


def save_reward_ensemble(model_dir: Path, directory: Path) -> Path:
    """Three reward adapters of other random updates and statistics (:data:`ENSEMBLE_STATS`), saved as the reward
    stage saves an ensemble (``reward/reward_<k>`` and ``reward/ensemble.json``); returns the ensemble's folder."""
    out = directory / "reward"
    members = [f"reward_{k}" for k in range(len(ENSEMBLE_STATS))]
    for k, (member, stats) in enumerate(zip(members, ENSEMBLE_STATS, strict=True)):
        save_reward_adapter(model_dir, out, member, seed=10 + k, stats=stats)
    (out / "ensemble.json").write_text(json.dumps({"members": members, "member_data": "shared"}))
    return out


def retrain_in_place(folder: Path) -> None:
    """What another SFT run exported into the same folder leaves: other weights under the same path."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    model.save_pretrained(folder)
