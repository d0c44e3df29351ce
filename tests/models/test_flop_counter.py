"""The FLOP counter of a shared base: each pass counted as the formula says, real tokens only, the adapter's weights
when it is on, a backward with gradients on, the LM head through its module or the fused head's mark, nothing in the
engines' sampling mode or once detached."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.models.flop_counter import FlopCounter
from rlhf_lightning.models.logprobs import token_logprobs
from rlhf_lightning.rollout.engines import sampling_mode
from rlhf_lightning.utils.flops import ModelShape
from tests.helpers.models import with_random_adapter

D, LAYERS = 32, 2  # the tiny GPT-2's width and depth


def positions_sum(mask: torch.Tensor) -> float:
    """The sum over real tokens of the positions each attends to (itself included), rows left-padded."""
    return float(sum(n * (n + 1) / 2 for n in mask.sum(-1).tolist()))


def test_the_counter_counts_the_formula_for_each_pass(tiny_model_dir):
    model, _ = with_random_adapter(tiny_model_dir)
    counter = FlopCounter(model)
    assert counter.shape.matmul_parameters == LAYERS * 12 * D * D  # GPT-2's c_attn, c_proj, c_fc, mlp c_proj
    assert counter.shape.layers == LAYERS and counter.shape.width == D
    lora = counter.adapters["policy"]
    assert lora > 0
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # 8 real tokens; the pads are not counted
    plain = ModelShape(LAYERS, D, counter.shape.vocab, LAYERS * 12 * D * D)
    adapted = ModelShape(LAYERS, D, counter.shape.vocab, LAYERS * 12 * D * D, lora)
    counter.attach()
    with torch.no_grad(), model.role(None):  # the reference: no adapter, no backward
        model.hidden_states(ids, mask)
    assert counter.take() == pytest.approx(plain.forward(8, positions_sum(mask)))
    with model.role("policy"):  # with gradients: a backward as one forward more (the base frozen)
        hidden = model.hidden_states(ids, mask)
        model.logits(hidden[:, :-1])  # the LM head's module, at 2 x 4 positions
    assert counter.take() == pytest.approx(2 * (adapted.forward(8, positions_sum(mask)) + adapted.head(8)))
    with torch.no_grad():  # the fused log-prob head tells the count itself: 2 rows x 2 positions
        token_logprobs(model, "policy", ids, mask, torch.tensor([[0, 0, 0, 1, 1]] * 2).bool())
    assert counter.take() == pytest.approx(adapted.forward(8, positions_sum(mask)) + adapted.head(4))
    with sampling_mode(model, "policy", ids.device):  # generation: counted from the rollout's lengths instead
        model.hidden_states(ids, mask)
    assert counter.take() == 0.0
    counter.detach()
    with torch.no_grad():
        model.hidden_states(ids, mask)
    assert counter.take() == 0.0
