"""A group's prompt encoded once in every pass after sampling (``share_prompt``,
:mod:`rlhf_lightning.models.shared_prompt`): for every family of the test matrix, the log-probs of the policy and the
reference, their gradients and a scalar head's scores (values, reward adapter) equal one pass over whole rows, while
the decoder reads each prompt once per group; a GRPO fit gives the same losses, gradients and weights with sharing
on and off, in one process and under DDP and FSDP2.

Tolerance, fp32: log-probs and scores 1e-5 absolute (the prompt's attention runs for fewer rows, the responses'
after a cache: kernel rounding only, measured up to 1e-6); gradients and fits as the distributed equivalence tests,
relative 1e-4 with an absolute floor of 1e-6 (1e-5 on weights): a prompt's gradient is the sum of its rows', added
in another order.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.core.policy import pad_to_sequence
from rlhf_lightning.models.loading import disable_dropout
from rlhf_lightning.models.logprobs import token_logprobs
from rlhf_lightning.models.shared_base import REFERENCE
from rlhf_lightning.models.shared_prompt import prefix_groups
from tests.helpers.decoding import family_params, policy_base, prompts, sample
from tests.helpers.distributed import COMMON, ONLINE, PER_RANK, REPO, STRATEGIES, close, run_all

GROUP = 4


def grouped_block(base, seed: int = 1):
    """3 prompts (one left-padded) x ``GROUP`` sampled responses of different lengths: ``(ids, attention mask,
    response mask [B, T])``."""
    ids, mask = prompts(3, 11, seed=seed)
    sequences, response_mask, _ = sample(base, "eager", ids, mask, group=GROUP)
    lengths = response_mask.sum(1)
    assert len(set(lengths.tolist())) > 3 and lengths.min() >= 1  # responses of many lengths
    attention = torch.cat([mask.repeat_interleave(GROUP, 0), response_mask], 1)
    return sequences, attention, pad_to_sequence(response_mask, sequences.shape[1])


def count_decoded_tokens(base) -> list[int]:
    """A list that receives the number of token positions of every call of the base's input embedding."""
    calls: list[int] = []
    base.hf_model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: calls.append(args[0].numel()))
    return calls


def logprobs_and_gradients(base, role, ids, attention, response_mask, share: bool):
    base.share_prompt = share
    base.zero_grad()
    logprobs, _ = token_logprobs(base, role, ids, attention, response_mask)
    if role is not None:
        ((logprobs * response_mask).sum() / response_mask.sum()).backward()  # per-token mean, as the losses
    return logprobs.detach(), {name: p.grad.clone() for name, p in base.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", family_params())
def test_shared_prompt_passes_equal_whole_row_passes_for_every_family(family):
    base = policy_base(family)
    ids, attention, response_mask = grouped_block(base)
    calls = count_decoded_tokens(base)
    for role in ("policy", REFERENCE):
        expected, expected_grads = logprobs_and_gradients(base, role, ids, attention, response_mask, share=False)
        assert calls == [ids.numel()]
        calls.clear()
        actual, grads = logprobs_and_gradients(base, role, ids, attention, response_mask, share=True)
        # each of the 3 prompts once, then every row's response columns
        prompt_width = int(response_mask.any(0).nonzero()[0])
        assert calls == [3 * prompt_width, ids.shape[0] * (ids.shape[1] - prompt_width)]
        calls.clear()
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        assert grads.keys() == expected_grads.keys() and (role is None) == (not grads)
        for name, value in expected_grads.items():
            assert value.abs().sum() > 0 and close(grads[name], value, 1e-4, 1e-6), (name, (grads[name] - value).abs().max())
    # a scalar head on the last token (the critic's values, the reward adapter's score)
    base.add_head("policy")
    last = attention.shape[1] - 1 - attention.flip(1).argmax(1)
    scores = {}
    for share in (False, True):
        base.share_prompt = share
        with torch.no_grad():
            scores[share] = base.score("policy", ids, attention, last, shared_until=prompt_width)
    torch.testing.assert_close(scores[True], scores[False], rtol=0, atol=1e-5)


def test_rows_that_share_no_prompt_run_as_one_pass():
    base = policy_base("gpt2")
    ids, attention, response_mask = grouped_block(base, seed=2)
    rows = torch.arange(0, ids.shape[0], GROUP)  # one response per prompt, as PPO samples
    ids, attention, response_mask = ids[rows], attention[rows], response_mask[rows]
    assert prefix_groups(ids, attention, int(response_mask.any(0).nonzero()[0])) is None
    calls = count_decoded_tokens(base)
    base.share_prompt = True
    token_logprobs(base, "policy", ids, attention, response_mask)
    assert calls == [ids.numel()]


def test_a_checkpointed_decoder_in_training_keeps_whole_row_passes():
    """transformers drops the cache of a decoder that recomputes its layers in training (and a recomputed layer
    would write it twice): such a pass runs the whole rows, the same numbers."""
    base = policy_base("llama")
    ids, attention, response_mask = grouped_block(base)
    disable_dropout(base.hf_model)
    base.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.train()
    calls = count_decoded_tokens(base)
    expected, expected_grads = logprobs_and_gradients(base, "policy", ids, attention, response_mask, share=False)
    actual, grads = logprobs_and_gradients(base, "policy", ids, attention, response_mask, share=True)
    assert calls == [ids.numel()] * 2  # one whole-row pass each (the embedding is not recomputed)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert all(torch.equal(grads[name], value) for name, value in expected_grads.items())


def test_equal_ids_under_another_mask_are_not_shared():
    ids = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 8], [0, 5, 6, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])  # row 1's first token is real, not padding
    first, inverse = prefix_groups(ids, mask, 3)
    assert inverse[0] == inverse[2] != inverse[1] and sorted(first.tolist()) == [0, 1]


