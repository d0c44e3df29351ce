"""Advantage estimators are a registry of typed argument groups given the cross-rank sum: the shipped ones are the
pure functions number for number, two ranks that sum through the sum they are given get the one-process batch's
advantages, and an estimator defined outside the package trains a step when a config names it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rlhf_lightning.algorithms.advantage_estimators import (
    GAE,
    AdvantageEstimator,
    AdvantageInput,
    GroupRelative,
    LeaveOneOut,
    WhitenedReturns,
)
from rlhf_lightning.algorithms.advantages import gae
from rlhf_lightning.algorithms.group import (
    group_advantages,
    normalize_advantages,
    returns_to_go,
    rloo_advantages,
)
from rlhf_lightning.algorithms.masked import masked_whiten
from rlhf_lightning.algorithms.shaped_rewards import ShapedRewards
from tests.helpers.cli import logged_keys, one_logged_grpo_step
from tests.helpers.user_code import user_module

REPO = Path(__file__).resolve().parents[2]


def rollout(seed: int = 0, rows: int = 8, group: int = 4) -> AdvantageInput:
    """Rewards of ``rows`` responses (groups of ``group``) with a per-token KL in the rewards and values."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (rows,), generator=generator)
    mask = torch.arange(6)[None, :] < lengths[:, None]
    kl = torch.where(mask, 0.1 * torch.rand(rows, 6, generator=generator), 0.0)
    rewards = ShapedRewards(torch.randn(rows, generator=generator), mask, kl, kl_coef=0.2)
    return AdvantageInput(rewards, group, torch.where(mask, torch.randn(rows, 6, generator=generator), 0.0))


def alone(value: torch.Tensor) -> torch.Tensor:
    return value


def test_each_shipped_estimator_is_its_pure_functions():
    inputs = rollout()
    rewards, mask = inputs.rewards, inputs.mask
    out = GAE(gamma=0.9, lam=0.8, whiten_rewards=True)(inputs, alone)
    token_rewards = masked_whiten(rewards.token_rewards(), mask, shift_mean=False)
    advantages, returns = gae(token_rewards, inputs.values, mask, 0.9, 0.8)
    torch.testing.assert_close(out.advantages, masked_whiten(advantages, mask), rtol=0, atol=0)
    torch.testing.assert_close(out.returns, returns, rtol=0, atol=0)
    sequence = rewards.scores - 0.2 * rewards.kl.sum(-1)  # score less the coefficient times the sequence KL
    grouped = GroupRelative(scale_rewards="none")(inputs, alone).advantages
    torch.testing.assert_close(grouped, torch.where(mask, group_advantages(sequence, 4, "none")[:, None], 0.0))
    left_out = LeaveOneOut(whiten_advantages=True)(inputs, alone)
    expected = normalize_advantages(rloo_advantages(sequence, 4))
    torch.testing.assert_close(left_out.advantages, torch.where(mask, expected[:, None], 0.0))
    assert float(left_out.statistics["objective/rlhf_reward"]) == pytest.approx(float(sequence.mean()))
    baselined = WhitenedReturns(baseline="group", gamma=0.5)(inputs, alone).advantages
    scores = rewards.scores - rewards.scores.view(2, 4).mean(-1).repeat_interleave(4)
    expected = masked_whiten(returns_to_go(rewards.token_rewards(scores), mask, 0.5), mask, unbiased=False,
                             floor=True)
    torch.testing.assert_close(baselined, expected)


