"""No pass pays for padding it does not need: the rollout's passes run on tensors as narrow as its rows, each
micro-batch of the update is cut to the columns its own rows need, and ``micro_batch_tokens`` packs a minibatch's
rows by length into micro-batches within a token budget (pairs of online DPO kept together).

Both are exact: a cut removes only padding, whose keys every real token masks out, and positions count real tokens
only; the loss of an optimizer step is normalised over the whole step, whatever its micro-batches. Responses stop
at their stop token, so their lengths differ.

Tolerances, fp32: a pass on a cut micro-batch gives every loss term and gradient of the uncut one to 1e-6 (absolute
and relative), and so does a fit's first optimizer step; after it, sums over micro-batches added in another order
have moved the weights in their last bits, and Adam (whose step divides by the gradient's own size) carries that on,
so the later steps' gradients and the logged losses agree to 1e-4 relative with a 1e-5 absolute floor (the
distributed equivalence tests' measure), and the weights after four steps to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import GRPO, PPO, OnlineDPO
from rlhf_lightning.core.micro_batches import pack_by_tokens, padded_size, split_to_count
from tests.helpers.episodes import calculator_batch, episodic
from tests.helpers.micro_batches import FIT_TOLERANCE, TOLERANCE, WEIGHT_TOLERANCE, fit, make_stopping
from tests.helpers.online import perturb, prompt_batch

# ---- packing, number by number -------------------------------------------------------------------------------

EXTENTS = [(3, 1), (5, 6), (4, 2), (2, 6), (5, 1)]  # (opening, response) columns of five rows


def test_rows_are_packed_longest_first_within_the_budget_and_a_longer_row_alone():
    micros = pack_by_tokens(EXTENTS, budget=20)
    # row 1 (11 columns) alone: with row 3 it would be 2 x (5 + 6) = 22; rows 3 and 2: 2 x (4 + 6) = 20
    assert micros == [[1], [3, 2], [4, 0]]
    assert [padded_size([EXTENTS[r] for r in rows]) for rows in micros] == [11, 20, 12]
    assert pack_by_tokens(EXTENTS, budget=10) == [[1], [3], [2], [4], [0]]  # row 1 over the budget: alone
    assert pack_by_tokens(EXTENTS, budget=1000) == [[1, 3, 2, 4, 0]]


def test_units_of_rows_stay_together():
    micros = pack_by_tokens(EXTENTS[:4], budget=24, unit=2)  # units (0, 1) and (2, 3), both 2 x 11 = 22
    assert micros == [[0, 1], [2, 3]]
    assert split_to_count([[0, 1, 2, 3]], EXTENTS[:4], 2, unit=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="5 rows do not split into units of 2 consecutive rows"):
        pack_by_tokens(EXTENTS, budget=24, unit=2)


def test_a_rank_with_fewer_micro_batches_splits_its_largest():
    micros = pack_by_tokens(EXTENTS, budget=20)
    assert split_to_count(micros, EXTENTS, 4) == [[1], [3], [2], [4, 0]]  # 20 tokens before 12
    assert split_to_count(micros, EXTENTS, 5) == [[1], [3], [2], [4], [0]]
    with pytest.raises(ValueError, match="5 rows in units of 1 cannot make 6 micro-batches"):
        split_to_count(micros, EXTENTS, 6)


# ---- one pass on real rollouts -------------------------------------------------------------------------------



def trainable(module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def test_the_rollout_is_as_narrow_as_its_rows(stopping_model_dir):
    """The passes after sampling (log-probs, reference, reward, values) run on the rollout's own tensors: no column
    of them is padding in every row."""
    module = make_stopping(PPO, stopping_model_dir)
    experience, _ = module.collect_and_prepare(prompt_batch(module))
    openings, responses = experience.row_extents()
    assert openings.max() == experience.prompt_length and responses.max() == experience.response_mask.shape[1]
    assert len(set(responses.tolist())) > 1 and len(set(openings.tolist())) > 1  # lengths differ: padding exists


@pytest.mark.parametrize("cls, options", [
    (GRPO, {"loss": {"aggregation": "token_mean", "ent_coef": 0.01}, "kl": {"coef": 0.1}}),
    (GRPO, {"loss": {"aggregation": "sequence_mean"}, "kl": {"coef": 0.1}}),
    (GRPO, {"loss": {"aggregation": "constant"}, "kl": {"coef": 0.1}}),
    (PPO, {"loss": {"ent_coef": 0.01}}),
], ids=["token_mean", "sequence_mean", "constant", "PPO"])
def test_a_micro_batch_cut_to_its_rows_gives_the_same_losses_and_gradients(cls, options, stopping_model_dir):
    module = make_stopping(cls, stopping_model_dir, **options)
    perturb(module, "policy", "critic")
    experience, _ = module.collect_and_prepare(prompt_batch(module, n=8))
    openings, responses = experience.row_extents()
    short = (openings < openings.max()) & (responses < responses.max())  # rows with padding on both sides
    assert short.sum() >= 2
    micro = experience.select(short.nonzero().flatten())
    cut = micro.cut(*(int(extent.max()) for extent in micro.row_extents()))
    assert cut.input_ids.shape[1] < micro.input_ids.shape[1] and cut.prompt_length < micro.prompt_length
    assert cut.response_mask.shape[1] < micro.response_mask.shape[1]
    whole, narrow = module.losses(micro), module.losses(cut)
    assert whole.keys() == narrow.keys()
    for name, value in whole.items():
        torch.testing.assert_close(narrow[name], value, **TOLERANCE, msg=name)
    parameters = trainable(module)
    gradients = torch.autograd.grad(whole["loss/total"], parameters)
    cut_gradients = torch.autograd.grad(narrow["loss/total"], parameters)
    assert any(bool(g.abs().sum() > 0) for g in gradients)
    for expected, actual in zip(gradients, cut_gradients, strict=True):
        torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_a_cut_episode_micro_batch_gives_the_same_losses_and_gradients(calculator_model_dir):  # noqa: F811
    """Episodes: the environment's tokens between the policy's turns are context (real tokens, no loss) and stay;
    only the padding after each micro-batch's longest episode goes."""
    module = episodic(GRPO, calculator_model_dir, kl={"coef": 0.1}, samples_per_prompt=4)
    perturb(module, "policy")
    experience, _ = module.collect_and_prepare(calculator_batch(module))
    openings, responses = experience.row_extents()
    context = experience.attention_mask[:, experience.prompt_length:].bool() & ~experience.response_mask
    assert context.any()  # the environment answered some turns
    micro = experience.select(torch.argsort(responses)[:4])  # the shortest episodes
    cut = micro.cut(*(int(extent.max()) for extent in micro.row_extents()))
    assert cut.response_mask.shape[1] < micro.response_mask.shape[1]
    whole, narrow = module.losses(micro), module.losses(cut)
    for name, value in whole.items():
        torch.testing.assert_close(narrow[name], value, **TOLERANCE, msg=name)
    gradients = torch.autograd.grad(whole["loss/total"], trainable(module))
    for expected, actual in zip(gradients, torch.autograd.grad(narrow["loss/total"], trainable(module)), strict=True):
        torch.testing.assert_close(actual, expected, **TOLERANCE)


