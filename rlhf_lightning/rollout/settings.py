"""How responses are sampled (the settings every engine reads) and where they stop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.algorithms.masked import last_marked_index
from rlhf_lightning.data.tokenize import completion_end_id
from rlhf_lightning.environments.environment import Environment
from rlhf_lightning.utils import checks
from rlhf_lightning.utils.checks import check_sampling


@dataclass(frozen=True)
class VLLMSettings:
    """Kept only so that checkpoints written while vLLM's settings were a module argument (``vllm: {...}``) still
    load; they are now :class:`~rlhf_lightning.rollout.vllm_engine.VLLMEngine`'s own init args."""

    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool | None = None
    sleep: bool = True
    max_model_len: int | None = None


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled, as the engines read it: a module's :class:`Sampling` with its stop token
    resolved to ids (:meth:`Sampling.settings`)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_cache: Literal["static", "dynamic"] = "static"
    stop_token_ids: tuple[int, ...] = ()  # any of them ends a response; empty = never stop

    def __post_init__(self) -> None:
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.kv_cache)


@dataclass(frozen=True)
class Sampling:
    """How the policy's responses are drawn: the ``sampling`` argument of every module that samples (which engine
    draws them is the module's ``engine``).

    Args:
        max_new_tokens: longest sampled response, in tokens (of one turn, in episodes).
        temperature: sampling temperature; log-probs are computed from logits divided by it too.
        top_k: sample among the k most likely tokens; 0 = off. Refused by the online algorithms, whose ratios
            and KL would come from another distribution than the one sampled.
        top_p: nucleus-sampling threshold; 1.0 = off (refused by the online algorithms, as ``top_k``).
        kv_cache: KV cache of generation: ``static`` allocates it once for prompt + ``max_new_tokens`` (faster,
            notably on CPU); ``dynamic`` grows it token by token (for models without static-cache support; only
            the engine ``Generate``, which ``Auto`` picks then).
        stop_token: what ends a response: ``auto`` = EOS and the token the chat template ends an assistant turn
            with (ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``), ``eos`` = the tokenizer's EOS alone,
            another single token, or null (never stop).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_cache: Literal["static", "dynamic"] = "static"
    stop_token: str | None = "auto"

    def check(self, name: str = "sampling") -> Sampling:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.kv_cache, f"{name}.")
        return self

    def settings(self, tokenizer: PreTrainedTokenizerBase) -> SamplingSettings:
        """What the engines read: these settings with ``stop_token`` resolved to ids of ``tokenizer``."""
        return SamplingSettings(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.kv_cache,
                                stop_token_ids(tokenizer, self.stop_token))


@dataclass(frozen=True)
class Episodes:
    """The ``episodes`` argument of every online module: multi-turn episodes instead of one response per prompt, and
    their bounds. A config sets some fields and keeps the defaults for the others (``episodes: {environment:
    {class_path: rlhf_lightning.environments.ToolEnvironment, init_args: {tools: [my_tools.search]}}, max_turns:
    3}``).

    Args:
        environment: the episode's environment (``class_path`` + ``init_args``, made anew for every episode), e.g.
            ``rlhf_lightning.environments.ToolEnvironment`` with ``tools: [my_tools.search]``. Each assistant turn
            (up to ``sampling.max_new_tokens``) ends at the turn-end token; the environment answers; its tokens are
            context only. Reward sources score the whole transcript; null = single-turn.
        max_turns: assistant turns per episode at most.
        max_tokens: tokens per episode after its opening (the policy's and the environment's) at most; null =
            ``max_turns`` x ``sampling.max_new_tokens``. A turn can decode ``sampling.max_new_tokens`` after
            ``max_tokens - 1`` of them, so the longest opening plus both must fit the model's positions (checked at
            setup).
    """

    environment: Callable[[], Environment] | None = None
    max_turns: int = 4
    max_tokens: int | None = None

    def check(self, name: str = "episodes") -> Episodes:
        """Raise a one-line error naming ``name.field``: at least one turn, a positive budget, and bounds only with
        an environment."""
        checks.at_least(f"{name}.max_turns", self.max_turns)
        checks.positive(f"{name}.max_tokens", self.max_tokens, optional=True)
        if self.environment is None and (self.max_turns != 4 or self.max_tokens is not None):
            raise ValueError(f"{name}.max_turns={self.max_turns}, {name}.max_tokens={self.max_tokens}: they bound "
                             f"episodes, and there is no {name}.environment; set it, or leave them at 4 and null")
        return self

    def check_sources(self, sources: Sequence[Any], name: str = "episodes") -> None:
        """Refuse a reward source that scores the steps of single-turn responses (``scores_steps``) in episodes."""
        if self.environment is not None and (steps := [type(s).__name__ for s in sources if s.scores_steps]):
            raise ValueError(f"reward: {steps[0]} scores the steps of single-turn responses, and "
                             f"{name}.environment is set; drop one of them")

    def hyperparameters(self) -> dict[str, int | None]:
        """What checkpoints and loggers keep: the bounds (the environment is code, named by the config)."""
        return {"max_turns": self.max_turns, "max_tokens": self.max_tokens}


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
        raise ValueError(f"sampling.stop_token {stop_token!r} is not a single token of the tokenizer")
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


torch.serialization.add_safe_globals([VLLMSettings])  # in the hyper-parameters of older checkpoints
