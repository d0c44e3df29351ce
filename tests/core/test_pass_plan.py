"""One plan of passes (``rlhf_lightning.core.pass_plan``): which passes an iteration runs is decided once, at setup,
by one pure function of the settings, and the loop reads it.

The function is checked against the five properties it replaced (``needs_logprobs``, ``needs_reference``,
``logprobs_before_update``, ``reuses_first_pass``, ``measure_kl``), written out below as they were, for every
combination of the settings that decide; every algorithm's plan is checked at its defaults; the first update pass
travels as a value (nothing with a graph is left on the module) and its time counts as the update's.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import lightning as L
import pytest
import torch
from torch import Tensor

from rlhf_lightning import GRPO, PPO, RLOO, OnlineDPO, REINFORCEPlusPlus
from rlhf_lightning.core.experience import FirstPass
from rlhf_lightning.core.pass_plan import PassPlan, PassSettings, plan_passes
from rlhf_lightning.core.update import UpdateStatistics
from rlhf_lightning.utils.timing import Stopwatch
from tests.helpers.micro_batches import make_stopping
from tests.helpers.modules import unbuilt
from tests.helpers.online import prompt_batch, prompts

# ---- the pure function against the properties it replaced ---------------------------------------------------


def before(steps: int, whole: bool, kl_in: str | None, penalised: bool, measure: bool) -> PassPlan:
    """The plan as the five properties decided it before (OnlineRL's for ``kl_in`` None, PolicyGradient's else)."""
    if kl_in is None:  # OnlineRL: no KL term, no first pass taken by its loss, no KL in its rewards
        needs_logprobs = steps > 1 or measure
        return PassPlan("rollout" if needs_logprobs else "update", measure, False)
    needs_reference = measure or penalised
    logprobs_before_update = steps > 1 or (needs_reference and kl_in == "reward")
    reuses_first_pass = logprobs_before_update and whole
    needs_logprobs = logprobs_before_update and not reuses_first_pass
    read = (kl_in == "reward" and penalised) or measure
    reward_kl = read and logprobs_before_update and needs_reference
    logprobs_pass = "rollout" if needs_logprobs else "first_update_pass" if reuses_first_pass else "update"
    return PassPlan(logprobs_pass, needs_reference, reward_kl)


COMBINATIONS = [
    *itertools.product([1, 2, 8], [True, False], ["reward", "loss"], [True, False], [True, False]),
    *itertools.product([1, 2, 8], [True, False], [None], [False], [True, False]),
]


@pytest.mark.parametrize("steps, whole, kl_in, penalised, measure", COMBINATIONS)
def test_the_plan_is_what_the_five_properties_decided(steps, whole, kl_in, penalised, measure):
    settings = PassSettings(steps, whole, kl_in=kl_in, kl_penalised=penalised, measure_kl=measure,
                            reusable_first_pass=kl_in is not None)
    plan = plan_passes(settings)
    assert plan == before(steps, whole, kl_in, penalised, measure)
    # every plan is consistent: a KL needs both log-prob sets before the rewards; one source of log-probs
    assert not plan.reward_kl or (plan.reference_logprobs and plan.logprobs_before_update)
    assert plan.rollout_logprobs + plan.reuse_first_pass + (not plan.logprobs_before_update) == 1


@pytest.mark.parametrize("settings, expected", [
    # PPO's shipped config: 4 epochs x 2 minibatches, the KL in the rewards
    (PassSettings(8, False, "reward", True, measure_kl=True, reusable_first_pass=True),
     PassPlan("rollout", True, True)),
    # PPO with one minibatch: the first step is the whole rollout, its pass made early gives the log-probs
    (PassSettings(4, True, "reward", True, measure_kl=True, reusable_first_pass=True),
     PassPlan("first_update_pass", True, True)),
    # PPO at kl.coef 0: the KL is still measured (objective/kl_penalty), before the update
    (PassSettings(1, True, "reward", False, measure_kl=True, reusable_first_pass=True),
     PassPlan("first_update_pass", True, True)),
    # PPO with the KL in the loss and one step: the step's own pass gives the log-probs, nothing is shaped
    (PassSettings(1, True, "loss", True, measure_kl=True, reusable_first_pass=True),
     PassPlan("update", True, False)),
    # GRPO's default: kl.coef 0, no reference pass at all
    (PassSettings(2, False, "loss", False, reusable_first_pass=True), PassPlan("rollout", False, False)),
    # GRPO with a KL in the loss and one step
    (PassSettings(1, True, "loss", True, reusable_first_pass=True), PassPlan("update", True, False)),
    # RLOO's KL in the rewards with one step: read before the update, from the first update pass
    (PassSettings(1, True, "reward", True, reusable_first_pass=True), PassPlan("first_update_pass", True, True)),
    # ... split into micro-batches: the rollout's own pass
    (PassSettings(1, False, "reward", True, reusable_first_pass=True), PassPlan("rollout", True, True)),
    # online DPO: the reference always (its loss reads it), the rollout's pass, no KL in any reward
    (PassSettings(1, True, measure_kl=True), PassPlan("rollout", True, False)),
])
def test_the_plans_that_matter(settings, expected):
    assert plan_passes(settings) == expected


# ---- every algorithm's plan, from its settings ----------------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs, expected", [
    (PPO, {}, PassPlan("first_update_pass", True, True)),  # 4 epochs of one minibatch
    (PPO, {"update": {"num_minibatches": 2}}, PassPlan("rollout", True, True)),  # configs/ppo.yaml's shape
    (PPO, {"update": {"num_minibatches": 1, "epochs": 1}, "kl": {"added_to": "loss"}}, PassPlan("update", True, False)),
    (GRPO, {}, PassPlan("update", False, False)),  # 1 epoch, 1 minibatch, kl.coef 0
    (GRPO, {"kl": {"coef": 0.04}, "update": {"epochs": 2}}, PassPlan("first_update_pass", True, False)),
    (RLOO, {}, PassPlan("first_update_pass", True, True)),
    (REINFORCEPlusPlus, {"update": {"gradient_accumulation": 2}}, PassPlan("rollout", True, True)),
    (OnlineDPO, {}, PassPlan("rollout", True, False)),
])
def test_each_algorithm_plans_from_its_own_settings(cls, kwargs, expected):
    made = unbuilt(cls, **kwargs)
    assert made.pass_plan == expected
    assert made.pass_plan is made.pass_plan  # made once


def test_the_plan_is_made_at_setup_from_the_final_settings():
    made = unbuilt(GRPO, update={"epochs": 2})
    early = made.pass_plan
    # a setting changed after construction: setup reads the final ones
    made.update_settings = dataclasses.replace(made.update_settings, num_minibatches=2)
    made._trainer = None
    made.setup("validate")
    assert early.reuse_first_pass and made.pass_plan.rollout_logprobs


# ---- the first update pass: a value, timed as the update's ----------------------------------------------------


def test_the_first_update_pass_is_handed_along_not_kept(stopping_model_dir):
    grpo = make_stopping(GRPO, stopping_model_dir, update={"epochs": 2}, kl={"coef": 0.1})
    assert grpo.pass_plan.reuse_first_pass
    experience, first_pass = grpo.collector.early_first_pass(grpo, grpo.collect_experience(prompt_batch(grpo))[0])
    assert isinstance(first_pass, FirstPass) and first_pass.logprobs.grad_fn is not None
    torch.testing.assert_close(experience.logprobs, first_pass.logprobs.detach())
    assert experience.first_pass is None  # only the first step's micro-batch carries it
    kept = [name for name, value in vars(grpo).items()
            if isinstance(value, FirstPass) or (isinstance(value, Tensor) and value.grad_fn is not None)]
    assert kept == []


@pytest.mark.slow
@pytest.mark.parametrize("slow_step, counted_in", [("first_update_pass", "update"), ("shape_rewards", "rollout")])
def test_the_first_update_pass_counts_in_time_update(slow_step, counted_in, stopping_model_dir, tmp_path):
    """One second slept in the first update pass (made before the rewards) lands in ``time/update``; one slept in
    shaping the rewards lands in ``time/rollout``."""
    pause = 2.0

    class Slow(GRPO):
        pass

    original = getattr(GRPO, slow_step)

    def slowed(self, *args):
        time.sleep(pause)
        return original(self, *args)

    setattr(Slow, slow_step, slowed)
    grpo = make_stopping(Slow, stopping_model_dir, update={"epochs": 2}, kl={"coef": 0.1})
    assert grpo.pass_plan.reuse_first_pass
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(grpo, datamodule=prompts(grpo, n=4, batch_size=4))
    seconds = {part: float(trainer.callback_metrics[f"grpo/time/{part}"]) for part in ("rollout", "update")}
    other = "rollout" if counted_in == "update" else "update"
    assert seconds[counted_in] >= pause > seconds[other]
    assert float(trainer.callback_metrics["grpo/time/iteration"]) == pytest.approx(sum(seconds.values()), rel=1e-5)


# ---- the small pieces the loop moved out ----------------------------------------------------------------------


def test_update_statistics_average_losses_over_steps_and_terms_over_weighted_micro_batches():
    statistics = UpdateStatistics(frozenset({"loss/total"}), torch.device("cpu"))
    one = {"loss/total": torch.tensor(1.0), "policy/clipfrac": torch.tensor(0.5)}
    two = {"loss/total": torch.tensor(2.0), "policy/clipfrac": torch.tensor(0.25)}
    statistics.add_step([one, two], [0.75, 0.25], torch.tensor(4.0))  # a step of two unequal micro-batches
    statistics.add_step([two], [1.0], torch.tensor(2.0))
    means = statistics.means()
    assert float(means["loss/total"]) == pytest.approx((3.0 + 2.0) / 2)  # each step's parts summed
    assert float(means["policy/clipfrac"]) == pytest.approx((0.5 * 0.75 + 0.25 * 0.25 + 0.25) / 2)
    assert float(means["grad_norm"]) == pytest.approx(3.0)


def test_a_stopwatch_adds_up_its_laps():
    now = iter([0.0, 1.0, 3.0, 10.0, 14.0, 20.0])
    watch = Stopwatch(clock=lambda: next(now))
    with watch.lap("rollout"):
        pass
    with watch.lap("rollout"):
        pass
    assert watch.seconds == {"rollout": 6.0}
    assert watch.elapsed() == 20.0