# ---- whole fits ----------------------------------------------------------------------------------------------



# means over micro-batches of each micro-batch's own mean (token means, online DPO's means over pairs): they depend on
# the split by design
PER_MICRO_BATCH = ("approx_kl", "clipfrac", "ratio", "entropy", "mismatch", "loss/kl", "correction", "corrected",
                   "rewards/", "logps/")


@pytest.mark.parametrize("cls, options", [
    (GRPO, {"loss": {"aggregation": "token_mean", "ent_coef": 0.01}, "kl": {"coef": 0.1}}),
    (GRPO, {"loss": {"aggregation": "sequence_mean"}, "kl": {"coef": 0.1}}),
    (GRPO, {"loss": {"aggregation": "constant"}, "kl": {"coef": 0.1}}),
    (PPO, {"loss": {"ent_coef": 0.01}}),
    (OnlineDPO, {}),
], ids=["token_mean", "sequence_mean", "constant", "PPO", "OnlineDPO"])
def test_cut_and_packed_micro_batches_train_as_one_whole_batch(cls, options, stopping_model_dir, tmp_path):
    one = fit(cls, stopping_model_dir, tmp_path / "one", **options)  # one micro-batch per step
    for name, split in {"equal": {"update": {"gradient_accumulation": 4}}, "packed": {"update": {"micro_batch_tokens": 40}}}.items():
        other = fit(cls, stopping_model_dir, tmp_path / name, **options, **split)
        assert len(other["widths"]) > len(one["widths"]), name  # several micro-batches per step...
        assert min(other["widths"]) < min(one["widths"]), name  # ...each cut to its own rows
        for row, other_row in zip(one["rows"], other["rows"], strict=True):
            assert row.keys() == other_row.keys()
            for metric, value in row.items():
                if not any(part in metric for part in PER_MICRO_BATCH):
                    assert other_row[metric] == pytest.approx(value, rel=1e-4, abs=1e-5), (name, metric)
        assert len(other["gradients"]) == len(one["gradients"]) == 4
        for step, (expected, actual) in enumerate(zip(one["gradients"], other["gradients"], strict=True)):
            assert expected.keys() == actual.keys()
            for parameter, gradient in expected.items():
                torch.testing.assert_close(actual[parameter], gradient, **(FIT_TOLERANCE if step else TOLERANCE),
                                           msg=lambda m, where=f"{name}, step {step}, {parameter}": f"{where}: {m}")
        for parameter, weight in one["weights"].items():
            torch.testing.assert_close(other["weights"][parameter], weight, **WEIGHT_TOLERANCE,
                                       msg=lambda m, where=f"{name}, {parameter}": f"{where}: {m}")
