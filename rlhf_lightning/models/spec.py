"""Configuration of a base model and of LoRA adapters, as typed dataclasses the CLI turns into options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhf_lightning.utils.checks import at_least, in_range, one_of, optional_str, positive

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class BaseModelSpec:
    """Where a causal language model and its tokenizer come from, and how to load them.

    Args:
        name_or_path: Hugging Face hub id or local folder of a saved causal LM (``from_pretrained``). Leave it
            null to build a fresh, randomly initialised model from ``architecture``.
        architecture: Hugging Face config fields of a fresh model, e.g. ``{model_type: gpt2, n_layer: 4}``;
            used only when ``name_or_path`` is null. ``vocab_size`` and the special token ids come from the
            tokenizer.
        tokenizer: hub id or folder of the tokenizer, or an embedded task's name for its tokenizer (``synthetic``,
            ``arithmetic``, ``calculator``, ``arithmetic_judge``; ``reasoning_gym``: characters, for tiny models on
            reasoning-gym's tasks); null means the same place as ``name_or_path``.
        revision: hub revision (branch, tag or commit) of the model and tokenizer.
        trust_remote_code: run Python code shipped with a hub model. Off unless you trust its author.
        dtype: dtype of the loaded weights; ``auto`` keeps the checkpoint's. Training precision is the
            Trainer's ``precision`` setting.
        attn_implementation: attention kernel (``sdpa``, ``eager``, ``flash_attention_2``); null lets
            transformers choose.
        chat_template: Jinja chat template used instead of the tokenizer's own for conversational data.
        gradient_checkpointing: recompute activations in the backward pass: less memory, about a third more
            compute.
        fused_activations: compute the tanh-approximated GELU (GPT-2's ``gelu_new``) with torch's fused kernel
            instead of transformers' Python formula: the same function to float rounding, faster, and it keeps
            only its input for the backward instead of four ``[tokens, 4 x hidden]`` tensors per layer.
        fused_lora: add each LoRA adapter's low-rank update inside the base layer's matmul, forward and backward
            (``rlhf_lightning.ops.lora``), instead of peft's separate scaling and addition passes over
            the activations: the same numbers to float rounding, faster; off = peft's own forward.
    """

    name_or_path: str | None = None
    architecture: dict[str, Any] | None = None
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Dtype = "float32"
    attn_implementation: str | None = None
    chat_template: str | None = None
    gradient_checkpointing: bool = False
    fused_activations: bool = True
    fused_lora: bool = True

    def __post_init__(self) -> None:
        # `--model.init_args.base.tokenizer=null` reaches a nested dataclass as the string "None" (jsonargparse):
        # read as a hub id, it would end in a network error instead of meaning "the model's own tokenizer".
        for name in ("name_or_path", "tokenizer", "revision", "attn_implementation", "chat_template"):
            setattr(self, name, optional_str(getattr(self, name)))
        one_of("base.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))


@dataclass
class LoraSpec:
    """A LoRA adapter (peft's ``LoraConfig``).

    Args:
        r: rank of the low-rank update.
        alpha: scaling numerator; the update is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with rslora).
        dropout: dropout on the adapter's input. RL roles force it to 0 so that rollout and update passes agree.
        target_modules: names of the modules to adapt, or ``all-linear`` for every linear layer but the output
            head.
        use_rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
        bias: which biases to train: ``none``, ``all`` or ``lora_only``. Only ``none`` keeps "adapters
            disabled" exactly equal to the base model, which the reference role relies on.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    use_rslora: bool = False
    bias: Literal["none", "all", "lora_only"] = "none"

    def check(self, name: str = "lora") -> LoraSpec:
        """Raise a one-line error naming ``name`` (the module argument: ``policy_lora``...) for a value out of
        range; the modules check their adapters when constructed, where the argument's name is known."""
        at_least(f"{name}.r", self.r)
        positive(f"{name}.alpha", self.alpha)
        in_range(f"{name}.dropout", self.dropout, 0.0, 1.0, high_open=True)
        one_of(f"{name}.bias", self.bias, ("none", "all", "lora_only"))
        return self

    def to_peft(self, fan_in_fan_out: bool = False):
        """The equivalent ``peft.LoraConfig``; ``fan_in_fan_out`` for layers that store weights transposed
        (GPT-2's ``Conv1D``)."""
        from peft import LoraConfig

        self.check()
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            use_rslora=self.use_rslora,
            bias=self.bias,
            fan_in_fan_out=fan_in_fan_out,
            task_type="CAUSAL_LM",
        )


# Checkpoints store these in their hyper-parameters; let `torch.load(weights_only=True)` (the default used when
# Lightning resumes) accept them.
torch.serialization.add_safe_globals([BaseModelSpec, LoraSpec])
