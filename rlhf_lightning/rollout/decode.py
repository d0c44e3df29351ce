"""Our decoding loop: each prompt encoded once per group, a static KV cache, and a decode step that can be compiled.

Sampling a response is one small forward pass per token. Under ``generate`` each pass also pays for Python-side
logits processors and stopping checks, a few kernel launches each; on a GPU that overhead, not the FLOPs, sets
the pace. Here one function, :meth:`Decoder.step`, holds the forward pass of a token, the warpers, the inverse-CDF
draw and the stop bookkeeping, so ``torch.compile`` can capture it whole (CUDA graphs on a GPU,
``mode="reduce-overhead"``): a decoded token costs about one graph launch. And with ``group = k`` samples per
prompt, each prompt is encoded once and its KV cache copied to its k rows instead of k identical prefills.

The tokens are those ``generate`` draws with :func:`~rlhf_lightning.ops.sampling.sampling_processors` from the same
uniform numbers (the same forward passes, warpers and draw), up to the rounding of kernels that differ with the
batch or cache shape; ``tests/rollout/test_decode.py`` checks tokens and log-probs against ``generate``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import LogitsProcessorList, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from rlhf_lightning.ops.sampling import inverse_cdf_draw_op, nonfinite_scores_error

log = logging.getLogger(__name__)

# Compiled steps are specialised to their shapes: prompts are left-padded to a multiple of this many columns,
# so that a new batch recompiles only when its longest prompt crosses a bucket.
PROMPT_BUCKET = 64
CACHES_KEPT = 4  # static caches kept for reuse (compiled steps read them at fixed addresses)


@dataclass
class DecodeStats:
    """What the decoder did so far: compilations of the decode step, and the seconds of the calls that compiled (the
    compile and that call's own token: an upper bound of the compile time)."""

    compiles: int = 0
    compile_seconds: float = 0.0


class Decoder:
    """Samples responses from one transformers causal LM over a static KV cache.

    Keeps its caches and its compiled step between calls: a rollout of a shape seen before neither allocates nor
    compiles (``torch._dynamo`` recompiles only for a new batch size, prompt bucket or adapter role).

    Args:
        hf_model: the transformers model (adapter layers injected, if any).
        compiled: compile :meth:`step` with ``torch.compile`` (``reduce-overhead`` on CUDA: CUDA graphs).
    """

    def __init__(self, hf_model: PreTrainedModel, compiled: bool) -> None:
        self.hf_model = hf_model
        self.compiled = compiled
        self.stats = DecodeStats()
        self._caches: OrderedDict[tuple, StaticCache] = OrderedDict()
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
        self._step = self.step
        if compiled:
            # One code object serves every model, batch size and prompt bucket of the process; dynamo's default of
            # 8 compiled versions per code object would silently fall back to eager after the eighth.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            if hf_model.device.type == "cuda":
                self._step = functools.partial(_replay, torch.compile(self.step, mode="reduce-overhead",
                                                                      dynamic=False))
            else:
                self._step = torch.compile(self.step, dynamic=False)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor, warpers: LogitsProcessorList,
                 max_new_tokens: int, stop_ids: Tensor, pad_token_id: int, draws: Tensor | None = None,
                 group: int = 1, synced: bool = False) -> tuple[Tensor, Tensor]:
        """Sample ``group`` responses to each left-padded prompt ``[B, P]``: ``(tokens [B * group, R], log-probs
        [B * group, R])``, rows ``b * group .. b * group + group - 1`` answering prompt ``b``.

        A row's tokens after its first stop token are ``pad_token_id``; ``R`` is ``max_new_tokens`` or less, once
        every row has stopped (as ``generate``). ``draws`` ``[B * group, max_new_tokens]``: the uniform numbers of
        each row's tokens; None = the global random stream, one ``[B * group, 1]`` draw per token as
        :class:`~rlhf_lightning.ops.sampling.InverseCDFSampler`. ``synced``: keep decoding until every rank has
        finished (a base sharded layer by layer gathers layers in each forward pass, a collective).
        """
        if self.compiled:
            input_ids, attention_mask = _pad_left(input_ids, attention_mask, pad_token_id, PROMPT_BUCKET)
        rows, prompt_length = input_ids.shape[0] * group, input_ids.shape[1]
        length = prompt_length + max_new_tokens
        device = input_ids.device
        cache = self._cache(rows, length)
        prompt_cache = cache if group == 1 else self._cache(input_ids.shape[0], length)
        positions = attention_mask.long().cumsum(-1) - 1
        logits = self._forward(input_ids, attention_mask, positions.masked_fill(attention_mask == 0, 0),
                               prompt_cache)
        if group > 1:  # the prompt's keys and values, computed once, copied to each of its samples' rows
            _copy_repeated(prompt_cache, cache, group)
            logits, attention_mask = logits.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
            positions = positions.repeat_interleave(group, 0)
        mask = torch.cat([attention_mask, attention_mask.new_ones((rows, max_new_tokens))], 1)
        position = positions[:, -1] + 1
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        bad_step = torch.full((rows,), -1, dtype=torch.long, device=device)
        tokens, logprobs = [], []
        check_every = 8 if device.type == "cuda" else 1  # a stop check synchronises with the device
        token, logprob, finished, finite = _draw(logits, self._uniform(draws, 0, rows, device), finished, warpers,
                                                 stop_ids, pad_token_id)
        for step in range(max_new_tokens):
            if step:
                # Shapes and role are fixed within a rollout: only its first step can compile.
                run = self._step_counting_compiles if step == 1 and self.compiled else self._step
                token, logprob, finished, finite = run(cache, token, position, mask,
                                                       self._uniform(draws, step, rows, device), finished, warpers,
                                                       stop_ids, pad_token_id)
                position = position + 1
            tokens.append(token)
            logprobs.append(logprob)
            bad_step = torch.where(~finite & (bad_step < 0), step, bad_step)
            if (step + 1) % check_every == 0 or step + 1 == max_new_tokens:
                if bool((bad_step >= 0).any()):
                    first = int(bad_step[bad_step >= 0].min())
                    raise nonfinite_scores_error(bad_step == first, prompt_length + first)
                if _all_finished(finished, synced):
                    break
        tokens, logprobs = torch.stack(tokens, 1), torch.stack(logprobs, 1)
        keep = _decoded_length(tokens, stop_ids, finished)
        return tokens[:, :keep], logprobs[:, :keep]

    def step(self, cache: StaticCache, token: Tensor, position: Tensor, mask: Tensor, uniform: Tensor,
             finished: Tensor, warpers: LogitsProcessorList, stop_ids: Tensor, pad_token_id: int
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One decoded token: the forward pass of ``token`` ``[N]`` at ``position`` ``[N]``, then the draw of the
        next one (see :func:`_draw`). Static shapes throughout, so that it compiles once per shape."""
        logits = self._forward(token[:, None], mask, position[:, None], cache)
        return _draw(logits, uniform, finished, warpers, stop_ids, pad_token_id)

    def _forward(self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: StaticCache) -> Tensor:
        """The float32 next-token logits ``[N, V]`` after ``input_ids``, their keys and values added to ``cache``.
        ``mask`` may run past the cache's filled length (the causal mask hides the future)."""
        keep = {"logits_to_keep": 1} if self._keeps_logits else {}
        output = self.hf_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                               past_key_values=cache, use_cache=True, **keep)
        return output.logits[:, -1].float()

    def _cache(self, rows: int, length: int) -> StaticCache:
        """An empty static cache of ``rows`` x ``length`` tokens: reused when compiled (the compiled step reads
        it at a fixed address), fresh otherwise."""
        if not self.compiled:
            return StaticCache(config=self.hf_model.config, max_cache_len=length)
        key = (rows, length)
        if key in self._caches:
            self._caches.move_to_end(key)
            self._caches[key].reset()
            return self._caches[key]
        cache = StaticCache(config=self.hf_model.config, max_cache_len=length)
        # A sliding-window layer counts its tokens in a Python int that the masks read: a compiled step would be
        # specialised to it and recompile at every token once the window is full. A full-length layer holds the
        # same keys (the sliding mask still limits attention to the window) at fixed shapes.
        cache.layers = [StaticLayer(max_cache_len=length) if isinstance(layer, StaticSlidingWindowLayer) else layer
                        for layer in cache.layers]
        self._caches[key] = cache
        while len(self._caches) > CACHES_KEPT:
            self._caches.popitem(last=False)
        return self._caches[key]

    def _step_counting_compiles(self, cache: StaticCache, token: Tensor, *inputs: Any
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`step`, compiled, with the seconds of a compilation it triggers added to :attr:`stats`."""
        graphs, started = _compiled_graphs(), time.perf_counter()
        outputs = self._step(cache, token, *inputs)
        if _compiled_graphs() > graphs:
            seconds = time.perf_counter() - started
            self.stats.compiles += 1
            self.stats.compile_seconds += seconds
            log.info("compiled the decode step for %d rows in %.1f s", token.shape[0], seconds)
        return outputs

    @staticmethod
    def _uniform(draws: Tensor | None, step: int, rows: int, device: torch.device) -> Tensor:
        if draws is not None:
            return draws[:, step : step + 1]
        dtype = torch.float32 if device.type == "mps" else torch.float64
        return torch.rand((rows, 1), device=device, dtype=dtype)


def _draw(logits: Tensor, uniform: Tensor, finished: Tensor, warpers: LogitsProcessorList, stop_ids: Tensor,
          pad_token_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The next token of each row from its warped ``logits``: ``(tokens, log-probs, finished, finite)``; a row
    finished before this token gets ``pad_token_id`` (as ``generate``), one that draws a stop token finishes."""
    scores = warpers(None, logits)
    token, logprob, finite = inverse_cdf_draw_op(scores, uniform)
    token = torch.where(finished, pad_token_id, token)
    return token, logprob, finished | torch.isin(token, stop_ids), finite | finished


def _replay(graphed_step: Any, *inputs: Any) -> tuple[Tensor, ...]:
    """One call of the CUDA-graphed step, its outputs copied out of the graph's memory: the next replay writes
    there, and the loop keeps every token and log-prob and feeds ``token`` and ``finished`` back in."""
    torch.compiler.cudagraph_mark_step_begin()
    return tuple(output.clone() for output in graphed_step(*inputs))


def _compiled_graphs() -> int:
    """Graphs ``torch._dynamo`` has compiled in this process (it counts a recompilation as a new one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _all_finished(finished: Tensor, synced: bool) -> bool:
    """Whether every row has stopped (on every rank, when ``synced``)."""
    done = finished.all().to(torch.int32)
    if synced:
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done)


def _decoded_length(tokens: Tensor, stop_ids: Tensor, finished: Tensor) -> int:
    """Columns ``generate`` would have returned: up to the last row's first stop token, all of them while a row
    has not stopped (a loop that checks for stops every few steps may have decoded past that)."""
    if not bool(finished.all()):
        return tokens.shape[1]
    first_stop = torch.isin(tokens, stop_ids).int().argmax(-1)
    return int(first_stop.max()) + 1


def _pad_left(input_ids: Tensor, attention_mask: Tensor, pad_token_id: int, multiple: int) -> tuple[Tensor, Tensor]:
    """Left-pad prompts to a multiple of ``multiple`` columns (masked: the samples do not change)."""
    extra = -input_ids.shape[1] % multiple
    if not extra:
        return input_ids, attention_mask
    return (torch.cat([input_ids.new_full((input_ids.shape[0], extra), pad_token_id), input_ids], 1),
            torch.cat([attention_mask.new_zeros((attention_mask.shape[0], extra)), attention_mask], 1))


def _copy_repeated(source: StaticCache, target: StaticCache, group: int) -> None:
    """Fill ``target`` (``group`` times the rows) with each row of the prefilled ``source`` repeated ``group``
    times, consecutively: the layers' keys, values and filled lengths."""
    for from_layer, to_layer in zip(source.layers, target.layers, strict=True):
        if not to_layer.is_initialized:
            to_layer.lazy_initialization(from_layer.keys[:, :, :0].repeat_interleave(group, 0),
                                         from_layer.values[:, :, :0].repeat_interleave(group, 0))
        for name in ("keys", "values"):
            into, of = getattr(to_layer, name), getattr(from_layer, name)
            into.view(of.shape[0], group, *of.shape[1:]).copy_(of[:, None])
        to_layer.cumulative_length.copy_(from_layer.cumulative_length)
        if hasattr(from_layer, "cumulative_length_int"):
            to_layer.cumulative_length_int = from_layer.cumulative_length_int
