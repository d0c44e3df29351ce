"""The learning-rate schedule: its decays are transformers' number for number, its warm-up is the one its
docstring says, and a lazy total is read only when a decay needs it. The ``optimizer`` group's checks name the
dotted key."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from rlhf_lightning.utils.optim import OptimizerSettings, lr_lambda
from tests.helpers.group_checks import assert_check_names_the_field


def transformers_multipliers(factory, warmup: int, total: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = factory(optimizer, warmup, total)
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


@pytest.mark.parametrize("schedule, factory", [("linear", get_linear_schedule_with_warmup),
                                               ("cosine", get_cosine_schedule_with_warmup)])
def test_the_decay_after_warm_up_is_transformers(schedule, factory):
    warmup, total = 3, 20
    ours = [lr_lambda(schedule, warmup, total)(step) for step in range(total)]
    theirs = transformers_multipliers(factory, warmup, total)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], abs=1e-12)
    # the warm-up differs as documented: theirs starts at 0, ours at 1 / (warmup + 1)
    assert theirs[:warmup] == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert ours[:warmup] == pytest.approx([1 / 4, 2 / 4, 3 / 4])


def test_a_lazy_total_is_read_once_and_only_by_a_decay():
    asked = []

    def total() -> int:
        asked.append(1)
        return 10

    constant = lr_lambda("constant", 2, total)
    assert [constant(step) for step in range(10)] == pytest.approx([1 / 3, 2 / 3] + [1.0] * 8)
    assert asked == []
    linear = lr_lambda("linear", 2, total)
    assert [linear(step) for step in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0]) and asked == []
    assert [linear(step) for step in (3, 6, 10)] == pytest.approx([1 - 1 / 8, 1 - 4 / 8, 0.0])
    assert asked == [1]


@pytest.mark.parametrize("bad, message", [
    (dict(lr=0), "optimizer.lr must be > 0, got 0"),
    (dict(weight_decay=-0.1), "optimizer.weight_decay must be >= 0, got -0.1"),
    (dict(warmup=-1), "optimizer.warmup must be an integer >= 0, got -1"),
    (dict(schedule="step"), "optimizer.schedule must be one of constant, linear, cosine, got 'step'"),
    (dict(adam_eps=0.0), "optimizer.adam_eps must be > 0, got 0.0"),
    (dict(nonfinite="ignore"), "optimizer.nonfinite must be one of raise, skip, got 'ignore'"),
])
def test_the_optimizer_settings_checks_name_the_dotted_key(bad, message):
    assert_check_names_the_field(OptimizerSettings(**bad), message, "optimizer")
    assert OptimizerSettings().check() == OptimizerSettings()  # the defaults pass, and check returns the settings
