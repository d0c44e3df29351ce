"""vLLM as a rollout engine (``engine: {class_path: rlhf_lightning.rollout.vllm_engine.VLLMEngine}``): vLLM's ``LLM``
built once in the training process, serving the base from its folder and each adapter the rollouts sample from,
pushed as tensors.

- **Its own copy of the weights and a KV cache**, beside the training model's (unlike our decoder, which runs on
  the shared base): the price of vLLM's kernels and scheduler, which pay off on GPUs.
- **Adapter-only sync, versioned.** After every optimizer step the training loop calls :meth:`VLLMEngine.sync`:
  the sampled role's tensors (a few MB: the adapter, never the base) are loaded into vLLM's LoRA cache under a new
  id and version, with no file written. vLLM's worker records which version of which role it holds; a draw whose
  adapter changed since its last sync, or from any other version than the synced one, is refused: a failed sync
  stops the run instead of training on a stale policy.
- **Its log-probs are the sampler's** (of the distribution it sampled, after the temperature): the trainer's pass
  stays the truth for the loss, and the gap between the two is logged (``rollout/mismatch_*``) and corrected by
  the module's ``correction``.
- **Seeded per request**: one seed per prompt, from the run's random stream (or the per-response seeds of
  ``seed_scope: prompt``), and vLLM's ``n`` draws the group (its response ``i`` seeded ``seed + i``): a resumed
  run redraws what the uninterrupted one drew.
- **One engine per DDP rank**, each on its rank's prompts, on the process group Lightning started (vLLM's
  ``external_launcher``); FSDP2 is refused.
- **The process is left as it was**: building ``LLM`` in one process initialises ``torch.distributed`` (gloo, one
  rank: vLLM keeps using it until it is closed), replaces ``torch.set_num_threads`` with a no-op on CPU and
  reseeds the random generators; the last two are restored.

What it cannot serve is refused in one line when the fit is set up (:meth:`VLLMEngine.refusal`, from
:mod:`rlhf_lightning.rollout.vllm_support`).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import Engine, EngineSetup
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_support import (
    adapter_tensors,
    check_length,
    contained,
    fingerprint,
    kv_cache_bytes,
    lora_slots,
    peft_config,
    stale_adapter_error,
    vllm_refusal,
)
from rlhf_lightning.utils.checks import check_vllm


@dataclass(frozen=True)
class Served:
    """An adapter as vLLM holds it: the fingerprint of the weights it was pushed from, its version, its LoRA id."""

    state: tuple[float, ...]  # vllm_support.fingerprint of the role's adapter tensors
    version: int
    lora_id: int


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


class VLLMEngine(Engine):
    """vLLM's ``LLM`` in this process, serving the base and the sampled roles' adapters (see the module docstring);
    built on the first draw.

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

    def __init__(self, kv_cache_gib: float | None = None, gpu_memory_utilization: float = 0.3,
                 enforce_eager: bool | None = None, sleep: bool = True, max_model_len: int | None = None) -> None:
        check_vllm(kv_cache_gib, gpu_memory_utilization, max_model_len)
        self.kv_cache_gib = kv_cache_gib
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.sleep = sleep
        self.max_model_len = max_model_len
        self.model: SharedBase | None = None  # the model vLLM serves (built from its folder at the first draw)
        self.llm: Any = None
        self.served: dict[str, Served] = {}
        self.synced: dict[str, tuple[int, tuple]] = {}  # role -> (version, adapter state) at its last sync
        self.startup_seconds = 0.0
        self.push_seconds = 0.0  # the last adapter push
        self.asleep = False
        self.sleeps = False  # on a GPU with sleep
        self.owns_process_group = False  # torch.distributed was started by vLLM (and is ended with it)
        self._lora_ids = 0

    def refusal(self, setup: EngineSetup) -> str | None:
        return vllm_refusal(setup.name_or_path, setup.device_type, setup.sharded, setup.adapters)

    # ---- building ------------------------------------------------------------------------------------------

    def build(self, model: SharedBase) -> None:
        """Build vLLM's ``LLM`` from ``model``'s base folder, LoRA on for the model's adapters."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no copies
        self.model = model
        device = next(model.parameters()).device
        hf_model = model.hf_model
        # A LoRA slot per adapter on the base; each push retires its previous id, so nothing is ever evicted.
        rank, slots = lora_slots(model)
        arguments: dict[str, Any] = dict(
            model=hf_model.config.name_or_path, skip_tokenizer_init=True, seed=0,  # every request has its seed
            dtype=str(hf_model.dtype).removeprefix("torch."),
            enable_lora=True, max_lora_rank=rank, max_loras=slots,
            max_model_len=self.max_model_len, logprobs_mode="processed_logprobs",
            enforce_eager=device.type == "cpu" if self.enforce_eager is None else self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes(self.kv_cache_gib, device.type),
            enable_sleep_mode=device.type == "cuda" and self.sleep,
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
        self.sleeps = device.type == "cuda" and self.sleep
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
        self.model = None
        self.served.clear()
        gc.collect()
        destroy_model_parallel()  # vLLM's own groups (on every rank at once: the fit ends on every rank)
        if self.owns_process_group:
            destroy_distributed_environment()

    # ---- adapters ------------------------------------------------------------------------------------------

    def sync(self, model: SharedBase, role: str, version: int) -> None:
        """Push ``role``'s adapter as ``version`` (after the optimizer step that made it); before vLLM is built, or
        while it sleeps, the next draw pushes it."""
        tensors = adapter_tensors(model, role)
        self.synced[role] = (version, fingerprint(tensors))
        if self.llm is not None and model is self.model and not self.asleep:
            self._push(role, tensors, version, self.served.get(role))

    def served_version(self, role: str) -> Served:
        """``role``'s adapter as vLLM serves it, pushed first where vLLM holds none (its first draw, or after a
        sleep); refused where the trained adapter changed since its last sync, or where vLLM's worker holds another
        version than the one pushed: never a silent rollout from a stale policy."""
        tensors = adapter_tensors(self.model, role)
        state = fingerprint(tensors)  # what any write changes: an optimizer step, a checkpoint, ``p.data`` itself
        version, synced_state = self.synced.get(role, (0, None))
        if synced_state is not None and synced_state != state:
            raise stale_adapter_error(role, version)
        served = self.served.get(role)
        if served is None or served.state != state:  # its first draw, after a sleep, or weights loaded before it
            served = self._push(role, tensors, version, served)
        holds = self.llm.collective_rpc(_served)[0].get(role)
        if holds != (served.version, served.lora_id):
            held = "nothing" if holds is None else f"version {holds[0]} (LoRA id {holds[1]})"
            raise RuntimeError(f"vLLM serves {held} of adapter {role!r}, but the trained adapter is version "
                               f"{served.version} (LoRA id {served.lora_id}): the adapter sync failed, and "
                               "sampling would be from a stale policy")
        return served

    def _push(self, role: str, tensors: dict[str, Tensor], version: int, previous: Served | None) -> Served:
        self._lora_ids += 1
        state = fingerprint(tensors)  # before the push: vLLM scales the tensors it is given in place
        start = time.perf_counter()
        self.push(role, version, self._lora_ids, None if previous is None else previous.lora_id, tensors)
        self.push_seconds = time.perf_counter() - start
        served = self.served[role] = Served(state, version, self._lora_ids)
        return served

    def push(self, role: str, version: int, lora_id: int, retired: int | None, tensors: dict[str, Tensor]) -> None:
        """Load ``role``'s adapter ``tensors`` (copies: vLLM scales them in place) into vLLM's LoRA cache as
        ``lora_id``, retiring the previous id."""
        self.llm.collective_rpc(_load_adapter, args=(role, version, lora_id, tensors, peft_config(self.model, role),
                                                      retired))

    # ---- sleep (GPU) ---------------------------------------------------------------------------------------

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
            self.served.clear()  # level-1 sleep keeps the base's weights, not necessarily the LoRA cache

    def rest(self) -> None:
        """After a rollout: on a GPU with ``sleep``, free vLLM's KV cache and move its weights to CPU memory
        for the update."""
        if self.llm is not None and self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    # ---- drawing -------------------------------------------------------------------------------------------

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        if self.llm is not None and model is not self.model:  # another model: vLLM serves one
            self.close()
        if self.llm is None:
            self.build(model)
        check_length(attention_mask, settings.max_new_tokens, self.llm.llm_engine.model_config.max_model_len,
                      "vLLM's max_model_len (the engine's max_model_len, or the model's positions)")
        self.wake()
        lora = None
        if role is not None:
            served = self.served_version(role)
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

