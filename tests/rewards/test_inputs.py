"""What a reward reads (``rlhf_lightning.rewards.inputs``): last tokens and closed responses, by hand."""

from __future__ import annotations

import torch

from rlhf_lightning.rewards.inputs import close_responses, last_token_index

STOP = 1


def test_last_token_index_with_left_padded_prompts_and_right_padded_responses():
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    assert last_token_index(attention).tolist() == [3, 4, 2]


def test_close_responses_appends_the_end_token_only_where_missing():
    ids = torch.tensor([[0, 5, 6, STOP], [5, 6, 7, 8], [0, 5, 9, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]])
    closed, closed_mask, last = close_responses(ids, mask, end_token_id=STOP)
    assert last.tolist() == [3, 4, 3]
    assert closed.tolist() == [[0, 5, 6, 1, 1], [5, 6, 7, 8, 1], [0, 5, 9, 1, 1]]
    assert closed_mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]


def test_close_responses_with_an_end_token_per_row_and_other_stop_tokens():
    turn_end = 3
    ids = torch.tensor([[5, 6, turn_end], [5, 6, STOP], [5, 6, 7], [5, 6, 7]])
    mask = torch.ones_like(ids)
    ends = torch.tensor([turn_end, turn_end, turn_end, STOP])  # conversations end turns with 3, text with EOS
    closed, _, last = close_responses(ids, mask, ends, stop_token_ids=(STOP, turn_end))
    assert last.tolist() == [2, 2, 3, 3]  # a response that stopped with either stop token is not closed again
    assert closed[:, :4].tolist() == [[5, 6, 3, 3], [5, 6, 1, 3], [5, 6, 7, 3], [5, 6, 7, 1]]
