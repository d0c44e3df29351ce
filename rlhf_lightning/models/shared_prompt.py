"""A block's shared prompts encoded once: the decoder runs on each distinct prefix of a block of rows, and the
rows' continuations read the keys and values of their prefix from a cache expanded to every row.

The ``k`` responses of a group are consecutive rows after the same left-padded prompt; every pass after sampling
(old and reference log-probs, values, reward adapter, the update's forward) would otherwise encode that prompt
``k`` times. Rows share a prefix when their ids *and* attention mask are equal on its columns, found by content,
so a shuffled minibatch or a micro-batch holding part of a group shares what it can, and rows that share nothing
(PPO's one response per prompt) run as one ordinary pass.

The numbers are those of one pass over the whole rows up to kernel rounding: a token's context, positions (counted
over the whole row's mask) and attention mask are unchanged; only the prefix's attention is computed for fewer
rows. Selecting a cache's rows is differentiable (its backward sums the rows' gradients into their prefix), so
with gradients the prefix's computation receives what every row of its group sends it.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn


def prefix_groups(input_ids: Tensor, attention_mask: Tensor, width: int) -> tuple[Tensor, Tensor] | None:
    """``(first [G], inverse [B])``: one row holding each of the ``G`` distinct prefixes (ids and mask on the first
    ``width`` columns) and each row's prefix among them; None when no two rows share their prefix."""
    prefix = torch.cat([input_ids[:, :width], attention_mask[:, :width].to(input_ids.dtype)], 1)
    distinct, inverse = torch.unique(prefix, dim=0, return_inverse=True)
    rows = prefix.shape[0]
    if distinct.shape[0] == rows:
        return None
    order = torch.arange(rows, device=inverse.device)
    first = torch.full((distinct.shape[0],), rows, device=inverse.device).scatter_reduce(0, inverse, order, "amin")
    return first, inverse


def prefix_shared_hidden_states(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                                width: int, groups: tuple[Tensor, Tensor] | None) -> Tensor:
    """Last hidden states ``[B, T, H]`` of ``decoder`` (a transformers decoder taking a cache), the first ``width``
    columns encoded once per distinct prefix of ``groups`` (:func:`prefix_groups`; None: once per row, still in
    two calls), the rest of each row after its prefix's keys and values."""
    rows = input_ids.shape[0]
    first, inverse = groups if groups is not None else (torch.arange(rows, device=input_ids.device),) * 2
    prefix = decoder(input_ids=input_ids[first, :width], attention_mask=attention_mask[first, :width],
                     position_ids=position_ids[first, :width], use_cache=True)
    keyword = cache_keyword(decoder)
    cache = getattr(prefix, keyword)
    if groups is not None:
        cache.batch_select_indices(inverse)
    rest = decoder(input_ids=input_ids[:, width:], attention_mask=attention_mask, position_ids=position_ids[:, width:],
                   use_cache=True, **{keyword: cache})
    prefix_hidden = prefix.last_hidden_state if groups is None else prefix.last_hidden_state[inverse]
    return torch.cat([prefix_hidden, rest.last_hidden_state], 1)


def cache_keyword(decoder: nn.Module) -> str:
    """The name of a decoder's KV-cache argument and output: ``cache`` (transformers 5.2x), ``past_key_values``
    before."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
