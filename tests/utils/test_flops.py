"""The analytic FLOPs: generation is the step-by-step sum of its passes, and a group's rows share their prompt's
encoding."""

from __future__ import annotations

import pytest

from rlhf_lightning.utils.flops import ModelShape, TokenCounts


def test_generation_is_the_step_by_step_sum_and_a_group_encodes_its_prompt_once():
    shape = ModelShape(layers=2, width=32, vocab=64, matmul_parameters=24_576, lora_parameters=1_000)

    def step_by_step(prompt: int, response: int) -> float:
        prefill = shape.forward(prompt, sum(range(1, prompt + 1)))
        steps = sum(shape.forward(1, prompt + step + 1) for step in range(response - 1))
        return prefill + steps + shape.head(response)

    assert shape.generation(7, 5) == pytest.approx(step_by_step(7, 5))
    assert shape.generation(7, 5, rows=3) == pytest.approx(3 * step_by_step(7, 5))
    counts = TokenCounts(prompt_lengths=(5, 5, 3, 3), response_lengths=(4, 2, 1, 0), group=2)
    assert counts.generation_flops(shape) == pytest.approx(
        step_by_step(5, 4) + shape.decode(5, 2) + step_by_step(3, 1) + shape.decode(3, 0))
    assert shape.decode(3, 0) == 0.0


def test_the_measured_peak_is_positive_and_leaves_the_random_streams_alone():
    import torch

    from rlhf_lightning.utils.flops import matmul_flops_per_second

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert matmul_flops_per_second("cpu", size=64, seconds=0.01) > 0
    assert torch.equal(torch.rand(4), expected)  # the matrices came from a generator of their own
