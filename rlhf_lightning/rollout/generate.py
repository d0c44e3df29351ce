"""Sampling responses with ``generate`` and cutting them at the stop token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedTokenizerBase

from rlhf_lightning.algorithms.masked import last_marked_index
from rlhf_lightning.data.tokenize import completion_end_id
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.ops.sampling import sampling_processors, sampling_warpers
from rlhf_lightning.rollout.decode import Decoder
from rlhf_lightning.utils.checks import check_sampling


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled (see the modules' arguments of the same names)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_cache: Literal["static", "dynamic"] = "static"
    stop_token_ids: tuple[int, ...] = ()  # any of them ends a response; empty = never stop
    decoding: Literal["auto", "compiled", "eager", "generate"] = "auto"

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.kv_cache, None,
                       self.decoding)

    def decoder_for(self, device: torch.device, sharded: bool) -> str:
        """The decoding that runs: ``auto`` is ``compiled`` on CUDA (CUDA graphs), ``eager`` elsewhere and on an
        FSDP2-sharded base (whose per-layer hooks are not compiled), ``generate`` with a dynamic cache."""
        if self.decoding != "auto":
            if self.decoding == "compiled" and sharded:
                raise ValueError("decoding: compiled cannot run on an FSDP2-sharded base (its layers gather "
                                 "themselves in hooks that are not compiled); use decoding: eager or auto")
            return self.decoding
        if self.kv_cache == "dynamic":
            return "generate"
        return "compiled" if device.type == "cuda" and not sharded else "eager"

    def generation_config(self, pad_token_id: int) -> GenerationConfig:
        """What ``generate`` is called with; the sampling itself is :func:`sampling_processors`."""
        # Every logits processor is set explicitly: a model's own generation_config.json must not change the
        # sampling distribution behind the log-probs' back. Greedy over the sampler's one-hot output = sampling.
        # disable_compile: with a static cache on a GPU, transformers would otherwise torch.compile the forward
        # pass on its own (and recompile for every new prompt length).
        return GenerationConfig(
            do_sample=False, max_new_tokens=self.max_new_tokens, min_new_tokens=0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, eos_token_id=list(self.stop_token_ids),
            pad_token_id=pad_token_id, use_cache=True, cache_implementation=self.kv_cache, disable_compile=True,
        )


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stop_token: str | None) -> tuple[int, ...]:
    """The ids that end a response: ``auto`` = EOS and the chat template's turn-end token (Gemma's
    ``<end_of_turn>``, ChatML's ``<|im_end|>``); ``eos`` = EOS alone; another string = that token; None = never
    stop (an empty tuple)."""
    if stop_token is None:
        return ()
    if stop_token == "auto":
        return tuple(dict.fromkeys([tokenizer.eos_token_id, completion_end_id(tokenizer, conversational=True)]))
    if stop_token == "eos":
        return (tokenizer.eos_token_id,)
    token_id = tokenizer.convert_tokens_to_ids(stop_token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"stop_token {stop_token!r} is not a single token of the tokenizer")
    return (token_id,)


@torch.no_grad()
def sample_responses(model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor,
                     settings: SamplingSettings, pad_token_id: int, draws: Tensor | None = None,
                     synced: bool = False, with_logprobs: bool = False, group: int = 1) -> tuple[Tensor, ...]:
    """Sample ``group`` responses to each prompt from ``role`` (eval mode, KV cache) and cut them after their stop
    token; rows ``b * group ..`` answer prompt ``b``.

    ``draws``: the uniform numbers of each response's tokens ``[B * group, max_new_tokens]`` (see
    :class:`~rlhf_lightning.ops.sampling.InverseCDFSampler`); None = the global random stream. ``synced``: every
    rank keeps decoding until all have finished (a base sharded layer by layer gathers each layer at every step, a
    collective). ``settings.decoding`` picks our decoding loop (:mod:`rlhf_lightning.rollout.decode`: each
    prompt encoded once per group, the decode step optionally compiled) or transformers' ``generate``; they draw
    the same tokens.

    Returns ``(prompt + response ids [B * group, P + R], attention mask [B * group, P + R], response mask
    [B * group, R])``; ``R`` is at most ``max_new_tokens`` (less once every row has stopped). ``with_logprobs``
    adds the sampler's own log-probs of the response tokens ``[B * group, R]`` (0 after the stop).
    """
    decoding = settings.decoder_for(input_ids.device, model.is_sharded)
    # Every response's row holds its prompt; generate also encodes each of them (our loop encodes each prompt once).
    prompt_ids, prompt_mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
    was_training = model.training
    model.eval()
    try:
        # Sampling runs in the weights' own precision, outside any autocast (bf16-mixed): autocast would re-cast
        # every frozen fp32 weight to bf16 at each decoded token (8 bytes read per parameter instead of 4), and it
        # leaves rotary keys in fp32 beside bf16 values, which a static cache (one dtype for both) rejects.
        with model.role(role), torch.autocast(input_ids.device.type, enabled=False):
            if decoding == "generate":
                responses, logprobs = _generate(model, prompt_ids, prompt_mask, settings, pad_token_id, draws, synced)
            else:
                if decoding not in model.decoders:
                    model.decoders[decoding] = Decoder(model.hf_model, compiled=decoding == "compiled")
                stop_ids = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=input_ids.device)
                warpers = sampling_warpers(settings.temperature, settings.top_k, settings.top_p)
                responses, logprobs = model.decoders[decoding](
                    input_ids, attention_mask, warpers, settings.max_new_tokens, stop_ids, pad_token_id, draws=draws,
                    group=group, synced=synced)
    finally:
        model.train(was_training)
    responses, response_mask = truncate_after_stop(responses, settings.stop_token_ids, pad_token_id)
    sampled = (torch.cat([prompt_ids, responses], 1), torch.cat([prompt_mask, response_mask.long()], 1),
               response_mask)
    if not with_logprobs:
        return sampled
    return (*sampled, torch.where(response_mask, logprobs.to(responses.device), 0.0))


def _generate(model: SharedBase, input_ids: Tensor, attention_mask: Tensor, settings: SamplingSettings,
              pad_token_id: int, draws: Tensor | None, synced: bool) -> tuple[Tensor, Tensor]:
    """transformers' ``generate`` with our sampler: ``(response tokens [B, R], their log-probs [B, R])``."""
    processors = sampling_processors(settings.temperature, settings.top_k, settings.top_p, draws,
                                     input_ids.shape[1])
    sequences = model.hf_model.generate(
        input_ids=input_ids, attention_mask=attention_mask, generation_config=settings.generation_config(pad_token_id),
        logits_processor=processors, synced_gpus=synced,
    )
    responses = sequences[:, input_ids.shape[1]:]
    return responses, processors[-1].sampled_logprobs()[:, : responses.shape[1]]


