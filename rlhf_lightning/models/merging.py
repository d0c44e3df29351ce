"""Folding a LoRA adapter into the base's weights, without touching them: what ``merge`` and the SFT stage's
export write."""

from __future__ import annotations

from torch import Tensor, nn

from rlhf_lightning.models.sharding import full_tensor


def adapter_of(parameter_name: str) -> str | None:
    """The adapter a peft parameter belongs to (``...lora_A.policy.weight`` -> ``policy``), or None for the base."""
    parts = parameter_name.split(".")
    for part, following in zip(parts, parts[1:], strict=False):
        if part.startswith("lora_"):
            return following
    return None


def merged_state_dict(hf_model: nn.Module, adapter: str | None) -> dict[str, Tensor]:
    """Weights of a plain transformers model equal to ``hf_model`` (the shared base's, adapter layers injected) with
    ``adapter`` folded in.

    Non-destructive: the base is not touched (merging in place and unmerging would leave rounding drift in
    weights the reference relies on). ``None`` gives the base alone. Sharded, every rank must call it (each
    weight is gathered in turn) and gets the whole state.
    """
    state, gathered = {}, {}
    for key, value in hf_model.state_dict(keep_vars=True).items():
        # Tied weights (an LM head that is the embeddings) are one object: gathered once, kept one tensor.
        if id(value) not in gathered:
            gathered[id(value)] = full_tensor(value.detach())
        state[key] = gathered[id(value)]
    merged = {}
    modules = dict(hf_model.named_modules())
    for key, value in state.items():
        if adapter_of(key) is not None:
            continue
        if ".base_layer." in key:
            module_name, _, parameter_name = key.partition(".base_layer.")
            layer = modules[module_name]
            if parameter_name == "weight" and adapter is not None and adapter in getattr(layer, "lora_A", {}):
                delta = lora_delta(state[f"{module_name}.lora_A.{adapter}.weight"],
                                   state[f"{module_name}.lora_B.{adapter}.weight"],
                                   layer.scaling[adapter], layer.fan_in_fan_out)
                value = value + delta.to(value.dtype)
            key = f"{module_name}.{parameter_name}"
        merged[key] = value
    return merged


def lora_delta(lora_a: Tensor, lora_b: Tensor, scaling: float, fan_in_fan_out: bool) -> Tensor:
    """The weight update of a plain LoRA layer, ``scaling * B @ A`` (transposed for layers that store their
    weight transposed, GPT-2's ``Conv1D``): peft's ``get_delta_weight``, from the matrices themselves so that
    gathered shards can be merged."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return delta.t() if fan_in_fan_out else delta
