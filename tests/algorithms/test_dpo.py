"""Number-by-number checks of the offline preference losses against values worked out by hand.

The running example (pair A): policy log-probs chosen -3.0 / rejected -5.0, reference -4.0 / -4.5, response
lengths 2 / 5 tokens. Then
    Delta_w = -3.0 - (-4.0) = 1.0,   Delta_l = -5.0 - (-4.5) = -0.5,   Delta = 1.0 - (-0.5) = 1.5,
    per-token Delta_bar = 1.0 / 2 - (-0.5 / 5) = 0.5 + 0.1 = 0.6,
    implicit rewards at beta 0.1: chosen 0.1 * 1.0 = 0.1, rejected 0.1 * -0.5 = -0.05.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.algorithms.dpo import DPOLossOutput, dpo_loss, nll_loss, pair_values
from rlhf_lightning.algorithms.preference_losses import (
    IPO,
    Hinge,
    PreferenceLoss,
    Robust,
    Sigmoid,
    SigmoidNorm,
    SimPO,
)

# TRL's loss_type names of our registered losses (each loss's `name`, the one in its logged curve).
BY_TRL_NAME = {"sigmoid": Sigmoid, "robust": Robust, "ipo": IPO, "hinge": Hinge, "sigmoid_norm": SigmoidNorm,
               "simpo": SimPO}
REFERENCE_TYPES = ("sigmoid", "robust", "ipo", "hinge", "sigmoid_norm")
ALL_TYPES = (*REFERENCE_TYPES, "simpo")


def loss_of(loss_type: str, label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> PreferenceLoss:
    """The registered loss TRL calls ``loss_type``, with its arguments (only the losses that take them)."""
    cls = BY_TRL_NAME[loss_type]
    options = {"label_smoothing": label_smoothing} if cls in (Sigmoid, Robust, SimPO) else {}
    if cls is SimPO:
        options["gamma"] = simpo_gamma
    loss = cls(**options)
    assert loss.name == loss_type
    return loss


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def neg_log_sigmoid(x: float) -> float:
    return -math.log(sigmoid(x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected, atol: float = 1e-10) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-9)


def pair_a(**overrides) -> dict:
    """The running example as a batch of one pair, as keyword arguments of dpo_loss."""
    inputs = dict(
        policy_chosen_logps=t(-3.0),
        policy_rejected_logps=t(-5.0),
        ref_chosen_logps=t(-4.0),
        ref_rejected_logps=t(-4.5),
        chosen_lengths=t(2.0),
        rejected_lengths=t(5.0),
    )
    inputs.update(overrides)
    return inputs


# ---------------------------------------------------------------- sigmoid (DPO / cDPO)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_matches_hand_values(beta):
    out = dpo_loss(**pair_a(), beta=beta, loss=loss_of("sigmoid"))
    close(out.losses, [neg_log_sigmoid(beta * 1.5)])  # beta 0.1: -log s(0.15) = 0.6201...; 0.5: -log s(0.75)
    close(out.logits, [1.5])  # Delta, before beta
    close(out.chosen_rewards, [beta * 1.0])
    close(out.rejected_rewards, [beta * -0.5])


def test_sigmoid_beta_01_literal_value():
    # log(1 + e^-0.15) = log(1.860707976...) = 0.620957...; written out once so a wrong sigmoid cannot hide.
    out = dpo_loss(**pair_a(), beta=0.1)
    close(out.losses, [math.log(1.0 + math.exp(-0.15))])
    assert abs(out.losses.item() - 0.6209) < 1e-4


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.1), (0.5, 0.25)])
def test_sigmoid_label_smoothing_is_cdpo(beta, eps):
    out = dpo_loss(**pair_a(), beta=beta, loss=loss_of("sigmoid", label_smoothing=eps))
    x = beta * 1.5
    expected = (1 - eps) * neg_log_sigmoid(x) + eps * neg_log_sigmoid(-x)
    close(out.losses, [expected])
    # Smoothing costs something whenever the margin is positive: the flipped label disagrees.
    assert out.losses.item() > neg_log_sigmoid(x)


# ---------------------------------------------------------------- robust


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.1), (0.5, 0.3)])
def test_robust_matches_hand_values(beta, eps):
    out = dpo_loss(**pair_a(), beta=beta, loss=loss_of("robust", label_smoothing=eps))
    x = beta * 1.5
    # TRL's sign: the flipped term is subtracted, -(1-eps)*log s(x) + eps*log s(-x), over 1 - 2 eps.
    expected = ((1 - eps) * neg_log_sigmoid(x) - eps * neg_log_sigmoid(-x)) / (1 - 2 * eps)
    close(out.losses, [expected])
    close(out.logits, [1.5])
    close(out.chosen_rewards, [beta * 1.0])


def test_robust_without_smoothing_is_plain_dpo():
    robust = dpo_loss(**pair_a(), beta=0.5, loss=loss_of("robust"))
    close(robust.losses, [neg_log_sigmoid(0.75)])


def test_robust_is_unbiased_under_label_flips():
    # Chowdhury et al.: if a label is flipped with probability eps, the expected robust loss is the clean
    # loss.
    # Swapping chosen and rejected flips the label: (1 - eps) L(Delta) + eps L(-Delta) = -log s(beta Delta).
    beta, eps = 0.5, 0.2
    kept = dpo_loss(**pair_a(), beta=beta, loss=loss_of("robust", label_smoothing=eps))
    flipped = dpo_loss(
        policy_chosen_logps=t(-5.0),
        policy_rejected_logps=t(-3.0),
        ref_chosen_logps=t(-4.5),
        ref_rejected_logps=t(-4.0),
        chosen_lengths=t(5.0),
        rejected_lengths=t(2.0),
        beta=beta,
        loss=loss_of("robust", label_smoothing=eps),
    )
    close((1 - eps) * kept.losses + eps * flipped.losses, [neg_log_sigmoid(beta * 1.5)])


# ---------------------------------------------------------------- IPO


@pytest.mark.parametrize(("beta", "expected"), [(0.1, (0.6 - 5.0) ** 2), (0.5, (0.6 - 1.0) ** 2)])
def test_ipo_uses_per_token_averaged_log_ratios(beta, expected):
    # Delta_bar = 0.6; beta 0.1: (0.6 - 1/0.2)^2 = (-4.4)^2 = 19.36; beta 0.5: (0.6 - 1)^2 = 0.16.
    out = dpo_loss(**pair_a(), beta=beta, loss=loss_of("ipo"))
    close(out.losses, [expected])
    close(out.logits, [0.6])
    # The rewards stay those of the summed log-ratios (TRL logs these too), not the averaged ones.
    close(out.chosen_rewards, [beta * 1.0])
    close(out.rejected_rewards, [beta * -0.5])


def test_ipo_literal_values():
    close(dpo_loss(**pair_a(), beta=0.1, loss=loss_of("ipo")).losses, [19.36])
    close(dpo_loss(**pair_a(), beta=0.5, loss=loss_of("ipo")).losses, [0.16])


def test_ipo_with_single_token_responses_is_the_summed_form():
    # Lengths 1 / 1: Delta_bar = Delta = 1.5, so (1.5 - 5)^2 = 12.25 at beta 0.1.
    out = dpo_loss(**pair_a(chosen_lengths=t(1.0), rejected_lengths=t(1.0)), beta=0.1, loss=loss_of("ipo"))
    close(out.losses, [12.25])


# ---------------------------------------------------------------- hinge


@pytest.mark.parametrize(("beta", "expected"), [(0.1, 0.85), (0.5, 0.25)])
def test_hinge_matches_hand_values(beta, expected):
    # relu(1 - beta * 1.5): 1 - 0.15 = 0.85; 1 - 0.75 = 0.25.
    out = dpo_loss(**pair_a(), beta=beta, loss=loss_of("hinge"))
    close(out.losses, [expected])
    close(out.logits, [1.5])


def test_hinge_is_zero_past_the_margin():
    # beta 1: 1 - 1.5 < 0, so the pair is already separated by more than 1 / beta and costs nothing.
    out = dpo_loss(**pair_a(), beta=1.0, loss=loss_of("hinge"))
    close(out.losses, [0.0])


# ---------------------------------------------------------------- sigmoid_norm (length-normalised DPO)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_norm_matches_hand_values(beta):
    # -log s(beta * 0.6): beta 0.1 -> -log s(0.06), beta 0.5 -> -log s(0.3).
    out = dpo_loss(**pair_a(), beta=beta, loss=loss_of("sigmoid_norm"))
    close(out.losses, [neg_log_sigmoid(beta * 0.6)])
    close(out.logits, [0.6])
    close(out.chosen_rewards, [beta * 1.0])


def test_length_normalisation_with_responses_of_different_lengths():
    # Two pairs with the same summed log-ratios (Delta_w 1.0, Delta_l -0.5, Delta 1.5) but swapped lengths:
    # pair 0 lengths 2 / 5 -> Delta_bar = 0.5 + 0.1 = 0.6; pair 1 lengths 5 / 2 -> 0.2 + 0.25 = 0.45.
    batch = dict(
        policy_chosen_logps=t(-3.0, -3.0),
        policy_rejected_logps=t(-5.0, -5.0),
        ref_chosen_logps=t(-4.0, -4.0),
        ref_rejected_logps=t(-4.5, -4.5),
        chosen_lengths=t(2.0, 5.0),
        rejected_lengths=t(5.0, 2.0),
    )
    beta = 5.0  # Tulu 3's dpo_norm beta
    norm = dpo_loss(**batch, beta=beta, loss=loss_of("sigmoid_norm"))
    close(norm.logits, [0.6, 0.45])
    close(norm.losses, [neg_log_sigmoid(5.0 * 0.6), neg_log_sigmoid(5.0 * 0.45)])  # -log s(3), -log s(2.25)
    # Plain DPO does not see the lengths at all.
    plain = dpo_loss(**batch, beta=beta, loss=loss_of("sigmoid"))
    close(plain.losses, [neg_log_sigmoid(7.5), neg_log_sigmoid(7.5)])


# ---------------------------------------------------------------- SimPO


def test_simpo_matches_hand_values_without_reference():
    # Average log-probs: chosen -3 / 2 = -1.5, rejected -5 / 5 = -1.0. beta 2, gamma 0.5:
    # margin = 2 * (-1.5 - (-1.0)) - 0.5 = -1.5, loss = -log s(-1.5) = 1.7014...
    out = dpo_loss(**pair_a(ref_chosen_logps=None, ref_rejected_logps=None), beta=2.0, loss=loss_of("simpo"))
    close(out.losses, [neg_log_sigmoid(-1.5)])
    close(out.logits, [-0.5 - 0.5 / 2.0])  # margin before beta: -0.5 - gamma / beta = -0.75
    close(out.chosen_rewards, [2.0 * -1.5])  # reference-free: beta * average log-prob
    close(out.rejected_rewards, [2.0 * -1.0])


@pytest.mark.parametrize(("gamma", "margin"), [(0.0, 3.0), (0.5, 2.5), (1.4, 1.6)])
def test_simpo_gamma_shifts_the_margin(gamma, margin):
    # chosen -2 over 4 tokens -> -0.5; rejected -6 over 3 tokens -> -2.0; beta 2: 2 * 1.5 - gamma.
    out = dpo_loss(
        policy_chosen_logps=t(-2.0),
        policy_rejected_logps=t(-6.0),
        ref_chosen_logps=None,
        ref_rejected_logps=None,
        chosen_lengths=t(4.0),
        rejected_lengths=t(3.0),
        beta=2.0,
        loss=loss_of("simpo", simpo_gamma=gamma),
    )
    close(out.losses, [neg_log_sigmoid(margin)])


def test_simpo_label_smoothing_is_cdpo_on_the_shifted_margin():
    # TRL's CPO: -(1 - eps) log s(m) - eps log s(-m), with m = -1.5 from the test above.
    eps = 0.1
    out = dpo_loss(
        **pair_a(ref_chosen_logps=None, ref_rejected_logps=None),
        beta=2.0,
        loss=loss_of("simpo", label_smoothing=eps),
    )
    close(out.losses, [(1 - eps) * neg_log_sigmoid(-1.5) + eps * neg_log_sigmoid(1.5)])


def test_simpo_ignores_a_reference_when_given():
    with_ref = dpo_loss(**pair_a(), beta=2.0, loss=loss_of("simpo"))
    close(with_ref.losses, [neg_log_sigmoid(-1.5)])
    close(with_ref.chosen_rewards, [-3.0])


# ---------------------------------------------------------------- policy equal to reference


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_at_zero_margin(beta):
    same = dict(
        policy_chosen_logps=t(-3.0, -7.0),
        policy_rejected_logps=t(-5.0, -1.0),
        ref_chosen_logps=t(-3.0, -7.0),
        ref_rejected_logps=t(-5.0, -1.0),
        chosen_lengths=t(2.0, 3.0),
        rejected_lengths=t(5.0, 1.0),
    )
    log2 = math.log(2.0)
    expected = {
        ("sigmoid", 0.0): log2,
        ("sigmoid", 0.2): log2,  # (1 - eps) log 2 + eps log 2
        ("robust", 0.0): log2,
        ("robust", 0.2): log2,  # ((1 - eps) - eps) log 2 / (1 - 2 eps)
        ("ipo", 0.0): (1 / (2 * beta)) ** 2,  # 25 at beta 0.1, 1 at beta 0.5
        ("hinge", 0.0): 1.0,
        ("sigmoid_norm", 0.0): log2,
    }
    for (loss_type, eps), value in expected.items():
        out = dpo_loss(**same, beta=beta, loss=loss_of(loss_type, label_smoothing=eps))
        close(out.losses, [value, value])
        close(out.logits, [0.0, 0.0])
        close(out.chosen_rewards, [0.0, 0.0])
        close(out.rejected_rewards, [0.0, 0.0])
    assert dpo_loss(**same, beta=beta).losses[0].item() == pytest.approx(log2, abs=1e-15)


# ---------------------------------------------------------------- gradients


CASES = [
    ("sigmoid", 0.0),
    ("sigmoid", 0.1),
    ("robust", 0.1),
    ("ipo", 0.0),
    ("hinge", 0.0),
    ("sigmoid_norm", 0.0),
    ("simpo", 0.0),
    ("simpo", 0.1),
]


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize(("loss_type", "eps"), CASES)
def test_gradient_raises_chosen_and_lowers_rejected(loss_type, eps, beta):
    # Pair A keeps every loss in its active region: hinge beta * 1.5 <= 0.75 < 1, and IPO's
    # Delta_bar 0.6 < 1 / (2 beta).
    chosen = t(-3.0).requires_grad_()
    rejected = t(-5.0).requires_grad_()
    out = dpo_loss(
        **pair_a(policy_chosen_logps=chosen, policy_rejected_logps=rejected),
        beta=beta,
        loss=loss_of(loss_type, label_smoothing=eps),
    )
    out.losses.sum().backward()
    assert chosen.grad.item() < 0
    assert rejected.grad.item() > 0


def test_sigmoid_gradient_value():
    # d/d lp_w of -log s(beta Delta) = -beta * s(-beta Delta) = -0.1 * s(-0.15); the rejected side gets the
    # negative of that.
    chosen = t(-3.0).requires_grad_()
    rejected = t(-5.0).requires_grad_()
    dpo_loss(**pair_a(policy_chosen_logps=chosen, policy_rejected_logps=rejected)).losses.sum().backward()
    close(chosen.grad, [-0.1 * sigmoid(-0.15)])
    close(rejected.grad, [0.1 * sigmoid(-0.15)])


def test_ipo_gradient_is_scaled_by_the_response_length():
    # d/d lp_w of (Delta_bar - 5)^2 = 2 (0.6 - 5) / |y_w| = -8.8 / 2; d/d lp_l = -2 (0.6 - 5) / 5 = 8.8 / 5.
    chosen = t(-3.0).requires_grad_()
    rejected = t(-5.0).requires_grad_()
    out = dpo_loss(**pair_a(policy_chosen_logps=chosen, policy_rejected_logps=rejected), loss=loss_of("ipo"))
    out.losses.sum().backward()
    close(chosen.grad, [-4.4])
    close(rejected.grad, [1.76])


def test_diagnostics_are_detached_and_the_loss_is_not():
    chosen = t(-3.0).requires_grad_()
    for loss_type in ALL_TYPES:
        out = dpo_loss(**pair_a(policy_chosen_logps=chosen), loss=loss_of(loss_type))
        assert out.losses.requires_grad
        assert not out.chosen_rewards.requires_grad
        assert not out.rejected_rewards.requires_grad
        assert not out.logits.requires_grad


# ---------------------------------------------------------------- batches and dtypes


def test_pairs_in_a_batch_are_independent():
    # Pair B: chosen -2 / ref -2.5 (Delta_w 0.5), rejected -2 / ref -1.5 (Delta_l -0.5), lengths 1 / 4:
    # Delta 1.0, Delta_bar = 0.5 + 0.125 = 0.625.
    batch = dict(
        policy_chosen_logps=t(-3.0, -2.0),
        policy_rejected_logps=t(-5.0, -2.0),
        ref_chosen_logps=t(-4.0, -2.5),
        ref_rejected_logps=t(-4.5, -1.5),
        chosen_lengths=t(2.0, 1.0),
        rejected_lengths=t(5.0, 4.0),
    )
    out = dpo_loss(**batch, beta=0.5, loss=loss_of("sigmoid"))
    close(out.losses, [neg_log_sigmoid(0.75), neg_log_sigmoid(0.5)])
    close(out.chosen_rewards, [0.5, 0.25])
    close(out.rejected_rewards, [-0.25, -0.25])
    ipo = dpo_loss(**batch, beta=0.5, loss=loss_of("ipo"))
    close(ipo.losses, [(0.6 - 1.0) ** 2, (0.625 - 1.0) ** 2])


def test_integer_lengths_and_dtype():
    as_float = dpo_loss(**pair_a(), loss=loss_of("sigmoid_norm"))
    as_int = dpo_loss(
        **pair_a(chosen_lengths=torch.tensor([2]), rejected_lengths=torch.tensor([5])),
        loss=loss_of("sigmoid_norm"),
    )
    close(as_int.losses, as_float.losses)
    assert as_int.losses.dtype == torch.float64
    float32 = dpo_loss(
        **{k: v.float() for k, v in pair_a().items()},  beta=0.1, loss=loss_of("ipo")
    )  # lengths cast to the log-prob dtype, not the other way round
    assert float32.losses.dtype == torch.float32
    torch.testing.assert_close(float32.losses, torch.tensor([19.36]), atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- NLL (RPO) term


def test_nll_loss_is_the_mean_of_per_sequence_per_token_nll():
    # Per sequence: 3 / 2 = 1.5 and 10 / 5 = 2.0, mean 1.75. Token-level over the batch (TRL's "sft") would be
    # 13 / 7 = 1.857..., which is not what this returns.
    chosen = t(-3.0, -10.0).requires_grad_()
    loss = nll_loss(chosen, torch.tensor([2, 5]))
    assert loss.dim() == 0
    close(loss, 1.75)
    assert abs(loss.item() - 13.0 / 7.0) > 0.1
    loss.backward()
    close(chosen.grad, [-1.0 / (2 * 2), -1.0 / (2 * 5)])  # -1 / (B * |y_i|)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan")])
def test_rejects_non_positive_beta(beta):
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(**pair_a(), beta=beta)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "simpo"])
@pytest.mark.parametrize("eps", [-0.01, 0.5, 0.7])
def test_rejects_label_smoothing_outside_zero_to_half(loss_type, eps):
    with pytest.raises(ValueError, match=r"loss.label_smoothing must lie in \[0, 0.5\)"):
        loss_of(loss_type, label_smoothing=eps)


@pytest.mark.parametrize("loss", [IPO, Hinge, SigmoidNorm])
def test_losses_that_would_ignore_label_smoothing_do_not_take_it(loss):
    with pytest.raises(TypeError, match="takes no arguments"):  # a config setting it is refused by the parser
        loss(label_smoothing=0.1)


def test_simpo_refuses_a_negative_gamma():
    with pytest.raises(ValueError, match="loss.gamma must be >= 0"):
        SimPO(gamma=-0.5)


def test_the_registry_holds_ours_and_a_users_loss_but_refuses_a_user_class_named_as_ours():
    assert {"Sigmoid", "Robust", "IPO", "Hinge", "SigmoidNorm", "SimPO"} <= set(PreferenceLoss.registry)
    namespace = {"PreferenceLoss": PreferenceLoss, "__name__": "my_losses"}
    exec("class Squared(PreferenceLoss):\n    def __call__(self, logits, beta):\n        return (beta * logits - 1) ** 2\n",
         namespace)
    try:
        squared = namespace["Squared"]
        assert PreferenceLoss.registry["Squared"] is squared and squared().name == "Squared"
        out = dpo_loss(**pair_a(), beta=0.5, loss=squared())  # Delta 1.5: (0.75 - 1)^2
        close(out.losses, [0.0625])
    finally:
        PreferenceLoss.registry.pop("Squared", None)
    with pytest.raises(TypeError, match="my_losses.IPO: IPO is the name of rlhf_lightning's DPO loss "
                                        "rlhf_lightning.algorithms.preference_losses.IPO; give yours another name"):
        exec("class IPO(PreferenceLoss):\n    pass\n", dict(namespace))
    assert PreferenceLoss.registry["IPO"] is IPO


@pytest.mark.parametrize("loss_type", REFERENCE_TYPES)
def test_reference_losses_need_a_reference(loss_type):
    with pytest.raises(ValueError, match="ref_chosen_logps is required"):
        dpo_loss(**pair_a(ref_chosen_logps=None), loss=loss_of(loss_type))
    with pytest.raises(ValueError, match="ref_rejected_logps is required"):
        dpo_loss(**pair_a(ref_rejected_logps=None), loss=loss_of(loss_type))


@pytest.mark.parametrize("loss_type", ALL_TYPES)
@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_rejects_non_positive_lengths(loss_type, bad):
    with pytest.raises(ValueError, match="chosen_lengths must be positive"):
        dpo_loss(**pair_a(chosen_lengths=t(bad)), loss=loss_of(loss_type))
    with pytest.raises(ValueError, match="rejected_lengths must be positive"):
        dpo_loss(**pair_a(rejected_lengths=torch.tensor([0])), loss=loss_of(loss_type))


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="policy_chosen_logps must be 1-D"):
        dpo_loss(**pair_a(policy_chosen_logps=torch.zeros(1, 1, dtype=torch.float64)))
    with pytest.raises(ValueError, match="policy_rejected_logps must have the shape"):
        dpo_loss(**pair_a(policy_rejected_logps=t(-5.0, -5.0)))
    with pytest.raises(ValueError, match="ref_chosen_logps must have the shape"):
        dpo_loss(**pair_a(ref_chosen_logps=t(-4.0, -4.0)))
    with pytest.raises(ValueError, match="ref_rejected_logps must have the shape"):
        dpo_loss(**pair_a(ref_rejected_logps=t(-4.0, -4.0)))
    with pytest.raises(ValueError, match="chosen_lengths must have shape"):
        dpo_loss(**pair_a(chosen_lengths=t(2.0, 2.0)))
    with pytest.raises(ValueError, match="rejected_lengths must have shape"):
        dpo_loss(**pair_a(rejected_lengths=t(2.0, 2.0)))


def test_nll_loss_validation():
    with pytest.raises(ValueError, match="chosen_lengths must be positive"):
        nll_loss(t(-3.0, -1.0), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="chosen_logps must be 1-D"):
        nll_loss(torch.zeros(2, 3), torch.tensor([2, 3]))


# ---- what DPO and online DPO log of each pair (pair_values), by hand ----

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