def is_stop(tokens: Tensor, stop_token_ids: int | tuple[int, ...] | None) -> Tensor:
    """Bool mask of ``tokens`` that are one of the stop tokens."""
    ids = () if stop_token_ids is None else (stop_token_ids,) if isinstance(stop_token_ids, int) else stop_token_ids
    return torch.isin(tokens, torch.tensor(ids, dtype=tokens.dtype, device=tokens.device))


def truncate_after_stop(responses: Tensor, stop_token_ids: int | tuple[int, ...] | None,
                        pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Cut every response after its first stop token: ``(responses with pad after the stop, mask [B, R])``.

    The stop token itself stays in the response (it is an action the policy took, and the reward model reads its
    score there). Without a stop token every sampled token counts.
    """
    length = responses.shape[1]
    positions = torch.arange(length, device=responses.device)
    stops = is_stop(responses, stop_token_ids)
    first_stop = torch.where(stops.any(-1), stops.int().argmax(-1), length)
    mask = positions[None, :] <= first_stop[:, None]
    return responses.masked_fill(~mask, pad_token_id), mask


def stopped(responses: Tensor, response_mask: Tensor, stop_token_ids: int | tuple[int, ...] | None) -> Tensor:
    """``[B]`` bool: the response ended with a stop token (rather than running out of tokens)."""
    last = last_marked_index(response_mask)
    ended = is_stop(responses[torch.arange(responses.shape[0], device=responses.device), last], stop_token_ids)
    return ended & response_mask.any(-1)
