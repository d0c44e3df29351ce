"""Engines: what draws the tokens of a rollout. A typed component, one class per engine.

A module's ``engine`` argument takes one, as ``policy_loss`` takes a loss: ``engine: {class_path: ..., init_args:
{...}}``, the engine's options its own init args (``--model.init_args.engine.help CLASS`` lists them). An engine
takes left-padded prompts, the number of responses per prompt, the sampling settings and one seed per response (or
none: the global random stream) and returns the sampled tokens and the log-probs the sampler gave them;
:class:`~rlhf_lightning.rollout.sampler.Sampler` holds the engine, and cuts the responses at their stop tokens. Our
own engines run on the shared base itself (no second copy of the weights) and draw the same tokens from the same
seeds:

- :class:`Auto` (the default): :class:`CompiledDecoder` on CUDA, :class:`EagerDecoder` elsewhere and on an
  FSDP2-sharded base, :class:`Generate` with a dynamic KV cache;
- :class:`EagerDecoder` and :class:`CompiledDecoder`: our decoding loop (:mod:`rlhf_lightning.rollout.decode`): each
  prompt encoded once for its group, a static KV cache, the decode step optionally ``torch.compile``-d;
- :class:`Generate`: transformers' ``generate`` with our sampler as the last logits processor;
- :class:`~rlhf_lightning.rollout.vllm_engine.VLLMEngine`: vLLM in this process, with its own copy of the weights;
- :class:`~rlhf_lightning.rollout.vllm_server.VLLMServer`: vLLM's own server, adapters pushed to it by version.

The hooks besides :meth:`Engine.draw`: :meth:`Engine.refusal` (what it cannot serve, in one line, before the
model is built), :meth:`Engine.prepare` (what it keeps of the fit's setup: the run folder), :meth:`Engine.sync`
(called by the training loop after every optimizer step that changed a sampled role: an engine with its own copy of
the weights brings it up to date there, never inside ``draw``), :meth:`Engine.ahead_refusal` (whether it can
draw ahead of the trainer, ``asynchronous.max_staleness``, handing out a :class:`PolicyVersion` per version), and
:meth:`Engine.rest` / :meth:`Engine.close`. A new engine subclasses :class:`Engine`; nothing else changes
(``tests/rollout/test_engines.py`` trains with one defined in the test, ``tests/rollout/test_engine_ahead.py`` with
one that draws ahead).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import GenerationConfig

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.ops.sampling import row_draws, sampling_processors, sampling_warpers
from rlhf_lightning.rollout.decode import Decoder
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.utils import compatibility
from rlhf_lightning.utils.flops import uncounted


@dataclass(frozen=True)
class EngineSetup:
    """What an engine's :meth:`Engine.refusal` reads when the fit is set up, before the model is built."""

    device_type: str  # "cpu", "cuda", ...
    sharded: bool = False  # the base is sharded by FSDP2 (ModelParallelStrategy)
    kv_cache: str = "static"  # the modules' kv_cache
    name_or_path: str | None = None  # the base's folder or hub name (None: built from an architecture)
    adapters: dict[str, LoraSpec] = field(default_factory=dict)  # the sampled roles' adapters
    run_folder: str | None = None  # trainer.default_root_dir: where an engine may write (adapters, a server's log)


