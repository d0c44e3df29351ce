"""What DPO and online DPO log of each pair (:func:`~rlhf_lightning.algorithms.dpo.pair_values`), by hand."""

from __future__ import annotations

import torch

from rlhf_lightning.algorithms.dpo import DPOLossOutput, dpo_loss, pair_values


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_pair_values_by_hand():
    # Pair 0: chosen ahead by 0.2; pair 1: behind by 0.1; pair 2: a tie, which counts as wrong.
    output = DPOLossOutput(losses=t(0.0, 0.0, 0.0), chosen_rewards=t(0.3, -0.1, 0.2),
                           rejected_rewards=t(0.1, 0.0, 0.2), logits=t(0.0, 0.0, 0.0))
    values = pair_values(output, t(-3.0, -4.0, -5.0), t(-6.0, -7.0, -8.0))
    assert list(values) == ["rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
                            "logps/chosen", "logps/rejected"]
    torch.testing.assert_close(values["rewards/chosen"], t(0.3, -0.1, 0.2))
    torch.testing.assert_close(values["rewards/rejected"], t(0.1, 0.0, 0.2))
    assert values["rewards/accuracy"].tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(values["rewards/margin"], t(0.2, -0.1, 0.0))
    torch.testing.assert_close(values["logps/chosen"], t(-3.0, -4.0, -5.0))
    torch.testing.assert_close(values["logps/rejected"], t(-6.0, -7.0, -8.0))


def test_pair_values_of_a_loss_are_detached():
    chosen, rejected = t(-3.0).requires_grad_(), t(-5.0).requires_grad_()
    output = dpo_loss(chosen, rejected, t(-4.0), t(-4.5), t(2.0), t(5.0), beta=0.1)
    values = pair_values(output, chosen, rejected)
    torch.testing.assert_close(values["rewards/chosen"], t(0.1))
    torch.testing.assert_close(values["rewards/rejected"], t(-0.05))
    torch.testing.assert_close(values["rewards/margin"], t(0.15))
    assert values["rewards/accuracy"].tolist() == [1.0]
    assert not any(value.requires_grad for value in values.values())
