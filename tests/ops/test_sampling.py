"""The sampler used inside ``generate``: the right distribution, filters honoured, clear errors, and the PPO
module's generation identical with a static or a dynamic KV cache."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.ops.sampling import (
    InverseCDFSampler,
    inverse_cdf_draw,
    inverse_cdf_draw_op,
    sampling_processors,
)
from rlhf_lightning.stages.dpo import DPO
from tests.helpers.models import LORA, built
from tests.helpers.online import first_batch, make_ppo

PROBS = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4])


def draw(processors, probs: torch.Tensor, rows: int = 40_000, seed: int = 0) -> torch.Tensor:
    """Token frequencies of ``rows`` draws from scores ``log(probs)``."""
    torch.manual_seed(seed)
    scores = probs.log().expand(rows, -1).clone()
    out = processors(torch.zeros(rows, 3, dtype=torch.long), scores)
    assert torch.isneginf(out).sum(-1).eq(probs.numel() - 1).all() and out.max(-1).values.eq(0).all()
    return torch.bincount(out.argmax(-1), minlength=probs.numel()).float() / rows


def test_inverse_cdf_sampler_draws_each_token_with_its_probability():
    frequencies = draw(InverseCDFSampler(), PROBS)
    # 40,000 draws: a frequency's standard error is at most 0.0025.
    torch.testing.assert_close(frequencies, PROBS, atol=0.01, rtol=0)
    assert frequencies[2] == 0  # probability 0 is never drawn


@pytest.mark.parametrize(("options", "expected"), [
    ({"top_k": 2}, [0, 0, 0, 3 / 7, 4 / 7]),
    ({"top_p": 0.5}, [0, 0, 0, 3 / 7, 4 / 7]),  # 0.4 < 0.5: the nucleus needs 0.3 too
    ({"temperature": 0.5}, [0.01 / 0.30, 0.04 / 0.30, 0, 0.09 / 0.30, 0.16 / 0.30]),  # p^2, renormalised
])
def test_processors_apply_temperature_top_k_and_top_p_before_drawing(options, expected):
    frequencies = draw(sampling_processors(**options), PROBS)
    torch.testing.assert_close(frequencies, torch.tensor(expected), atol=0.01, rtol=0)
    assert frequencies[torch.tensor(expected) == 0].sum() == 0


def test_sampler_is_reproducible_from_the_seed():
    assert torch.equal(draw(InverseCDFSampler(), PROBS, rows=50, seed=7), draw(InverseCDFSampler(), PROBS, rows=50,
                                                                                 seed=7))


@pytest.mark.slow  # compiled decoding
def test_the_draw_as_an_operator_is_the_function_eager_and_compiled_with_shapes_it_declares():
    """The decode step compiles the draw as one opaque operator (Inductor's split scan over a large vocabulary
    fails on CUDA): it must give the plain function's tokens, log-probs and flags, compiled or not."""
    scores = torch.randn(6, 50257, generator=torch.Generator().manual_seed(0))
    scores[2] = float("-inf")
    uniform = torch.rand(6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = inverse_cdf_draw(scores * 0.5, uniform)
    compiled = torch.compile(lambda s, u: inverse_cdf_draw_op(s * 0.5, u), fullgraph=True, dynamic=False)
    for drawn in (inverse_cdf_draw_op(scores * 0.5, uniform), compiled(scores, uniform)):
        assert [t.dtype for t in drawn] == [torch.long, torch.float32, torch.bool]
        torch.testing.assert_close(drawn, expected, rtol=0, atol=0, equal_nan=True)  # row 2's log-prob: NaN
    assert expected[2].tolist() == [True, True, False, True, True, True]
    torch.library.opcheck(inverse_cdf_draw_op, (scores[:2], uniform[:2]))  # finite rows: it compares no NaN


def test_non_finite_scores_name_the_rows():
    scores = torch.zeros(3, 4)
    scores[1, 2] = math.nan
    scores[2] = -math.inf
    with pytest.raises(FloatingPointError, match=r"rows \[1, 2\] \(of 3\) are NaN or all -inf after 5 tokens"):
        InverseCDFSampler()(torch.zeros(3, 5, dtype=torch.long), scores)


def test_generation_is_the_same_with_a_static_or_dynamic_cache_and_honours_top_k(tiny_model_dir, reward_dir):
    """Left-padded prompts, top-k 3: both caches give the same tokens from the same seed, and every sampled token
    is among the policy's 3 most likely at its position."""
    batch = first_batch(make_ppo(tiny_model_dir, reward_dir))
    prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
    assert (prompt_mask[:, 0] == 0).any(), "the batch should contain left-padded prompts"
    results = []
    for kv_cache in ("static", "dynamic"):
        # The sampling module (the online algorithms refuse top-k: their log-probs are of the full distribution)
        torch.manual_seed(0)
        module = built(DPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), policy_lora=LORA,
                                    sampling={"kv_cache": kv_cache, "top_k": 3, "max_new_tokens": 8}))
        torch.manual_seed(11)
        results.append(module.policy.generate(prompt_ids, prompt_mask))
    (ids, mask, response_mask), (other_ids, other_mask, other_response_mask) = results
    assert torch.equal(ids, other_ids) and torch.equal(mask, other_mask)
    assert torch.equal(response_mask, other_response_mask) and response_mask.sum() > 8

    with torch.no_grad(), module.model.role("policy"):
        hidden = module.model.hidden_states(ids, mask)
        logits = module.model.lm_head(hidden[:, prompt_ids.shape[1] - 1: -1])
    responses = ids[:, prompt_ids.shape[1]:]
    rank = (logits > logits.gather(-1, responses.unsqueeze(-1))).sum(-1)
    assert rank[response_mask].max() < 3


def test_kv_cache_must_be_static_or_dynamic(tiny_model_dir, reward_dir):
    with pytest.raises(ValueError, match=r"^sampling\.kv_cache must be one of static, dynamic, got 'paged'$"):
        make_ppo(tiny_model_dir, reward_dir, sampling={"kv_cache": "paged"})
