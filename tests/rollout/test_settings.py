"""How responses are sampled and where they stop (``rlhf_lightning.rollout.settings``): the ``sampling`` group's
checks and its stop token resolved to ids, the ``episodes`` group's checks and what it saves, and truncation at stop
tokens, by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.rollout.settings import Episodes, Sampling, SamplingSettings, stopped, truncate_after_stop
from rlhf_lightning.tasks.calculator import build_tokenizer
from tests.helpers.episodes import Feedback
from tests.helpers.group_checks import assert_check_names_the_field

STOP, PAD = 1, 0


def test_truncate_after_the_first_stop_token_keeps_it():
    responses = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 9, 9, 9]])
    cut, mask = truncate_after_stop(responses, STOP, PAD)
    assert cut.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert stopped(cut, mask, STOP).tolist() == [True, False, True]
    # without a stop token every token counts and nothing "stopped"
    cut, mask = truncate_after_stop(responses, None, PAD)
    assert mask.all() and torch.equal(cut, responses)
    assert stopped(cut, mask, None).tolist() == [False, False, False]


def test_several_stop_tokens_each_end_a_response():
    responses = torch.tensor([[5, 3, 7, 1], [5, 1, 3, 8], [5, 6, 7, 8]])
    cut, mask = truncate_after_stop(responses, (STOP, 3), PAD)
    assert cut.tolist() == [[5, 3, 0, 0], [5, 1, 0, 0], [5, 6, 7, 8]]
    assert stopped(cut, mask, (STOP, 3)).tolist() == [True, True, False]
    assert stopped(cut, mask, ()).tolist() == [False, False, False]


def test_the_sampling_group_names_its_dotted_key_and_resolves_its_stop_token_to_ids():
    refused = {"max_new_tokens": (0, "sampling.max_new_tokens must be an integer >= 1, got 0"),
               "temperature": (0.0, "sampling.temperature must be > 0, got 0.0"),
               "top_k": (-1, "sampling.top_k must be an integer >= 0, got -1"),
               "top_p": (1.5, "sampling.top_p must lie in (0.0, 1.0], got 1.5"),
               "kv_cache": ("paged", "sampling.kv_cache must be one of static, dynamic, got 'paged'")}
    for name, (value, message) in refused.items():
        with pytest.raises(ValueError) as error:
            Sampling(**{name: value}).check()
        assert str(error.value) == message
    with pytest.raises(ValueError, match=r"^teacher_sampling\.max_new_tokens must be"):
        Sampling(max_new_tokens=0).check("teacher_sampling")  # the name it is given
    assert Sampling().check() == Sampling()

    tokenizer = build_tokenizer()  # ChatML: an assistant turn ends with <|im_end|>, another token than EOS
    eos, turn_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos != turn_end
    assert Sampling().settings(tokenizer) == SamplingSettings(stop_token_ids=(eos, turn_end))  # auto
    assert Sampling(stop_token="eos").settings(tokenizer).stop_token_ids == (eos,)
    assert Sampling(stop_token="<|im_end|>").settings(tokenizer).stop_token_ids == (turn_end,)
    assert Sampling(stop_token=None).settings(tokenizer).stop_token_ids == ()
    assert Sampling(max_new_tokens=6, temperature=0.7, top_k=3, top_p=0.9, kv_cache="dynamic",
                    stop_token="eos").settings(tokenizer) == SamplingSettings(6, 0.7, 3, 0.9, "dynamic", (eos,))
    with pytest.raises(ValueError) as error:
        Sampling(stop_token="not a token").settings(tokenizer)
    assert str(error.value) == "sampling.stop_token 'not a token' is not a single token of the tokenizer"


@pytest.mark.parametrize("bad, message", [
    (dict(max_turns=0), "episodes.max_turns must be an integer >= 1, got 0"),
    (dict(environment=Feedback, max_turns=0), "episodes.max_turns must be an integer >= 1, got 0"),
    (dict(environment=Feedback, max_turns=2.5), "episodes.max_turns must be an integer >= 1, got 2.5"),
    (dict(environment=Feedback, max_tokens=0), "episodes.max_tokens must be > 0 or null, got 0"),
    (dict(max_turns=3), "episodes.max_turns=3, episodes.max_tokens=None: they bound episodes, and there is no "
     "episodes.environment; set it, or leave them at 4 and null"),
    (dict(max_tokens=64), "episodes.max_turns=4, episodes.max_tokens=64: they bound episodes, and there is no "
     "episodes.environment; set it, or leave them at 4 and null"),
])
def test_the_episodes_group_names_its_dotted_key(bad, message):
    assert_check_names_the_field(Episodes(**bad), message, "episodes", "rollout")


def test_the_episodes_group_passes_its_defaults_and_bounds_with_an_environment_and_saves_only_the_bounds():
    assert Episodes().check() == Episodes()  # single-turn: no environment, the bounds at 4 and null
    bounded = Episodes(environment=Feedback, max_turns=3, max_tokens=40)
    assert bounded.check() is bounded
    assert bounded.hyperparameters() == {"max_turns": 3, "max_tokens": 40}  # the environment is code, named by the config
    assert Episodes().hyperparameters() == {"max_turns": 4, "max_tokens": None}
