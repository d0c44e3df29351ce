"""The ``loss`` group of the policy-gradient modules (``rlhf_lightning.algorithms.loss_settings``): its checks name
the dotted key, its defaults pass, and a module reads its fields (the loss mask, the aggregation, the entropy and
pretraining weights) from the group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_lightning import GRPO, PPO, LossSettings
from tests.helpers.group_checks import assert_check_names_the_field
from tests.helpers.modules import unbuilt


@pytest.mark.parametrize("bad, message", [
    (dict(aggregation="sum"), "loss.aggregation must be one of token_mean, sequence_mean, constant, got 'sum'"),
    (dict(ent_coef=-0.01), "loss.ent_coef must be >= 0, got -0.01"),
    (dict(ptx_coef=-1.0), "loss.ptx_coef must be >= 0, got -1.0"),
])
def test_the_loss_group_names_its_dotted_key(bad, message):
    assert_check_names_the_field(LossSettings(**bad), message, "loss", "policy_loss_settings")


def test_the_loss_group_passes_its_defaults_and_every_aggregation():
    assert LossSettings().check() == LossSettings("token_mean", False, 0.0, 0.0)
    for aggregation in ("token_mean", "sequence_mean", "constant"):
        assert LossSettings(aggregation=aggregation).check().aggregation == aggregation
    assert [field.name for field in dataclasses.fields(LossSettings)] == [
        "aggregation", "mask_truncated_completions", "ent_coef", "ptx_coef"]


def test_a_module_reads_the_loss_mask_and_the_pretraining_weight_from_its_loss_group():
    responses = torch.tensor([[True, True, False], [True, True, True]])
    stopped = torch.tensor([True, False])
    experience = type("Rows", (), {"response_mask": responses, "is_stopped": stopped})()
    kept = unbuilt(GRPO)
    masked = unbuilt(GRPO, loss={"mask_truncated_completions": True, "ptx_coef": 0.25})
    assert torch.equal(kept.loss_mask(experience), responses)  # off: every response token carries loss
    assert masked.loss_mask(experience).tolist() == [[True, True, False], [False, False, False]]  # the cut-off row
    assert (kept.ptx_coef, masked.ptx_coef) == (0.0, 0.25)
    assert unbuilt(PPO, loss={"ptx_coef": 0.5}).ptx_coef == 0.5
