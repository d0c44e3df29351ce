"""Bases with fused and peft LoRA layers, and one forward and backward pass through them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec

LORA = LoraSpec(r=4, alpha=8)


def gpt2_base(directory, fused: bool) -> SharedBase:
    spec = BaseModelSpec(name_or_path=str(directory))
    return SharedBase(load_causal_lm(spec, load_tokenizer(spec)), fused_lora=fused)


def llama_base(fused: bool) -> SharedBase:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return SharedBase(AutoModelForCausalLM.from_config(config), fused_lora=fused)


def with_adapters(base: SharedBase) -> SharedBase:
    torch.manual_seed(1)
    base.add_adapter("policy", LORA)
    base.add_adapter("reward", LORA, trainable=False)
    with torch.no_grad():  # non-zero B, so that A gets a gradient too
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return base


def forward_backward(base: SharedBase, role: str | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(2)
    ids = torch.randint(3, 60, (3, 9)).to(base.hf_model.device)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with base.role(role):
        hidden = base.hidden_states(ids, mask)
    if hidden.requires_grad:  # only the policy is trainable
        hidden.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in base.model.named_parameters() if p.grad is not None}
    base.model.zero_grad(set_to_none=True)
    return hidden.detach(), grads
