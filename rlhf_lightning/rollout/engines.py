"""Engines: what draws the tokens of a rollout. One small interface, one class per engine.

An engine takes left-padded prompts, the number of responses per prompt, the sampling settings and one seed per
response (or none: the global random stream) and returns the sampled tokens and the log-probs the sampler gave
them; :class:`~rlhf_lightning.rollout.sampler.Sampler` picks the engine, keeps it between rollouts and cuts the
responses at their stop tokens. Our own engines run on the shared base itself (no second copy of the weights) and draw
the same tokens from the same seeds:

- ``eager`` and ``compiled``: our decoding loop (:mod:`rlhf_lightning.rollout.decode`): each prompt encoded once
  for its group, a static KV cache, the decode step optionally ``torch.compile``-d;
- ``generate``: transformers' ``generate`` with our sampler as the last logits processor;
- ``vllm``: vLLM in this process, with its own copy of the weights (:mod:`rlhf_lightning.rollout.vllm_engine`).

A new engine subclasses :class:`Engine` and registers itself in :data:`ENGINES` under the ``decoding`` name that
selects it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import GenerationConfig

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.ops.sampling import row_draws, sampling_processors, sampling_warpers
from rlhf_lightning.rollout.decode import Decoder
from rlhf_lightning.rollout.settings import SamplingSettings


class Engine:
    """Draws ``group`` responses to each prompt from a role of the shared base.

    Args:
        model: the shared base the engine samples from (an engine may keep state for it: caches, compiled steps,
            its own copy of the weights).
    """

    name = "engine"

    def __init__(self, model: SharedBase) -> None:
        self.model = model

    def draw(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        """``(tokens [B * group, R], log-probs [B * group, R])`` of ``group`` responses to each left-padded prompt
        ``input_ids`` ``[B, P]`` (rows ``b * group ..`` answer prompt ``b``), sampled by ``role``'s adapter.

        ``R`` is at most ``settings.max_new_tokens``; tokens after a row's stop token may be anything (the sampler
        cuts them). ``seeds``: one per response, each drawn from a stream of its own; None = the global random
        stream. ``synced``: keep decoding until every rank has finished (a base sharded layer by layer gathers
        its layers in every forward pass, a collective)."""
        raise NotImplementedError

    def rest(self) -> None:
        """After a rollout, before the update: free what the engine need not hold meanwhile (nothing here)."""

    def close(self) -> None:
        """At the end of a fit: release what the engine holds beyond the model (nothing here)."""


@contextmanager
def sampling_mode(model: SharedBase, role: str | None, device: torch.device) -> Iterator[None]:
    """``role`` active, eval mode, and the weights' own precision outside any autocast (bf16-mixed): autocast would
    re-cast every frozen fp32 weight to bf16 at each decoded token (8 bytes read per parameter instead of 4), and it
    leaves rotary keys in fp32 beside bf16 values, which a static cache (one dtype for both) rejects."""
    was_training = model.training
    model.eval()
    try:
        with model.role(role), torch.autocast(device.type, enabled=False):
            yield
    finally:
        model.train(was_training)


def _draws(seeds: Sequence[int] | None, settings: SamplingSettings, device: torch.device) -> Tensor | None:
    return None if seeds is None else row_draws(list(seeds), settings.max_new_tokens, device)


class EagerDecoder(Engine):
    """Our decoding loop over a static KV cache (:class:`~rlhf_lightning.rollout.decode.Decoder`), its caches and
    compiled step kept between rollouts."""

    name = "eager"
    compiled = False

    def __init__(self, model: SharedBase) -> None:
        super().__init__(model)
        self.decoder = Decoder(model.hf_model, compiled=self.compiled)

    def draw(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        device = input_ids.device
        stop_ids = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
        warpers = sampling_warpers(settings.temperature, settings.top_k, settings.top_p)
        with sampling_mode(self.model, role, device):
            return self.decoder(input_ids, attention_mask, warpers, settings.max_new_tokens, stop_ids, pad_token_id,
                                draws=_draws(seeds, settings, device), group=group, synced=synced)


class CompiledDecoder(EagerDecoder):
    """:class:`EagerDecoder` with its decode step ``torch.compile``-d (CUDA graphs on a GPU), compiled once per batch
    size, 64-token prompt bucket and adapter role."""

    name = "compiled"
    compiled = True


class Generate(Engine):
    """transformers' ``generate`` with our inverse-CDF sampler as the last logits processor (every response's row
    encodes its prompt)."""

    name = "generate"

    def draw(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        input_ids, attention_mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
        processors = sampling_processors(settings.temperature, settings.top_k, settings.top_p,
                                         _draws(seeds, settings, input_ids.device), input_ids.shape[1])
        with sampling_mode(self.model, role, input_ids.device):
            sequences = self.model.hf_model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=generation_config(settings, pad_token_id), logits_processor=processors,
                synced_gpus=synced)
        responses = sequences[:, input_ids.shape[1]:]
        return responses, processors[-1].sampled_logprobs()[:, : responses.shape[1]]


def generation_config(settings: SamplingSettings, pad_token_id: int) -> GenerationConfig:
    """What ``generate`` is called with; the sampling itself is :func:`sampling_processors`."""
    # Every logits processor is set explicitly: a model's own generation_config.json must not change the sampling
    # distribution behind the log-probs' back. Greedy over the sampler's one-hot output = sampling.
    # disable_compile: with a static cache on a GPU, transformers would otherwise torch.compile the forward pass on
    # its own (and recompile for every new prompt length).
    return GenerationConfig(
        do_sample=False, max_new_tokens=settings.max_new_tokens, min_new_tokens=0, repetition_penalty=1.0,
        no_repeat_ngram_size=0, eos_token_id=list(settings.stop_token_ids), pad_token_id=pad_token_id,
        use_cache=True, cache_implementation=settings.kv_cache, disable_compile=True,
    )


# ``decoding`` name -> engine class
ENGINES: dict[str, type[Engine]] = {engine.name: engine for engine in (EagerDecoder, CompiledDecoder, Generate)}