class Engine:
    """Draws ``group`` responses to each prompt from a role of the shared base; subclass it for a new engine.

    An engine is made from the config before the model exists, so it binds to the model it is handed at its first
    :meth:`draw` and keeps what it builds for it (caches, compiled steps, its own copy of the weights). The
    hyper-parameters saved in a checkpoint leave it out: the run's config holds it.
    """

    def resolved(self, device: torch.device, sharded: bool, kv_cache: str) -> Engine:
        """The engine that draws on ``device`` (itself; :class:`Auto` picks one)."""
        return self

    def refusal(self, setup: EngineSetup) -> str | None:
        """Why this engine cannot serve the run, in one line (None when it can); the fit stops with it at setup."""
        return None

    def prepare(self, setup: EngineSetup) -> None:
        """When the fit is set up, after :meth:`refusal`: keep what the engine needs of ``setup`` (nothing here)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        compatibility.renamed_hooks(cls, compatibility.RENAMED_ENGINE_METHODS, reader="the fit")

    # ---- drawing ahead: the capability an engine declares with ahead_refusal -> None ----------------------

    def ahead_refusal(self, staleness: int) -> str | None:
        """Why this engine cannot draw the rollouts of the next ``staleness`` iterations while the trainer updates
        the policy (``asynchronous.max_staleness`` > 0), in one line. An engine that can returns None and implements
        :meth:`keep_versions` and :meth:`serve_version` (and :meth:`where`); nothing else changes for it."""
        return (f"asynchronous.max_staleness={staleness}: the engine {type(self).__name__} draws in the trainer's "
                "own process, from its model (one active adapter for the whole model) and on its cores, so it cannot "
                "draw while the policy trains; use an engine that draws ahead "
                "(rlhf_lightning.rollout.vllm_server.VLLMServer), or asynchronous.max_staleness: 0")

    def keep_versions(self, staleness: int) -> None:
        """Before the fit, on an engine that draws ahead: versions of the policy up to ``staleness`` iterations old
        will be drawn from while the trainer updates it (what the engine keeps is sized by it)."""

    def serve_version(self, model: SharedBase, role: str, version: int, tensors: dict[str, Tensor] | None = None,
                      current: bool = True) -> PolicyVersion:
        """An immutable handle on ``role``'s ``version``, kept until the handle is released: the current adapter
        (``current``; ``tensors`` its weights when gathered already), or the weights ``tensors`` of an older version
        a resumed run redraws from. Main thread only (FSDP2: every rank, a collective)."""
        raise NotImplementedError(f"the engine {type(self).__name__} does not draw ahead (see its ahead_refusal)")

    def where(self) -> str:
        """What draws, as the messages about a wait for it name it."""
        return f"the engine {type(self).__name__}"

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        """``(tokens [B * group, R], log-probs [B * group, R])`` of ``group`` responses to each left-padded prompt
        ``input_ids`` ``[B, P]`` (rows ``b * group ..`` answer prompt ``b``), sampled by ``role``'s adapter of
        ``model``.

        ``R`` is at most ``settings.max_new_tokens``; tokens after a row's stop token may be anything (the sampler
        cuts them). ``seeds``: one per response, each drawn from a stream of its own; None = the global random
        stream. ``synced``: keep decoding until every rank has finished (a base sharded layer by layer gathers
        its layers in every forward pass, a collective)."""
        raise NotImplementedError

    def sync(self, model: SharedBase, role: str, version: int) -> None:
        """After an optimizer step changed ``role``'s adapter, which is now its ``version`` (the optimizer steps taken
        so far): bring a copy of the weights up to date. Engines that sample the shared base itself have none."""

    def rest(self) -> None:
        """After a rollout, before the update: free what the engine need not hold meanwhile (nothing here)."""

    def close(self) -> None:
        """At the end of a fit: release what the engine holds beyond the model (nothing here)."""


class PolicyVersion(Engine):
    """A handle on one version of a sampled adapter that an engine drawing ahead holds for it
    (:meth:`Engine.serve_version`): an engine itself, which draws from that version whatever the trainer's weights
    are now, from any thread (the rollout producer's), and never changes; :meth:`release` when its draws are done."""

    version: int  # the optimizer steps taken before the adapter it holds

    def release(self) -> None:
        """The draws from this version are done: the engine may drop it (any thread)."""


@contextmanager
def sampling_mode(model: SharedBase, role: str | None, device: torch.device) -> Iterator[None]:
    """``role`` active, eval mode, and the weights' own precision outside any autocast (bf16-mixed): autocast would
    re-cast every frozen fp32 weight to bf16 at each decoded token (8 bytes read per parameter instead of 4), and it
    leaves rotary keys in fp32 beside bf16 values, which a static cache (one dtype for both) rejects. Its passes are
    left out of the hook-based FLOP count (:func:`~rlhf_lightning.utils.flops.uncounted`): the throughput figures
    count generation from the rollout's lengths."""
    was_training = model.training
    model.eval()
    try:
        with model.role(role), torch.autocast(device.type, enabled=False), uncounted():
            yield
    finally:
        model.train(was_training)


def _draws(seeds: Sequence[int] | None, settings: SamplingSettings, device: torch.device) -> Tensor | None:
    return None if seeds is None else row_draws(list(seeds), settings.max_new_tokens, device)


class EagerDecoder(Engine):
    """Our decoding loop over a static KV cache (:class:`~rlhf_lightning.rollout.decode.Decoder`), its caches and
    compiled step kept between rollouts."""

    compiled = False

    def __init__(self) -> None:
        self._decoder: Decoder | None = None

    def refusal(self, setup: EngineSetup) -> str | None:
        if setup.kv_cache == "dynamic":
            return (f"engine {type(self).__name__} decodes over a static KV cache; kv_cache: dynamic needs the "
                    "engine Generate (or Auto)")
        return None

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        if self._decoder is None or self._decoder.hf_model is not model.hf_model:
            self._decoder = Decoder(model.hf_model, compiled=self.compiled)
        device = input_ids.device
        stop_ids = torch.tensor(settings.stop_token_ids, dtype=torch.long, device=device)
        warpers = sampling_warpers(settings.temperature, settings.top_k, settings.top_p)
        with sampling_mode(model, role, device):
            return self._decoder(input_ids, attention_mask, warpers, settings.max_new_tokens, stop_ids, pad_token_id,
                                 draws=_draws(seeds, settings, device), group=group, synced=synced)

    @property
    def decoder(self) -> Decoder | None:
        """The decoding loop of the model drawn from last (None before the first draw)."""
        return self._decoder


class CompiledDecoder(EagerDecoder):
    """:class:`EagerDecoder` with its decode step ``torch.compile``-d (CUDA graphs on a GPU), compiled once per batch
    size, 64-token prompt bucket and adapter role."""

    compiled = True

    def refusal(self, setup: EngineSetup) -> str | None:
        if setup.sharded:
            return ("engine CompiledDecoder cannot run on an FSDP2-sharded base (its layers gather themselves in "
                    "hooks that are not compiled); use the engine EagerDecoder or Auto")
        return super().refusal(setup)


class Generate(Engine):
    """transformers' ``generate`` with our inverse-CDF sampler as the last logits processor (every response's row
    encodes its prompt)."""

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        input_ids, attention_mask = input_ids.repeat_interleave(group, 0), attention_mask.repeat_interleave(group, 0)
        processors = sampling_processors(settings.temperature, settings.top_k, settings.top_p,
                                         _draws(seeds, settings, input_ids.device), input_ids.shape[1])
        with sampling_mode(model, role, input_ids.device):
            sequences = model.hf_model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=generation_config(settings, pad_token_id), logits_processor=processors,
                synced_gpus=synced)
        responses = sequences[:, input_ids.shape[1]:]
        return responses, processors[-1].sampled_logprobs()[:, : responses.shape[1]]


class Auto(Engine):
    """Our fastest decoder for the place it runs: :class:`CompiledDecoder` on CUDA (CUDA graphs),
    :class:`EagerDecoder` elsewhere and on an FSDP2-sharded base (whose per-layer hooks are not compiled),
    :class:`Generate` with a dynamic KV cache. All draw the same tokens (compiled: up to kernel rounding)."""

    def resolved(self, device: torch.device, sharded: bool, kv_cache: str) -> Engine:
        if kv_cache == "dynamic":
            return Generate()
        return CompiledDecoder() if device.type == "cuda" and not sharded else EagerDecoder()

    def refusal(self, setup: EngineSetup) -> str | None:
        return self.resolved(torch.device(setup.device_type), setup.sharded, setup.kv_cache).refusal(setup)


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