class TwoRanks:
    """Two threads standing in for two ranks: ``sum`` is an all-reduce between them (each waits for the other's
    value and both get the total)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.values: list[torch.Tensor | None] = [None, None]

    def sum_for(self, rank: int):
        def reduce(value: torch.Tensor) -> torch.Tensor:
            self.values[rank] = value
            self.barrier.wait()
            total = self.values[0] + self.values[1]
            self.barrier.wait()  # both have read before either writes again
            return total
        return reduce


def on_two_ranks(estimator: AdvantageEstimator, first: AdvantageInput, second: AdvantageInput) -> list[torch.Tensor]:
    ranks, results = TwoRanks(), [None, None]

    def run(rank: int, inputs: AdvantageInput) -> None:
        results[rank] = estimator(inputs, ranks.sum_for(rank)).advantages

    threads = [threading.Thread(target=run, args=(rank, inputs)) for rank, inputs in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def halves(inputs: AdvantageInput) -> tuple[AdvantageInput, AdvantageInput]:
    rewards, values = inputs.rewards, inputs.values
    return tuple(AdvantageInput(ShapedRewards(rewards.scores[part], rewards.mask[part], rewards.kl[part],
                                              rewards.kl_coef), inputs.group_size, values[part])
                 for part in (slice(0, 4), slice(4, 8)))


@pytest.mark.parametrize("estimator", [GAE(whiten_rewards=True), GroupRelative(scale_rewards="batch"),
                                       LeaveOneOut(whiten_advantages=True), WhitenedReturns()], ids=repr)
def test_two_ranks_summing_through_the_given_sum_get_the_whole_batchs_advantages(estimator):
    """Every batch statistic goes through the sum the estimator is given: each rank's half of a batch gets the
    advantages the whole batch gets in one process (and not those of its half alone)."""
    whole = rollout(seed=1)
    first, second = halves(whole)
    together = estimator(whole, alone).advantages
    split = on_two_ranks(estimator, first, second)
    torch.testing.assert_close(torch.cat(split), together)
    assert not torch.allclose(estimator(first, alone).advantages, together[:4])


MY_ESTIMATOR = '''
import torch

from rlhf_lightning.algorithms.advantage_estimators import AdvantageEstimator, AdvantageOutput
from rlhf_lightning.algorithms.group import broadcast_to_tokens


class MeanBaseline(AdvantageEstimator):
    """Each reward less the batch's mean reward (every rank's), scaled.

    Args:
        scale: what the centred reward is multiplied by.
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, inputs, sum_over_ranks):
        rewards = inputs.rewards.sequence_rewards()
        mean = sum_over_ranks(rewards.sum()) / sum_over_ranks(torch.tensor(float(rewards.numel())))
        advantages = self.scale * (rewards - mean)
        return AdvantageOutput(broadcast_to_tokens(advantages, inputs.mask), {"objective/batch_mean": mean})
'''


@pytest.fixture
def mean_baseline(tmp_path, monkeypatch):
    with user_module(tmp_path, monkeypatch, "my_estimators", MY_ESTIMATOR) as my_estimators:
        yield my_estimators.MeanBaseline
    AdvantageEstimator.registry.pop("MeanBaseline", None)


def test_an_estimator_of_your_own_is_named_by_a_config_and_a_step_trains_with_it(mean_baseline, tiny_model_dir,
                                                                                  reward_dir, tmp_path):
    assert AdvantageEstimator.registry["MeanBaseline"] is mean_baseline  # defining the class registered it
    config = tmp_path / "mine.yaml"
    config.write_text("model:\n  init_args:\n    advantages:\n      class_path: my_estimators.MeanBaseline\n"
                      "      init_args: {scale: 2.0}\n")
    one_logged_grpo_step(tiny_model_dir, reward_dir, config, "mine")
    expected = {"grpo/objective/batch_mean", "grpo/loss/policy", "grpo/grad_norm"}
    keys = logged_keys(tmp_path / "mine", expected)
    assert expected <= keys and "grpo/objective/frac_zero_std" not in keys  # GroupRelative's statistic: not run
    saved = (tmp_path / "mine" / "config.yaml").read_text()
    assert "my_estimators.MeanBaseline" in saved and "scale: 2.0" in saved


def test_a_class_of_yours_named_as_a_shipped_estimator_is_refused():
    source = "from rlhf_lightning.algorithms.advantage_estimators import AdvantageEstimator\n" \
             "class GAE(AdvantageEstimator):\n    pass\n"
    with pytest.raises(TypeError, match=r"^elsewhere\.GAE: GAE is the name of rlhf_lightning's advantage estimator "
                                        r"rlhf_lightning\.algorithms\.advantage_estimators\.GAE; give yours"):
        exec(compile(source, "elsewhere.py", "exec"), {"__name__": "elsewhere"})
    assert AdvantageEstimator.registry["GAE"] is GAE
