"""The training loops mark their phases by name: a recorder sees every phase of :data:`PHASES` that a stage has,
with the counts the loop's structure implies, and nothing is recorded without one."""

from __future__ import annotations

from collections import Counter

import lightning as L

from rlhf_lightning.utils.timing import PHASES, phase, record_phases
from tests.helpers.offline import make_dpo, pairs
from tests.helpers.online import make_ppo, prompts


def recorded(module, data, **limits) -> Counter:
    counts: Counter = Counter()
    seconds: dict[str, float] = {}

    def recorder(name: str, elapsed: float) -> None:
        counts[name] += 1
        seconds[name] = seconds.get(name, 0.0) + elapsed

    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, **limits)
    with record_phases(recorder):
        trainer.fit(module, datamodule=data)
    assert set(counts) <= set(PHASES), set(counts) - set(PHASES)
    assert all(value >= 0.0 for value in seconds.values())
    return counts


def test_a_ppo_iteration_records_every_phase_of_the_on_policy_loop(tiny_model_dir, reward_dir):
    module = make_ppo(tiny_model_dir, reward_dir)  # 2 epochs x 2 minibatches, critic backward separate
    counts = recorded(module, prompts(module, n=16), max_epochs=1, limit_train_batches=2)
    steps = 2 * 2 * 2  # iterations x epochs x minibatches
    assert counts == Counter({
        "rollout/generate": 2, "rollout/logprobs": 2, "rollout/values": 2, "rollout/reward": 2,
        "update/policy forward": steps, "update/critic forward": steps,
        "update/backward": 2 * steps,  # policy, then critic (backward: separate on one device)
        "update/optimizer step": steps,
        "update/engine sync": steps,  # after each step: our decoder has nothing to bring up to date, but is asked
    })


def test_a_dpo_step_records_its_policy_and_reference_passes(tiny_model_dir):
    module = make_dpo(tiny_model_dir, precompute_reference=False)
    counts = recorded(module, pairs(module), max_steps=2)
    assert counts == Counter({"update/policy forward": 2, "update/reference forward": 2, "update/backward": 2})


def test_without_a_recorder_a_marker_measures_nothing():
    seen = []
    with phase("rollout/generate"):
        pass
    with record_phases(lambda name, seconds: seen.append(name)), phase("rollout/reward"):
        pass
    with phase("rollout/generate"):
        pass
    assert seen == ["rollout/reward"]
