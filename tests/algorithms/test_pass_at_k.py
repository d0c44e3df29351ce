"""pass@k and maj@k: the unbiased estimator against its binomial formula, majority votes with ties and abstentions,
the setting's checks, and the values of judged responses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_lightning.algorithms.pass_at_k import maj_at_k, majority_correct, pass_at_k
from rlhf_lightning.cli import main
from rlhf_lightning.core.held_out_pass_at_k import PassAtK, answer_reader, pass_at_k_values
from rlhf_lightning.tasks.arithmetic import exact_match, final_answer

REPO = Path(__file__).resolve().parents[2]


def test_pass_at_k_is_the_unbiased_estimator_of_chen_et_al():
    """``1 - C(n-c, k) / C(n, k)`` for every count of correct responses and every k, n = 10 (eq. 1 of the Codex
    paper), one prompt per row."""
    n = 10
    correct = torch.tensor([[j < c for j in range(n)] for c in range(n + 1)])
    for k in range(1, n + 1):
        expected = [1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k) for c in range(n + 1)]
        assert pass_at_k(correct, k).tolist() == pytest.approx(expected, abs=1e-6)
    # pass@1 is the share of correct responses, whatever their order
    shuffled = torch.tensor([[False, True, False, True, False, False, False, False, False, True]])
    assert pass_at_k(shuffled, 1).item() == pytest.approx(0.3)


def test_pass_at_k_refuses_k_above_the_responses():
    with pytest.raises(ValueError, match=r"^pass@5 needs 1 <= k <= n, the responses per prompt \(n = 4\)$"):
        pass_at_k(torch.ones(2, 4, dtype=torch.bool), 5)


def test_majority_vote_ties_and_abstentions():
    assert majority_correct([7, 7, 3], [True, True, False]) == 1.0
    assert majority_correct([7, 3, 3], [True, False, False]) == 0.0
    assert majority_correct([7, 3], [True, False]) == 0.5  # a tie: the chance that breaking it at random is right
    assert majority_correct([None, None, 3], [False, False, True]) == 1.0  # no answer, no vote
    assert majority_correct([None, None], [False, False]) == 0.0


def test_maj_at_k_averages_consecutive_blocks():
    answers = [[1, 1, 2, None, 3, 3, 3, 4], [5, 6, 5, 6, 5, 5, 9, 9]]
    correct = torch.tensor([[True, True, False, False, False, False, False, False],
                            [True, False, True, False, True, True, False, False]])
    # prompt 1: block [1,1,2,-] votes 1 (right), block [3,3,3,4] votes 3 (wrong); prompt 2: [5,6,5,6] ties (0.5),
    # [5,5,9,9] ties (0.5)
    assert maj_at_k(answers, correct, 4).tolist() == [0.5, 0.5]
    # k = 8: one block; prompt 1 votes 3 (wrong), prompt 2 votes 5 (right)
    assert maj_at_k(answers, correct, 8).tolist() == [0.0, 1.0]
    # k = 3: two blocks of the first 6
    assert maj_at_k(answers, correct, 3).tolist() == pytest.approx([(1.0 + 0.0) / 2, (1.0 + 1.0) / 2])


def test_the_setting_defaults_and_one_line_errors():
    assert PassAtK(samples=8).ks == [1, 2, 4, 8]
    assert PassAtK(samples=6).ks == [1, 2, 4, 6]
    assert PassAtK(samples=8, k=[8, 1, 4]).ks == [1, 4, 8]
    assert PassAtK(samples=8).metric_names(with_majority=True) == [
        "pass@1", "pass@2", "pass@4", "pass@8", "maj@2", "maj@4", "maj@8"]
    assert not PassAtK().enabled
    with pytest.raises(ValueError, match=r"^pass_at_k\.k: 16 is outside 1\.\.8 \(pass_at_k\.samples, the responses "
                                         r"per prompt that pass@k and maj@k are estimated from\)$"):
        PassAtK(samples=8, k=[4, 16]).check()
    with pytest.raises(ValueError, match=r"pass_at_k\.samples"):
        PassAtK(samples=0).check()


def test_values_of_responses_judged_by_the_arithmetic_checker():
    """Four responses to each of two problems, judged by ``exact_match``; maj@k votes on ``final_answer``."""
    assert answer_reader(exact_match) is final_answer
    prompts = ["add 4 7 + 3 8"] * 4 + ["add 1 + 2"] * 4
    completions = ["answer 8 5", "answer 8 4", "answer 8 4", "no answer",  # 85 is right
                   "answer 3", "answer 3", "answer 4", "answer 3"]  # 3 is right
    gold = exact_match(prompts, completions)
    values = pass_at_k_values(PassAtK(samples=4), gold, completions, final_answer)
    assert values["pass@1"].tolist() == [0.25, 0.75]
    assert values["pass@2"].tolist() == pytest.approx([1 - math.comb(3, 2) / math.comb(4, 2), 1.0])
    assert values["pass@4"].tolist() == [1.0, 1.0]
    assert values["maj@2"].tolist() == [(0.5 + 0.0) / 2, (1.0 + 0.5) / 2]  # ties in blocks [85,84] and [4,3]
    assert values["maj@4"].tolist() == [0.0, 1.0]  # 84 outvotes 85; 3 outvotes 4
    assert set(pass_at_k_values(PassAtK(samples=4), gold, completions, None)) == {"pass@1", "pass@2", "pass@4"}


def test_a_real_valued_gold_reward_that_never_reaches_correct_at_is_named():
    """The synthetic task's gold reward is a score, not a checker: pass@k would read 0 for every k in silence."""
    completions = ["a", "b", "c", "d"]
    with pytest.warns(UserWarning, match=r"^pass_at_k: no held-out response's gold reward reached "
                                         r"pass_at_k.correct_at \(1\), and the gold reward is not a checker's 0 or 1"):
        values = pass_at_k_values(PassAtK(samples=2), [0.3, -0.2, 0.7, 0.1], completions, None)
    assert float(values["pass@2"].sum()) == 0.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checker's zeros, or a score that reaches correct_at: no word
        pass_at_k_values(PassAtK(samples=2), [0.0, 0.0, 0.0, 0.0], completions, None)
        pass_at_k_values(PassAtK(samples=2, correct_at=0.5), [0.3, -0.2, 0.7, 0.1], completions, None)


@pytest.mark.parametrize(("argument", "expected"), [
    ("--model.init_args.gold_reward=null", "error: pass_at_k.samples=8 needs gold_reward: pass@k and maj@k count "
     "the responses a verifier judges correct (e.g. rlhf_lightning.tasks.arithmetic.exact_match)"),
    ("--model.init_args.pass_at_k.k=[1,16]", "error: pass_at_k.k: 16 is outside 1..8 (pass_at_k.samples, the "
     "responses per prompt that pass@k and maj@k are estimated from)"),
])
def test_a_setting_that_cannot_work_is_one_line_before_any_weight_is_read(capsys, tmp_path, argument, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs/arithmetic_grpo.yaml"), argument,
              f"--model.init_args.base.name_or_path={tmp_path / 'absent'}", "--trainer.logger=false"])
    assert exit_info.value.code == 1
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [expected]
