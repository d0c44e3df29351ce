"""vLLM's own OpenAI-compatible server as the rollout engine (``engine: {class_path:
rlhf_lightning.rollout.vllm_server.VLLMServer}``): generation on its own devices (its own data and tensor
parallelism, continuous batching), beside a trainer in one process, under DDP or under FSDP2.

- **Started by you or by the fit.** ``urls`` names servers you started (``vllm serve BASE --enable-lora ...``; rank
  ``r`` of a DDP or FSDP2 fit sends its prompts to ``urls[r % len(urls)]``); without ``urls`` each rank starts one
  on 127.0.0.1 at its first draw (:class:`~rlhf_lightning.rollout.vllm_process.ServerProcess`, a managed
  subprocess: the command, a free port, its log in the run folder, the wait until it answers) and stops it at the
  end of the fit (its teardown).
- **Token ids in and out**: prompts go as token ids, responses come back as token ids with the log-probs the server
  sampled them with (after the temperature: ``--logprobs-mode processed_logprobs``); no text round trip. A group is
  one request with vLLM's ``n`` and one seed from the run's random streams, so a resumed run sends the same requests.
- **Adapters by version.** After every optimizer step the loop calls :meth:`VLLMServer.sync`: the role's adapter
  (gathered from its shards under FSDP2) is written once, by rank 0, to ``<run folder>/engine-adapters/<role>-v<k>``
  and loaded by every rank's server as ``<role>-v<k>-<run>`` before any request names it (``<run>``: 8 hex digits
  of the run folder's path, so that runs sharing a server never take each other's adapters, and a resumed run
  finds its own); the version before it is then unloaded (``max_loras`` >= 2 holds both during the swap). A new
  name per version keeps the server from reusing prefix-cache entries computed under the old weights. Every request names the version it wants, and an answer from
  another model, or a draw from an adapter changed since its last sync, stops the fit in one line.
- **Faults are one line**, never a hang: every call has a timeout (``request_timeout``); a server that is unreachable,
  answers an HTTP error, serves another base than the trainer's, has runtime LoRA loading off, or a ``max_model_len``
  shorter than prompt + response, is named with what to change; a server the fit started that died names its log.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import Engine, EngineSetup, PolicyVersion
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_process import ServerError, ServerProcess, request_json
from rlhf_lightning.rollout.vllm_support import (
    adapter_tensors,
    check_length,
    fingerprint,
    installed_version,
    run_refusal,
    stale_adapter_error,
    version_refusal,
)


class VLLMServer(Engine):
    """Generation on vLLM's OpenAI-compatible server (see the module docstring).

    Args:
        urls: servers you started (``http://host:port``), each serving the base with ``--enable-lora`` and
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, reading ``<run folder>/engine-adapters`` from the same path;
            rank r uses ``urls[r % len(urls)]``. Null: each rank starts its own on 127.0.0.1 and stops it at the end.
        max_loras: adapter slots of a server the fit starts (``--max-loras``): each sampled role's current version
            and the one it replaces, during the swap.
        kv_cache_gib: KV cache of a server the fit starts, in GiB (``--kv-cache-memory-bytes``); null = vLLM's
            ``--gpu-memory-utilization`` on a GPU, 1 GiB on a CPU.
        server_args: further arguments of a server the fit starts (``["--tensor-parallel-size", "2"]``).
        cpus: CPU cores a server the fit starts is bound to (a disaggregated placement on one machine: the server on
            some cores, the trainer on the others); null = unbound.
        startup_timeout: seconds a server the fit starts may take to answer.
        request_timeout: seconds any one call may take before the fit stops with the server's address.
    """

    def __init__(self, urls: list[str] | None = None, max_loras: int = 2, kv_cache_gib: float | None = None,
                 server_args: list[str] | None = None, cpus: list[int] | None = None, startup_timeout: float = 600.0,
                 request_timeout: float = 300.0) -> None:
        if urls is not None and not urls:
            raise ValueError("engine.init_args.urls: name at least one server, or null to start one")
        if max_loras < 1:
            raise ValueError(f"engine.init_args.max_loras must be >= 1, got {max_loras}")
        self.urls = urls
        self.max_loras = max_loras
        self.kv_cache_gib = kv_cache_gib
        self.server_args = list(server_args or [])
        self.cpus = cpus
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.run_folder: Path | None = None
        self.url: str | None = None  # this rank's server
        self.process: ServerProcess | None = None
        self.base_name: str | None = None  # the base as the server names it
        self.max_model_len: int | None = None
        self.loaded: dict[str, int] = {}  # role -> the version this rank's server holds as the current one
        self.resident: dict[str, set[int]] = {}  # role -> every version this rank's server holds
        self.staleness = 0  # the fit's asynchronous.max_staleness: older versions kept loaded while drawn from
        self._pins: Counter[tuple[str, int]] = Counter()  # versions drawn from by requests in flight
        self._pins_lock = threading.Lock()
        self.synced: dict[str, tuple[int, tuple]] = {}  # role -> (version, fingerprint) at its last sync
        self.push_seconds = 0.0  # the last sync's write and load
        self.startup_seconds = 0.0  # from starting a server to its first answer (0 for a server given by URL)

    def refusal(self, setup: EngineSetup) -> str | None:
        # A server the fit starts is vLLM in this environment: the tested release. One started by the user may be
        # any release that speaks its API.
        refusal = (version_refusal(installed_version(), "the engine VLLMServer (without urls)")
                   if self.urls is None else None)
        return refusal or run_refusal(setup.name_or_path, setup.device_type, False, setup.adapters)

    def ahead_refusal(self, staleness: int) -> str | None:
        """None: the server draws on its own devices, from adapter versions it holds by name."""
        return None

    def keep_versions(self, staleness: int) -> None:
        """A server the fit starts holds ``staleness + 2`` adapter versions at least (those still drawn from, the
        current one and the one replacing it); a sync then records the version without loading it (:meth:`sync`)."""
        self.staleness = staleness

    def where(self) -> str:
        return f"the vLLM server at {self.url}"

    def prepare(self, setup: EngineSetup) -> None:
        """Keep the run folder; a server given by URL is checked now, before the model is built: it answers and
        serves the trainer's base."""
        self.run_folder = Path(setup.run_folder or ".")
        if self.urls is not None and setup.name_or_path is not None:
            self.attach(self.urls[rank() % len(self.urls)], setup.name_or_path)

    # ---- the server ----------------------------------------------------------------------------------------

    def connect(self, model: SharedBase) -> None:
        """This rank's server, at its first draw: started where the fit starts it (then checked as :meth:`attach`
        does)."""
        base = str(model.hf_model.config.name_or_path)
        if self.urls is not None:
            self.attach(self.urls[rank() % len(self.urls)], base)
            return
        self.process = ServerProcess.for_model(model, self.adapter_root() / f"server-rank{rank()}.log",
                                               max(self.max_loras, self.staleness + 2), self.kv_cache_gib,
                                               self.server_args, self.cpus, self.startup_timeout)
        start = time.perf_counter()
        url = self.process.start()
        self.startup_seconds = time.perf_counter() - start
        self.attach(url, base)

    def attach(self, url: str, base: str) -> None:
        """Use the server at ``url``: it answers, it serves ``base`` (the trainer's), and its ``max_model_len``."""
        self.url = url.rstrip("/")
        cards = self.call("GET", "/v1/models")["data"]
        served = next((card for card in cards if card.get("parent") is None), cards[0])
        if os.path.realpath(str(served.get("root") or served["id"])) != os.path.realpath(base):
            self.url = None
            raise ServerError(f"the vLLM server at {url} serves {served.get('root') or served['id']}, not the "
                              f"trainer's base {base}: start it with that base (its responses would be another "
                              "model's)")
        self.base_name, self.max_model_len = served["id"], served.get("max_model_len")

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One call to this rank's server, its answer as JSON (one line on any failure: the address, the status and
        what the server said, or where the log of a server the fit started is)."""
        try:
            return request_json(method, f"{self.url}{path}", body, self.request_timeout)
        except ServerError as error:
            if self.process is not None:
                error = self.process.explain(error)
            raise error from None

    def adapter_root(self) -> Path:
        root = (self.run_folder or Path(".")).resolve() / "engine-adapters"
        root.mkdir(parents=True, exist_ok=True)
        return root

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process, self.url, self.loaded, self.resident = None, None, {}, {}

    # ---- adapters ------------------------------------------------------------------------------------------

    def sync(self, model: SharedBase, role: str, version: int) -> None:
        """Write ``role``'s adapter as ``version`` (rank 0; every rank takes part in gathering FSDP2's shards) and
        load it into this rank's server; before the first draw only the version is recorded (the first draw loads
        it). When rollouts are drawn ahead (``asynchronous.max_staleness``) only the version is recorded too: the
        producer draws from the version an iteration starts from and loads it then, and a push of every optimizer
        step's version would load, then unload, versions nothing draws from, on a server busy drawing."""
        tensors = adapter_tensors(model, role)  # FSDP2: each shard gathered, a collective on every rank
        self.synced[role] = (version, fingerprint(tensors))
        if self.url is not None and not self.staleness:
            self.push(model, role, version, tensors)

    def adapter_name(self, role: str, version: int) -> str:
        """The name the servers know ``role``'s ``version`` by (see the module docstring)."""
        run = hashlib.sha1(str(self.adapter_root()).encode()).hexdigest()[:8]
        return f"{role}-v{version}-{run}"

    def push(self, model: SharedBase, role: str, version: int, tensors: dict[str, Tensor], current: bool = True) -> None:
        """Write ``tensors`` as ``role``'s ``version`` (rank 0) and load it into this rank's server; with ``current``
        it is the version draws name from now on, and the versions before it are unloaded unless a request in
        flight draws from one (:meth:`pin`). ``current=False``: an older version an asynchronous run redraws from
        after a resume."""
        start = time.perf_counter()
        name, folder = self.adapter_name(role, version), self.adapter_root() / f"{role}-v{version}"
        if not dist.is_initialized() or dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            save_file({key: value.contiguous() for key, value in tensors.items()},
                      str(folder / "adapter_model.safetensors"))
            model.model.peft_config[role].save_pretrained(str(folder))
        if dist.is_initialized():
            dist.barrier()  # the files are written before any rank's server reads them
        resident = self.resident.setdefault(role, set())
        if version not in resident:
            try:
                self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            except ServerError as error:
                if error.status not in (400, 404):
                    raise
                if "already been loaded" not in str(error):  # else: this run's own version, loaded before a resume
                    raise ServerError(f"the vLLM server at {self.url} does not load adapters at run time ({error}): "
                                      "start it with --enable-lora --max-loras 2 (or more) and the environment "
                                      "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", error.status) from None
            resident.add(version)
        if current:
            self.loaded[role] = version
        self.retire(role)
        self.push_seconds = time.perf_counter() - start

    def retire(self, role: str) -> None:
        """Unload ``role``'s versions that are neither the current one nor drawn from by a request in flight. Drawing
        ahead, the ``staleness + 1`` newest stay too: ranks sharing a server load a version under one name, and
        another rank's producer may still draw from one this rank no longer pins (an iteration's rollout is taken by
        every rank before its optimizer step, so only versions older than these are done with on every rank)."""
        resident = sorted(self.resident.get(role, ()))
        recent = set(resident[-(self.staleness + 1):]) if self.staleness else set()
        with self._pins_lock:
            retired = {old for old in resident if old != self.loaded.get(role) and old not in recent
                       and not self._pins[(role, old)]}
        for old in sorted(retired):
            try:
                self.call("POST", "/v1/unload_lora_adapter", {"lora_name": self.adapter_name(role, old)})
            except ServerError as error:  # another rank sharing this server unloaded it first
                if error.status != 404:
                    raise
            self.resident[role].discard(old)

    def pin(self, role: str, version: int) -> None:
        """Keep ``role``'s ``version`` loaded until :meth:`unpin` (requests drawing from it are in flight)."""
        with self._pins_lock:
            self._pins[(role, version)] += 1

    def unpin(self, role: str, version: int) -> None:
        """The requests :meth:`pin` kept ``version`` for are done (it is unloaded at the next push); any thread."""
        with self._pins_lock:
            self._pins[(role, version)] -= 1

    def requested_model(self, model: SharedBase, role: str | None, tensors: dict[str, Tensor] | None = None) -> str:
        """The model name a draw from ``role`` asks for: the base, or the adapter's synced version (loaded now at
        the first draw); refused where the adapter changed since its last sync. ``tensors``: the adapter's, when
        the caller has gathered them already."""
        if role is None:
            return self.base_name
        if tensors is None:
            tensors = adapter_tensors(model, role)  # FSDP2: gathered, a collective (every rank draws)
        version, synced = self.synced.get(role, (0, None))
        if synced is not None and synced != fingerprint(tensors):
            raise stale_adapter_error(role, version)
        if self.loaded.get(role) != version:
            self.push(model, role, version, tensors)
        return self.adapter_name(role, version)

    def serve_version(self, model: SharedBase, role: str, version: int, tensors: dict[str, Tensor] | None = None,
                      current: bool = True) -> ServedVersion:
        """``role``'s ``version``, loaded and pinned (kept loaded until the handle is released), for requests a
        producer thread sends while the trainer updates the adapter: the current adapter (``current``; ``version``
        must be its last sync's; ``tensors`` its weights when gathered already), or the weights ``tensors`` of an
        older version an asynchronous run redraws from after a resume. Connects at first use. Main thread only
        (FSDP2: every rank, a collective)."""
        return ServedVersion(self, role, version, self.load_version(model, role, version, tensors, current))

    def load_version(self, model: SharedBase, role: str, version: int, tensors: dict[str, Tensor] | None,
                     current: bool) -> str:
        """The served name of ``role``'s ``version``, loaded and pinned (:meth:`serve_version`)."""
        if self.url is None:
            self.connect(model)
        self.pin(role, version)
        if current:
            name = self.requested_model(model, role, tensors)
            if self.loaded.get(role) != version:
                raise RuntimeError(f"{role}'s adapter was last synced as version {self.loaded.get(role)}, not "
                                   f"{version}: sync it before drawing from it")
            return name
        if version not in self.resident.get(role, set()):
            self.push(model, role, version, tensors, current=False)
        return self.adapter_name(role, version)

    # ---- drawing -------------------------------------------------------------------------------------------

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        if self.url is None:
            self.connect(model)
        return self.request(self.requested_model(model, role), input_ids, attention_mask, group, settings,
                            pad_token_id, seeds)

    def request(self, name: str, input_ids: Tensor, attention_mask: Tensor, group: int, settings: SamplingSettings,
                pad_token_id: int, seeds: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`draw` from the served model ``name`` (the base, or an adapter version already loaded), without
        reading the trainer's model: what a producer thread calls while the trainer updates it. Safe from any
        thread."""
        check_length(attention_mask, settings.max_new_tokens, self.max_model_len,
                     f"the vLLM server's max_model_len ({self.url}; its --max-model-len)")
        prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]
        request_seeds = (torch.randint(0, 2**62, (len(prompts),)).tolist() if seeds is None
                         else [int(seed) for seed in list(seeds)[::group]])
        bodies = [{"model": name, "prompt": prompt, "n": group, "seed": seed, "max_tokens": settings.max_new_tokens,
                   "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k or -1,
                   "stop_token_ids": list(settings.stop_token_ids), "ignore_eos": True, "logprobs": 0,
                   "return_token_ids": True, "skip_special_tokens": False}
                  for prompt, seed in zip(prompts, request_seeds, strict=True)]
        with ThreadPoolExecutor(max_workers=min(len(bodies), 32)) as pool:  # the server batches them together
            answers = list(pool.map(lambda body: self.call("POST", "/v1/completions", body), bodies))
        rows = []
        for answer in answers:
            if answer.get("model") != name:
                raise RuntimeError(f"the vLLM server at {self.url} answered from {answer.get('model')!r}, not the "
                                   f"requested {name!r}: sampling would be from another policy than the trained one")
            rows += [(choice["token_ids"], choice["logprobs"]["token_logprobs"])
                     for choice in sorted(answer["choices"], key=lambda choice: choice["index"])]
        length = max(1, max(len(ids) for ids, _ in rows))
        tokens = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(rows), length), dtype=torch.float32)
        for index, (ids, values) in enumerate(rows):
            tokens[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[index, : len(ids)] = torch.tensor(values, dtype=torch.float32)
        return tokens.to(input_ids.device), logprobs.to(input_ids.device)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass(frozen=True)
class ServedVersion(PolicyVersion):
    """An adapter version a :class:`VLLMServer` holds loaded under ``name``, pinned until :meth:`release`: draws
    from it by name, without reading the trainer's model (the engine of the rollout producer's thread)."""

    server: VLLMServer
    role: str
    version: int
    name: str

    def draw(self, model: SharedBase, role: str | None, input_ids: Tensor, attention_mask: Tensor, group: int,
             settings: SamplingSettings, pad_token_id: int, seeds: Sequence[int] | None = None,
             synced: bool = False) -> tuple[Tensor, Tensor]:
        return self.server.request(self.name, input_ids, attention_mask, group, settings, pad_token_id, seeds)

    def release(self) -> None:
        self.server.unpin(self.role, self.version)

    def where(self) -> str:
        return self.server.where()
