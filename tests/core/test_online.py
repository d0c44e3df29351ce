"""One meaning per name in the on-policy loop: its steps are named for what they do, a subclass that still defines
an old name the loop no longer reads is refused when it is defined (in one line naming what took its place), and
the names that meant two things are split (``samples_responses``, ``Sampler.gathered_base``, the distillation
teacher's own timing phase)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rlhf_lightning import GRPO, PPO, OnlineDPO
from rlhf_lightning.core.held_out_pass_at_k import PassAtK
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.core.policy_gradient import PolicyGradient
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.utils.timing import PHASES, record_phases
from tests.helpers.modules import unbuilt
from tests.helpers.offline import make_dpo
from tests.helpers.online import first_batch, student


@pytest.mark.parametrize("name, new", [
    ("rollout", "collect_experience"), ("measure_kl", "pass_settings"), ("needs_logprobs", "pass_plan"),
    ("needs_reference", "pass_plan"), ("reuses_first_pass", "pass_plan"), ("logprobs_before_update", "pass_plan"),
    ("collect", "collector"), ("reward_inputs", "collector"), ("early_first_pass", "collector"),
    ("update", "updater"), ("micro_batches", "updater"), ("minibatch_sizes", "updater"),
])
@pytest.mark.parametrize("base", [OnlineRL, PolicyGradient, PPO, GRPO, OnlineDPO])
def test_a_subclass_defining_an_old_name_is_refused_when_defined(base, name, new):
    with pytest.raises(TypeError, match=rf"^Mine\.{name}: the loop no longer reads '{name}'; .*{new}") as error:
        type("Mine", (base,), {name: True})
    assert "\n" not in str(error.value)


def test_the_old_names_are_gone():
    for cls, names in ((OnlineRL, ("rollout", "measure_kl", "needs_logprobs", "needs_reference", "collect", "update",
                                   "reward_inputs", "guard_scores", "draw_ahead", "micro_batches")),
                       (PolicyGradient, ("reuses_first_pass", "logprobs_before_update")), (Sampler, ("gathered",))):
        assert not [name for name in names if hasattr(cls, name)], cls
    assert isinstance(PassAtK().samples, int)  # `samples` now means one thing: a count of responses


def test_whether_a_module_samples_is_samples_responses(tiny_model_dir):
    assert make_dpo(tiny_model_dir, sample_eval_batches=0).samples_responses is False
    assert make_dpo(tiny_model_dir).samples_responses is True
    assert not hasattr(unbuilt(GRPO), "samples_responses")  # an online algorithm always samples: no switch


def test_the_teacher_is_timed_as_its_own_phase(tiny_model_dir, reward_dir):
    distill = student(tiny_model_dir, reward_dir, teacher=tiny_model_dir)
    counts: Counter = Counter()
    torch.manual_seed(0)
    with record_phases(lambda name, seconds: counts.update([name])):
        distill.collect_and_prepare(first_batch(distill))
    assert "rollout/teacher" in PHASES and counts["rollout/teacher"] == 1
    assert counts["rollout/reward"] == 1  # the reward sources alone
