"""Measuring a side: its memory (peak resident set, CUDA's allocator peak), wall clocks and our phases.

Our side's iteration is split into the phases the library marks itself (``rlhf_lightning.utils.timing``): a
:class:`Stopwatch` collects them with :meth:`Stopwatch.recording_phases`, so no method is wrapped or named here.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .fixtures import model_dir
from .settings import Settings

GIB = 2**30


class Stopwatch:
    """Wall-clock seconds of named pieces, synchronising the device so asynchronous kernels are counted."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def now(self) -> float:
        """The time in seconds, after the device has finished what it was given."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to piece ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The seconds of every piece so far; the watch starts again from none."""
        seconds, self.seconds = self.seconds, {}
        return seconds

    @contextlib.contextmanager
    def recording_phases(self) -> Iterator[None]:
        """Inside the block, every phase the library marks (``rlhf_lightning.utils.timing.PHASES``) adds its seconds to
        the piece of its name, read with this watch's clock."""
        from rlhf_lightning.utils.timing import record_phases

        with record_phases(self.add, clock=self.now):
            yield


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_cuda_bytes() -> int | None:
    """CUDA's allocator peak of this process; None without CUDA."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def peak_memory_key(device: str) -> str:
    """The summary's peak-memory entry for ``device``: CUDA's allocator peak on a GPU, else the peak RSS."""
    return "peak_cuda" if device.startswith("cuda") else "peak_rss"


def rss_bytes(pid: int) -> int:
    """The current resident set size of process ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def meminfo_bytes(field: str) -> int:
    """A field of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``) in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        if name == field:
            return int(value.split()[0]) * 1024
    raise KeyError(field)


def weights_bytes(settings: Settings) -> int:
    """Bytes of one copy of the base weights in the benchmark's dtype (fp32 storage in both precisions), counted
    on the meta device: this process holds no copy of them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir(settings)),
                                                 dtype=torch.float32)
    return sum(p.numel() * p.element_size() for p in model.parameters())
