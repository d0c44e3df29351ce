"""lm-eval's results as flat metric names, generation settings in lm-eval's spelling, settings refused in one line,
and an evaluation that leaves the caller's random streams as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rlhf_lightning.evaluation.harness import (
    HarnessSettings,
    metric_values,
    parse_gen_kwargs,
    random_state_kept,
)


def test_metric_values_name_each_result_by_task_metric_and_filter():
    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                     "exact_match_stderr,strict-match": 0.05, "exact_match,flexible-extract": 0.5,
                                     "exact_match_stderr,flexible-extract": "N/A", "sample_len": 4},
                           "arc": {"acc,none": np.float64(0.5), "acc_norm,none": float("nan"), "name": "arc"}},
               "groups": {"mmlu": {"acc,none": 0.3, "acc_stderr,none": 0.01, "alias": "mmlu"}}}
    assert metric_values(results) == {"gsm8k/exact_match/strict-match": 0.25,
                                      "gsm8k/exact_match_stderr/strict-match": 0.05,
                                      "gsm8k/exact_match/flexible-extract": 0.5, "arc/acc": 0.5, "mmlu/acc": 0.3,
                                      "mmlu/acc_stderr": 0.01}


def test_gen_kwargs_read_as_lm_eval_writes_them():
    assert parse_gen_kwargs("temperature=0,max_gen_toks=64,do_sample=false,until=.") == {
        "temperature": 0, "max_gen_toks": 64, "do_sample": False, "until": "."}
    assert parse_gen_kwargs("") is None
    with pytest.raises(ValueError, match="gen_kwargs: 'temperature' is not KEY=VALUE"):
        parse_gen_kwargs("temperature")


@pytest.mark.parametrize("settings, message", [
    (HarnessSettings(limit=0), "limit must be a count > 0 or a share in"),
    (HarnessSettings(limit=1.5), "limit must be a count > 0 or a share in"),
    (HarnessSettings(num_fewshot=-1), "num_fewshot must be >= 0"),
    (HarnessSettings(bootstrap_iters=-1), "bootstrap_iters must be >= 0"),
])
def test_settings_out_of_range_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        settings.check()


def test_an_evaluation_leaves_the_random_streams_as_they_were():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with random_state_kept():
        random.seed(1234), np.random.seed(1234), torch.manual_seed(1234)  # what lm-eval does
        random.random(), np.random.rand(), torch.rand(3)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
