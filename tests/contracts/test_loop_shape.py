"""The shape of the online modules, held where it is (issue "the online module composed"): the top-level arguments a
user reads in ``--model.help``, the classes of ours a reader follows up the chain, and the package files one PPO
iteration goes through. Each may fall; none may rise without this file saying why."""

from __future__ import annotations

import pytest

import rlhf_lightning as r
from rlhf_lightning.cli.errors import accepted_arguments
from tests.helpers.reading_order import SUPPORT, files_of_one_iteration

# Top-level arguments at most (PPO at the aim, 25; the others where the same groups left them).
ARGUMENTS_AT_MOST = {"PPO": 25, "GRPO": 24, "RLOO": 24, "REINFORCEPlusPlus": 24, "OnPolicyDistillation": 26,
                     "OnlineDPO": 20}
# Classes of ours in the method resolution order at most: itself, its family, the online base, the stage base.
OUR_CLASSES_AT_MOST = {"PPO": 4, "GRPO": 4, "RLOO": 4, "REINFORCEPlusPlus": 4, "OnPolicyDistillation": 4,
                       "OnlineDPO": 3}
LOOP_FILES_AT_MOST = 29  # of one PPO iteration, math and utilities apart (the aim is 6)


@pytest.mark.parametrize("name", ARGUMENTS_AT_MOST)
def test_an_online_module_takes_no_more_top_level_arguments_than_it_did(name):
    cls = getattr(r, name)
    arguments = accepted_arguments(f"{cls.__module__}.{cls.__qualname__}")
    assert len(arguments) <= ARGUMENTS_AT_MOST[name], sorted(arguments)
    assert {"sampling", "optimizer", "update", "episodes", "asynchronous", "reward_shaping"} <= set(arguments)


@pytest.mark.parametrize("name", OUR_CLASSES_AT_MOST)
def test_an_online_module_has_no_more_classes_of_ours_in_its_chain_than_it_did(name):
    ours = [cls.__name__ for cls in getattr(r, name).__mro__ if cls.__module__.startswith("rlhf_lightning.")]
    assert len(ours) <= OUR_CLASSES_AT_MOST[name], ours
    assert ours[0] == name and ours[-1] == "StageModule"


@pytest.mark.slow
def test_one_ppo_iteration_goes_through_no_more_files_than_it_did():
    files = files_of_one_iteration("PPO")
    loop = [name for name in files if name.split("/")[0] not in SUPPORT]
    assert {"stages/ppo.py", "core/online.py", "core/policy_gradient.py"} <= set(loop)  # the iteration was recorded
    assert len(loop) <= LOOP_FILES_AT_MOST, loop
