"""OpenEnv environments in the rollout and in a fit: an OpenEnv game's episodes on a tiny model, every session
closed when the rollout ends, the server the fit started stopped at its teardown, and a GRPO run over them that
resumes exactly (the episodes' seeds come from their rows, so the resumed run replays the same games)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("openenv")

from rlhf_lightning import GRPO, FunctionReward  # noqa: E402
from rlhf_lightning.environments import OpenEnvEnvironment  # noqa: E402
from rlhf_lightning.environments.guess_number import solved  # noqa: E402
from rlhf_lightning.environments.openenv_sessions import RemoteSession  # noqa: E402
from tests.helpers.episodes import episodic  # noqa: E402
from tests.helpers.online import fit_iterations, prompts  # noqa: E402
from tests.rollout.test_episodes import sample_episodes  # noqa: E402

GAME = "rlhf_lightning.environments.guess_number.GuessNumberEnvironment"


def game_module(directory, **environment):
    return episodic(GRPO, directory,
                    episodes={"environment": lambda: OpenEnvEnvironment(env=GAME, **environment), "max_turns": 3,
                              "max_tokens": 40},
                    reward=FunctionReward(solved), gold_reward=solved, kl={"coef": 0.1}, update={"num_minibatches": 2})


def game_batch(module, n=4):
    return next(iter(prompts(module, n=n, dataset="guess_number", batch_size=n).train_dataloader()["prompts"]))


@pytest.mark.parametrize("serve", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_rollout_of_openenv_episodes_opens_with_the_reset_observation_and_closes_every_session(
        calculator_model_dir, serve):
    module = game_module(calculator_model_dir, serve=serve)
    torch.manual_seed(1)
    rollout = sample_episodes(module, game_batch(module), 4)
    source = rollout.episodes[0].environment.source
    for episode in rollout.episodes:
        assert episode.messages[0] == {"role": "user", "content": "guess my number, 1 to 20"}
        assert episode.environment.session is None  # closed, however the episode ended
        # every turn the environment answered has its reward (0, or 1 when the guess was the number)
        assert all(reward in (0.0, 1.0) for _, reward in episode.rewards)
    assert source.live == 0 and (source.url is None or RemoteSession.open_sessions[source.url] == 0)
    assert max(episode.turns for episode in rollout.episodes) > 1
    module.teardown("fit")  # the fit's end: the server it started is stopped, as vLLM's is
    assert source.server is None or source.server.process.poll() is not None


@pytest.mark.slow
def test_a_grpo_run_on_an_openenv_game_resumes_exactly(calculator_model_dir, tmp_path):
    first = game_module(calculator_model_dir)
    _, whole = fit_iterations(first, prompts(first, n=8, dataset="guess_number", batch_size=2), tmp_path / "whole", 4,
                              prefix="grpo/")
    second = game_module(calculator_model_dir)
    _, resumed = fit_iterations(second, prompts(second, n=8, dataset="guess_number", batch_size=2),
                                tmp_path / "resumed", 4, prefix="grpo/",
                                ckpt_path=str(tmp_path / "whole" / "epoch=0-step=4.ckpt"))
    noise = [key for key in whole[0] if "mismatch" in key]  # float noise of MKL's kernels (see test_episodes)
    assert len(resumed) == 2 and [{k: v for k, v in row.items() if k not in noise} for row in resumed] == [
        {k: v for k, v in row.items() if k not in noise} for row in whole[2:]]
    assert {"grpo/episode/env_reward", "grpo/episode/turns"} <= set(whole[0])
