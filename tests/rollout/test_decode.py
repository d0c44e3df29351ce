"""Our decoding loop (``rlhf_lightning.rollout.decode``) against transformers' ``generate``: the same tokens and
log-probs for every family of the test matrix, each prompt encoded once per group, and a compiled decode step that
draws the eager step's tokens and compiles once per shape, never per rollout."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.rollout.decode import PROMPT_BUCKET, _compiled_graphs
from rlhf_lightning.rollout.engines import Auto, CompiledDecoder, EagerDecoder, EngineSetup, Generate
from tests.helpers.decoding import (
    ARCHITECTURES,
    family_params,
    policy_base,
    prompts,
    sample,
    sampler,
)


@pytest.mark.parametrize("family", family_params())
def test_the_loop_draws_generates_tokens_and_log_probs_encoding_each_prompt_once(family):
    base = policy_base(family)
    ids, mask = prompts(3, 11, seed=1)
    expected, expected_mask, expected_logprobs = sample(base, "generate", ids, mask, group=4)
    assert expected_mask.sum() > 12 and not expected_mask.all()  # some rows stopped, at different lengths
    for group, (prompt_ids, prompt_mask) in ((4, (ids, mask)), (1, (ids.repeat_interleave(4, 0),
                                                                     mask.repeat_interleave(4, 0)))):
        sequences, response_mask, logprobs = sample(base, "eager", prompt_ids, prompt_mask, group=group)
        assert torch.equal(sequences, expected) and torch.equal(response_mask, expected_mask)
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-6)


def test_each_prompt_is_encoded_once_per_group():
    base = policy_base("gpt2")
    ids, mask = prompts(3, 11, seed=2)
    prefill_rows = []

    def record(module, args, kwargs):  # the first block's input: [rows, tokens, hidden]; a decode step has 1 token
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > 1:
            prefill_rows.append(tuple(hidden.shape[:2]))

    hook = base.hf_model.transformer.h[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        sample(base, "eager", ids, mask, group=4)
        sample(base, "generate", ids, mask, group=4)
    finally:
        hook.remove()
    assert prefill_rows == [(3, 11), (12, 11)]  # the loop's prefill, then generate's k-fold one


def test_the_loop_names_the_rows_whose_scores_are_not_finite():
    base = policy_base("gpt2")
    with torch.no_grad():  # the policy adapter's update is NaN: every row of the policy's samples is
        next(p for name, p in base.model.named_parameters() if "lora_B" in name and ".policy" in name).fill_(
            float("nan"))
    ids, mask = prompts(2, 5, seed=3)
    with pytest.raises(FloatingPointError, match=r"rows \[0, 1, 2, 3\] \(of 4\) are NaN or all -inf after 5 tokens"):
        sample(base, "eager", ids, mask, group=2)
    sample(base, "eager", ids, mask, group=2, role=None)  # the reference (adapters off) samples fine


def test_auto_picks_our_fastest_decoder_and_each_engine_refuses_what_it_cannot_serve():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert type(Auto().resolved(cpu, False, "dynamic")) is Generate
    assert type(Auto().resolved(cpu, False, "static")) is EagerDecoder
    assert type(Auto().resolved(cuda, False, "static")) is CompiledDecoder
    assert type(Auto().resolved(cuda, True, "static")) is EagerDecoder  # FSDP2's per-layer hooks are not compiled
    eager = EagerDecoder()
    assert eager.resolved(cuda, False, "static") is eager
    assert EagerDecoder().refusal(EngineSetup("cpu", kv_cache="dynamic")) == (
        "engine EagerDecoder decodes over a static KV cache; kv_cache: dynamic needs the engine Generate (or Auto)")
    assert CompiledDecoder().refusal(EngineSetup("cuda", sharded=True)).startswith(
        "engine CompiledDecoder cannot run on an FSDP2-sharded base")
    assert Auto().refusal(EngineSetup("cuda", sharded=True)) is None
    assert Auto().refusal(EngineSetup("cpu", kv_cache="dynamic")) is None
    assert Generate().refusal(EngineSetup("cuda", sharded=True, kv_cache="dynamic")) is None


# ---- the compiled step (torch.compile's inductor on CPU: the same graphs a GPU captures, without CUDA graphs) ----

@pytest.mark.slow  # compiled decoding
@pytest.mark.parametrize("family", family_params())
def test_compiled_decoding_draws_the_eager_tokens_and_compiles_once_for_a_shape(family):
    base = policy_base(family)
    # Prompt lengths 11 and 40 share a bucket; 70 + 24 tokens overrun the sliding windows (64) of Mistral and Gemma-2.
    # A new bucket compiles one graph more whatever the family: checked on GPT-2 (the fast suite's) and on the
    # families whose sliding window the long prompt overruns, not compiled again for the rest.
    assert -(-11 // PROMPT_BUCKET) == -(-40 // PROMPT_BUCKET) != -(-70 // PROMPT_BUCKET)
    long_prompt = family == "gpt2" or "sliding_window" in ARCHITECTURES[family]
    for rollout, (length, compiles) in enumerate(((11, 1), (40, 1), *([(70, 2)] if long_prompt else []))):
        ids, mask = prompts(3, length, seed=rollout)
        expected, expected_mask, expected_logprobs = sample(base, "eager", ids, mask, group=2)
        graphs = _compiled_graphs()
        sequences, response_mask, logprobs = sample(base, "compiled", ids, mask, group=2)
        assert torch.equal(sequences, expected) and torch.equal(response_mask, expected_mask)
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)
        assert sampler(base, "compiled").engine(base).decoder.stats.compiles == compiles
        assert _compiled_graphs() - graphs == (rollout != 1)  # a prompt bucket seen before compiles nothing


@pytest.mark.slow
def test_compiled_decoding_recompiles_for_a_new_batch_or_role_only_once():
    base = policy_base("gpt2")
    # Compiled graphs serve every model of the same structure and shapes: these batch sizes are this test's alone.
    for role, rows in (("policy", 5), ("policy", 7), (None, 7), ("policy", 7), (None, 5), ("policy", 5)):
        ids, mask = prompts(rows, 9, seed=rows)
        expected = sample(base, "eager", ids, mask, group=2, role=role)[0]
        assert torch.equal(sample(base, "compiled", ids, mask, group=2, role=role)[0], expected)
    stats = sampler(base, "compiled").engine(base).decoder.stats
    assert stats.compiles == 4 and stats.compile_seconds > 0  # (5 or 7 prompts) x (policy or reference), once each


@pytest.mark.slow
def test_compiled_decoding_in_bf16_samples_its_tokens_with_their_log_probs():
    """bf16 kernels round differently when fused: a draw that falls within ~1e-2 of a token's cumulative boundary
    may pick its neighbour, so tokens are compared with the log-probs the eager model gives the compiled path's own
    tokens (teacher-forced over the whole sequence), to 0.05 nats (bf16 keeps 8 bits of mantissa)."""
    base = policy_base("llama", torch.bfloat16)
    ids, mask = prompts(3, 11, seed=4)
    eager, eager_mask, _ = sample(base, "eager", ids, mask, group=4)
    sequences, response_mask, logprobs = sample(base, "compiled", ids, mask, group=4)
    assert (sequences == eager).all(1).float().mean() >= 0.5  # most rows are the eager path's to the last token
    with torch.no_grad(), base.role("policy"):
        logits = base.hf_model(input_ids=sequences, attention_mask=torch.cat([mask.repeat_interleave(4, 0),
                                                                                response_mask.long()], 1)).logits
    width = response_mask.shape[1]
    forced = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1).gather(-1, sequences[:, -width:, None])[..., 0]
    torch.testing.assert_close(logprobs[response_mask], forced[response_mask], rtol=0, atol=0.05)

