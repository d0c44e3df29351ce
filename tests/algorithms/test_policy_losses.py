"""Policy losses are a registry of pure functions with typed argument groups: the shipped ones (Clip, CISPO) are the
surrogate functions number for number, and a loss defined outside the package (SAPO, from its paper) is registered
by defining it and trains a step when a config names it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlhf_lightning.algorithms.policy_losses import CISPO, Clip, LossOutput, PolicyLoss, PolicyLossInput
from rlhf_lightning.algorithms.surrogate import cispo_surrogate, clipped_surrogate
from tests.helpers.cli import logged_keys, one_logged_grpo_step
from tests.helpers.user_code import user_module

REPO = Path(__file__).resolve().parents[2]

# SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", Qwen): a soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau in
# place of the clip, tau_pos for positive advantages and tau_neg (larger: faster decay) for the others; TRL 1.16's
# loss_type="sapo" with its defaults 1.0 and 1.05.
SAPO_MODULE = '''
import torch

from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.algorithms.policy_losses import LossOutput, PolicyLoss


class SAPO(PolicyLoss):
    """Soft Adaptive Policy Optimization: -sigmoid(tau (r - 1)) * 4 / tau * A.

    Args:
        temperature_positive: tau for tokens with a positive advantage.
        temperature_negative: tau for the others.
    """

    def __init__(self, temperature_positive: float = 1.0, temperature_negative: float = 1.05) -> None:
        self.temperature_positive = temperature_positive
        self.temperature_negative = temperature_negative

    def surrogate(self, logprobs, old_logprobs, advantages, mask):
        ratio = torch.exp(torch.where(mask, logprobs - old_logprobs, 0.0))
        tau = torch.where(advantages > 0, self.temperature_positive, self.temperature_negative)
        gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
        return LossOutput(-torch.where(mask, gate * advantages, 0.0), {"gate": masked_mean(gate.detach(), mask)})
'''


@pytest.fixture
def sapo(tmp_path, monkeypatch):
    with user_module(tmp_path, monkeypatch, "my_losses", SAPO_MODULE) as my_losses:
        yield my_losses.SAPO
    PolicyLoss.registry.pop("SAPO", None)


def tokens(seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(3, 5, generator=generator) * 2
    old = logprobs + 0.3 * torch.randn(3, 5, generator=generator)
    advantages = torch.randn(3, 1, generator=generator).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool()
    return logprobs.requires_grad_(), old, advantages, mask


def test_clip_and_cispo_are_the_surrogate_functions_with_their_statistics():
    logprobs, old, advantages, mask = tokens()
    clip = Clip(clip_range=0.1, clip_range_high=0.3, ratio_level="sequence")
    out = clip.surrogate(logprobs, old, advantages, mask)
    expected = clipped_surrogate(logprobs, old, advantages, mask, 0.1, 0.3, "sequence")
    torch.testing.assert_close(out.per_token, expected.loss)
    clipped = expected.clipped_low | expected.clipped_high
    assert float(out.statistics["clipfrac"]) == pytest.approx(float(clipped[mask].float().mean()))
    cispo = CISPO(max_weight=1.1, min_weight=0.9)
    torch.testing.assert_close(cispo.surrogate(logprobs, old, advantages, mask).per_token,
                               cispo_surrogate(logprobs, old, advantages, mask, 1.1, 0.9).loss)
    assert clip.ratio_level == "sequence" and CISPO().ratio_level == "token"
    assert {"Clip", "CISPO"} <= set(PolicyLoss.registry) and PolicyLoss.registry["CISPO"] is CISPO
    assert Clip(0.2) == Clip(0.2) != Clip(0.3) and repr(Clip(0.2)).startswith("Clip(clip_range=0.2")


def test_a_loss_sees_one_typed_input_and_takes_its_anchor_and_the_correction_from_it():
    """The loss's input holds the proximal and the behaviour log-probs; ``clip_against`` picks the ratio's
    denominator, and the rollout correction's weights multiply each token's loss."""
    logprobs, proximal, advantages, mask = tokens(2)
    behaviour = proximal - 0.4 * torch.rand(3, 5, generator=torch.Generator().manual_seed(3))
    weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(4))
    inputs = PolicyLossInput(logprobs, proximal, behaviour, advantages, mask, correction=weights)
    for loss in (Clip(clip_range=0.1), CISPO(max_weight=1.2)):
        torch.testing.assert_close(loss(inputs).per_token,
                                   loss.surrogate(logprobs, proximal, advantages, mask).per_token * weights)
    against_sampler = Clip(clip_range=0.1, clip_against="sampler")
    plain = dataclasses.replace(inputs, correction=None)
    torch.testing.assert_close(against_sampler(plain).per_token,
                               clipped_surrogate(logprobs, behaviour, advantages, mask, 0.1, 0.1, "token").loss)
    assert not torch.equal(against_sampler(plain).per_token, Clip(clip_range=0.1)(plain).per_token)
    with pytest.raises(ValueError, match="^policy_loss.clip_against must be one of proximal, sampler"):
        Clip(clip_against="behaviour")


def test_a_loss_written_for_the_old_four_tensor_call_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"OldStyle.__call__ takes the loss's tensors one by one: a policy loss now "
                                        r"receives one PolicyLossInput; rename the method to surrogate\("):
        class OldStyle(PolicyLoss):
            def __call__(self, logprobs, old_logprobs, advantages, mask):
                return LossOutput(-advantages * logprobs, {})
    assert "OldStyle" not in PolicyLoss.registry


def test_a_loss_from_outside_the_package_is_registered_and_is_the_papers_formula(sapo):
    assert PolicyLoss.registry["SAPO"] is sapo  # defining the class registered it
    logprobs, old, advantages, mask = tokens(1)
    out = sapo().surrogate(logprobs, old, advantages, mask)
    ratio = torch.exp(logprobs.detach() - old)
    for row in range(3):  # the paper's gate, written out token by token
        for t in range(5):
            if not mask[row, t]:
                assert out.per_token[row, t] == 0
                continue
            tau = 1.0 if advantages[row, t] > 0 else 1.05
            gate = 4 / tau / (1 + torch.exp(-tau * (ratio[row, t] - 1)))
            torch.testing.assert_close(out.per_token[row, t].detach(), -gate * advantages[row, t])
    # On-policy (ratio 1) its gradient is the policy gradient's, -A grad log pi: sigmoid'(0) * 4 = 1.
    on_policy = sapo().surrogate(logprobs, logprobs.detach(), advantages, mask).per_token.sum()
    (gradient,) = torch.autograd.grad(on_policy, logprobs)
    torch.testing.assert_close(gradient, torch.where(mask, -advantages, 0.0))


def test_a_config_names_the_loss_and_a_step_trains_with_it(sapo, tiny_model_dir, reward_dir, tmp_path):
    config = tmp_path / "sapo.yaml"
    config.write_text("model:\n  init_args:\n    policy_loss:\n      class_path: my_losses.SAPO\n"
                      "      init_args: {temperature_negative: 2.0}\n")
    one_logged_grpo_step(tiny_model_dir, reward_dir, config, "sapo")
    expected = {"grpo/policy/gate", "grpo/loss/policy", "grpo/grad_norm"}
    keys = logged_keys(tmp_path / "sapo", expected)
    assert expected <= keys and "grpo/policy/clipfrac" not in keys
    saved = (tmp_path / "sapo" / "config.yaml").read_text()
    assert "my_losses.SAPO" in saved and "temperature_negative: 2.0" in saved  # the run's config records it
