"""The old log-probs from the update's first forward pass (``PassPlan.reuse_first_pass``): when the update's
first optimizer step is one micro-batch of the whole rollout, its policy pass is made before the rewards and gives
the rollout's log-probs, so the rollout makes no policy pass of its own.

The policy has not moved before that step, so the numbers are the separate pass's: the same rows logged (entropy and
KL included) to 1e-4 relative, the first step's gradients to 1e-6 and the weights after four steps to 1e-5 (the
tolerances of ``test_micro_batches``: the pass runs on the rollout's rows in their own order, the separate one's
update pass on them shuffled, so sums differ in their last bits).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_lightning import GRPO, PPO
from rlhf_lightning.core.policy import POLICY
from tests.helpers.micro_batches import FIT_TOLERANCE, TOLERANCE, WEIGHT_TOLERANCE, fit, make_stopping


def counting(cls: type, reuse: bool) -> type:
    """``cls`` counting its policy passes (with and without gradients); ``reuse`` False takes the rollout's own
    old-log-prob pass, as when the first step is split into micro-batches."""

    class Counted(cls):
        passes: list[bool] = []

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            logprobs = self.policy.response_logprobs  # the forward passes of every role go through the policy

            def counted(role, *args, **kwargs):
                if role == POLICY:
                    type(self).passes.append(torch.is_grad_enabled())
                return logprobs(role, *args, **kwargs)

            self.policy.response_logprobs = counted

    Counted.__name__ = cls.__name__
    if not reuse:  # as if the first step were split: the plan takes the rollout's own pass
        Counted.pass_settings = lambda self: dataclasses.replace(cls.pass_settings(self), whole_first_step=False)
    Counted.passes = []
    return Counted


@pytest.mark.parametrize("cls, options", [
    (PPO, {"loss": {"ent_coef": 0.01}}),  # the KL penalty in the rewards reads the old log-probs before the advantages
    (GRPO, {"kl": {"coef": 0.1, "added_to": "loss"}}),
], ids=["PPO", "GRPO"])
def test_the_first_update_pass_gives_the_old_logprobs_with_one_policy_pass_fewer(cls, options, stopping_model_dir,
                                                                                 tmp_path):
    reused, separate = counting(cls, reuse=True), counting(cls, reuse=False)
    one = fit(reused, stopping_model_dir, tmp_path / "reused", **options)  # 2 iterations of 2 epochs
    other = fit(separate, stopping_model_dir, tmp_path / "separate", **options)
    # the separate pass: a rollout pass without gradients and two update passes per iteration; reused: the two
    assert separate.passes == [False, True, True] * 2
    assert reused.passes == [True, True] * 2
    for row, other_row in zip(one["rows"], other["rows"], strict=True):
        assert row.keys() == other_row.keys()
        assert {"policy/entropy", "objective/kl"} <= {name.split("/", 1)[1] for name in row}
        for metric, value in row.items():
            assert other_row[metric] == pytest.approx(value, rel=1e-4, abs=1e-5), metric
    assert len(one["gradients"]) == len(other["gradients"]) == 4
    for step, (expected, actual) in enumerate(zip(other["gradients"], one["gradients"], strict=True)):
        for parameter, gradient in expected.items():
            torch.testing.assert_close(actual[parameter], gradient, **(FIT_TOLERANCE if step else TOLERANCE),
                                       msg=lambda m, where=f"step {step}, {parameter}": f"{where}: {m}")
    for parameter, weight in other["weights"].items():
        torch.testing.assert_close(one["weights"][parameter], weight, **WEIGHT_TOLERANCE)


@pytest.mark.parametrize("options, reuses, rollout_pass", [
    ({"update": {"epochs": 2}}, True, False),
    ({"update": {"epochs": 2, "gradient_accumulation": 2}}, False, True),  # the first step is two micro-batches
    ({"update": {"epochs": 2, "micro_batch_tokens": 1000}}, False, True),
    ({"update": {"epochs": 2, "num_minibatches": 2}}, False, True),
    ({"update": {"epochs": 1}, "kl": {"added_to": "loss"}}, False, False),  # one step, nothing read before it
    ({"update": {"epochs": 1}}, True, False),  # one step, but the KL penalty in the rewards reads them first
])
def test_which_updates_reuse_their_first_pass(options, reuses, rollout_pass, stopping_model_dir):
    module = make_stopping(PPO, stopping_model_dir, **options)
    assert module.pass_plan.reuse_first_pass is reuses
    assert module.pass_plan.rollout_logprobs is rollout_pass  # the rollout's own policy pass
