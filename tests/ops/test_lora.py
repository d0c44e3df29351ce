"""The fused LoRA layer: peft's numbers (outputs and every gradient) on GPT-2's Conv1D and on nn.Linear layers,
and peft's own forward wherever the fused one does not apply."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.models.shared_base import SharedBase, adapter_of
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.ops.lora import FusedLoraLinear
from tests.helpers.lora_ops import forward_backward, gpt2_base, llama_base, with_adapters


@pytest.mark.parametrize("architecture", ["gpt2 (Conv1D)", "llama (nn.Linear)"])
def test_fused_layers_give_peft_outputs_and_gradients(architecture, tiny_model_dir):
    def build(fused: bool) -> SharedBase:
        base = gpt2_base(tiny_model_dir, fused) if architecture.startswith("gpt2") else llama_base(fused)
        return with_adapters(base)

    fused, plain = build(True), build(False)
    layers = [m for m in fused.model.modules() if isinstance(m, FusedLoraLinear)]
    assert layers and not any(isinstance(m, FusedLoraLinear) for m in plain.model.modules())
    assert len(layers) == sum(1 for name, _ in plain.model.named_modules() if name.endswith(".base_layer"))
    for role in ("policy", "reward", None):
        hidden, grads = forward_backward(fused, role)
        expected, expected_grads = forward_backward(plain, role)
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        assert grads.keys() == expected_grads.keys()
        assert {adapter_of(name) for name in grads} == ({"policy"} if role == "policy" else set())
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_path_runs_only_where_it_applies(tiny_model_dir):
    base = with_adapters(gpt2_base(tiny_model_dir, fused=True))
    layer = next(m for m in base.model.modules() if isinstance(m, FusedLoraLinear))
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)

    def fused_node(inputs: torch.Tensor = x) -> bool:
        view = layer(inputs).grad_fn  # the fused output is reshaped back to [batch, tokens, out]
        return any(type(node).__name__.startswith("_LowRankLinear") for node, _ in view.next_functions)

    with base.role("policy"):
        assert fused_node()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not fused_node()  # autocast: peft's forward
        layer.base_layer.weight.requires_grad_(True)  # a trainable base: peft's forward
        assert not fused_node()
        layer.base_layer.weight.requires_grad_(False)
        assert layer._fusable_adapter(x.double(), (), {}) is None  # mixed dtypes
    with base.role(None):
        assert not fused_node()  # adapters disabled: the base layer alone
        torch.testing.assert_close(layer(x), layer.base_layer(x))


def test_adapter_with_dropout_keeps_peft_forward(tiny_model_dir):
    base = gpt2_base(tiny_model_dir, fused=True)
    base.add_adapter("noisy", LoraSpec(r=4, alpha=8, dropout=0.5))
    layer = next(m for m in base.model.modules() if isinstance(m, FusedLoraLinear))
    with base.role("noisy"):
        assert layer._fusable_adapter(torch.zeros(1, layer.in_features), (), {}) is None
