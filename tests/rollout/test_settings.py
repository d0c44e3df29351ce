"""Where a response stops (``rlhf_lightning.rollout.settings``): truncation at stop tokens, by hand."""

from __future__ import annotations

import torch

from rlhf_lightning.rollout.settings import stopped, truncate_after_stop

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
