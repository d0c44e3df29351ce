"""How responses are sampled (the settings every engine reads) and where they stop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.algorithms.masked import last_marked_index
from rlhf_lightning.data.tokenize import completion_end_id
from rlhf_lightning.utils.checks import check_sampling, check_vllm


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine's own settings (``decoding: vllm``; ignored by the other engines).

    Args:
        kv_cache_gib: memory of vLLM's KV cache, in GiB; null = ``gpu_memory_utilization`` decides on a GPU, and
            1 GiB on a CPU (vLLM's own CPU default took 12.2 GiB on a 24 GiB machine when issue 32 was filed).
        gpu_memory_utilization: the share of the GPU's memory vLLM may take for its weights and KV cache (the
            KV cache's size when ``kv_cache_gib`` is null). Low by default: training shares the GPU.
        enforce_eager: run vLLM's model without CUDA graphs or ``torch.compile``; null = on a CPU (its compile
            mode was 4.6 x slower there at 124M parameters, as issue 32 measured), off on a GPU.
        sleep: on a GPU, put vLLM to sleep after each rollout (its weights copied to CPU memory, its KV cache
            freed) and wake it before the next, so the update has the memory; vLLM's sleep mode does nothing on a
            CPU, where this is ignored.
        max_model_len: longest prompt + response vLLM plans its cache for; null = the model's own limit.
    """

    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool | None = None
    sleep: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        check_vllm(self.kv_cache_gib, self.gpu_memory_utilization, self.max_model_len)


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled (see the modules' arguments of the same names)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_cache: Literal["static", "dynamic"] = "static"
    stop_token_ids: tuple[int, ...] = ()  # any of them ends a response; empty = never stop
    decoding: Literal["auto", "compiled", "eager", "generate", "vllm"] = "auto"
    vllm: VLLMSettings = VLLMSettings()

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.kv_cache, None,
                       self.decoding)

    def engine_name(self, device: torch.device, sharded: bool) -> str:
        """The engine that draws the tokens (:mod:`rlhf_lightning.rollout.engines`): ``decoding`` itself, and for
        ``auto`` ``compiled`` on CUDA (CUDA graphs), ``eager`` elsewhere and on an FSDP2-sharded base (whose
        per-layer hooks are not compiled), ``generate`` with a dynamic cache."""
        if self.decoding != "auto":
            if self.decoding == "compiled" and sharded:
                raise ValueError("decoding: compiled cannot run on an FSDP2-sharded base (its layers gather "
                                 "themselves in hooks that are not compiled); use decoding: eager or auto")
            if self.decoding == "vllm" and sharded:
                raise ValueError("decoding: vllm cannot run on an FSDP2-sharded base (each rank's vLLM would load the "
                                 "whole base beside its shard); use decoding: eager or auto, or DDP")
            return self.decoding
        if self.kv_cache == "dynamic":
            return "generate"
        return "compiled" if device.type == "cuda" and not sharded else "eager"


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


torch.serialization.add_safe_globals([VLLMSettings])  # saved with the modules' hyper-parameters
