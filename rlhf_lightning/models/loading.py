"""Loading tokenizers and causal LMs: from the hub, from a local folder, or fresh from a config."""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.activations import GELUTanh, NewGELUActivation

from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.tasks import TASKS, build_task_tokenizer

log = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
SYNTHETIC = "synthetic"


def load_tokenizer(spec: BaseModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer of ``spec``, with a dedicated pad token and left padding (what generation needs)."""
    source = spec.tokenizer or spec.name_or_path
    if source is None:
        raise ValueError(
            "base model: set `tokenizer` (a hub id, a folder or 'synthetic') when `name_or_path` is null"
        )
    if source in TASKS:
        tokenizer = build_task_tokenizer(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=spec.revision, trust_remote_code=spec.trust_remote_code
        )
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {source!r} has no EOS token; responses could never end")
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    return tokenizer


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Give ``tokenizer`` a pad token of its own if it has none, or if it pads with EOS.

    Padding with EOS hides a real signal: code that masks labels by pad id then also masks the EOS that teaches
    a model to stop. Returns whether a token was added (the model's embeddings must then grow).
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return False
    log.info("tokenizer has no dedicated pad token; adding %s", PAD_TOKEN)
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return True


def load_causal_lm(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The causal LM of ``spec``: ``from_pretrained`` when a name or path is set, else a fresh model.

    The model's embeddings are grown to fit the tokenizer (e.g. an added pad token), its config learns the pad
    and EOS ids, and dropout is switched off (see :func:`disable_dropout`).
    """
    dtype = spec.dtype if spec.dtype == "auto" else getattr(torch, spec.dtype)
    if spec.name_or_path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            spec.name_or_path,
            revision=spec.revision,
            trust_remote_code=spec.trust_remote_code,
            dtype=dtype,
            attn_implementation=spec.attn_implementation,
        )
    else:
        model = AutoModelForCausalLM.from_config(
            fresh_config(spec, tokenizer),
            dtype=None if dtype == "auto" else dtype,
            attn_implementation=spec.attn_implementation,
            trust_remote_code=spec.trust_remote_code,
        )
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    for config in (model.config, model.generation_config):
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
    disable_dropout(model)
    if spec.fused_activations:
        fuse_tanh_gelu(model)
    if spec.gradient_checkpointing:
        # Non-reentrant checkpointing works with a frozen base whose inputs do not require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def fresh_config(spec: BaseModelSpec, tokenizer: PreTrainedTokenizerBase):
    """A transformers config for a randomly initialised model from ``spec.architecture``."""
    if not spec.architecture or "model_type" not in spec.architecture:
        raise ValueError(
            "base model: with `name_or_path` null, `architecture` must give at least `model_type` "
            "(e.g. {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 4})"
        )
    fields = dict(spec.architecture)
    model_type = fields.pop("model_type")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    fields.setdefault("vocab_size", len(tokenizer))
    return AutoConfig.for_model(
        model_type,
        bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )


_DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "attn_dropout_p")


def fuse_tanh_gelu(model: nn.Module) -> int:
    """Replace transformers' Python tanh-GELU modules (``gelu_new``) in ``model`` by the fused ``GELUTanh``.

    The Python formula runs six element-wise kernels over the MLP's widest activation and keeps their outputs
    for the backward; the fused kernel computes the same function in one pass and keeps only its input. The
    saved config is unchanged, so an exported model reloads with its original activation. Returns the number
    of modules replaced.
    """
    replaced = 0
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
                replaced += 1
    return replaced


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0.

    RL needs the log-probabilities of the rollout and of the update to agree (ratio = 1 before any step), and a
    reward model's scores to be deterministic. Covers ``nn.Dropout`` modules and the float attributes that
    attention implementations read directly.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in _DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, 0.0)