@pytest.mark.slow
def test_grpo_fits_the_same_with_and_without_shared_prompts(tiny_model_dir, reward_dir, tmp_path):
    """GRPO (4 responses per prompt, one minibatch, two epochs, two micro-batches that split groups): sharing off
    in one process against sharing on in one process, under DDP and under FSDP2 (two CPU ranks)."""
    args = ["--config", str(REPO / "configs" / "grpo.yaml"), *COMMON, *ONLINE, f"--model.init_args.base.name_or_path={tiny_model_dir}",
            f"--model.init_args.reward.init_args.path={reward_dir}", "--model.init_args.update.gradient_accumulation=2",
            "--model.init_args.sharded_rollout=per_layer"]  # under FSDP2, every forward pass all-gathers its layers
    runs = {"off": ["--model.init_args.share_prompt=false", "--data.init_args.batch_size=4", "--trainer.devices=1"],
            "on": ["--data.init_args.batch_size=4", "--trainer.devices=1"],
            **{strategy: ["--data.init_args.batch_size=2", *options] for strategy, options in STRATEGIES.items()}}
    plans = {name: {"args": [*args, *extra, f"--model.init_args.export_dir={tmp_path / name}"],
                    "out": str(tmp_path / f"{name}.pt")} for name, extra in runs.items()}
    run_all([plans["off"], plans["on"]], tmp_path, "single")
    run_all([plans[name] for name in STRATEGIES], tmp_path, "distributed")
    off = torch.load(tmp_path / "off.pt")
    for name in ("on", *STRATEGIES):
        on = torch.load(tmp_path / f"{name}.pt")
        assert len(on["metrics"]) == len(off["metrics"]) >= 2 and len(on["gradients"]) == len(off["gradients"]) >= 4
        for expected, actual in zip(off["metrics"], on["metrics"], strict=True):
            for key, value in expected.items():
                if name == "on" or not key.endswith(PER_RANK):
                    assert actual[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
        for expected, actual in zip(off["gradients"], on["gradients"], strict=True):
            assert expected.keys() == actual.keys() and expected
            for key, value in expected.items():
                assert close(actual[key], value, 1e-4, 1e-6), (name, key, (actual[key] - value).abs().max())
        for key, value in off["weights"].items():
            assert close(on["weights"][key], value, 1e-5, 1e-5), (name, key)
