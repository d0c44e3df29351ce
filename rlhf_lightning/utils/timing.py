"""Named phases of a training step, for whoever wants to time them.

The loops mark their pieces with ``with phase("rollout/generate"): ...``: generation, the scoring passes, the
update's forward passes, backward and optimizer step. Nothing is measured unless a recorder is installed with
:func:`record_phases` (the benchmarks do), so a marker costs one list check. Renaming a method never breaks a
timing: the names are these strings, listed in :data:`PHASES`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

Recorder = Callable[[str, float], None]  # (phase name, seconds)

PHASES = (
    "rollout/generate",  # sampling the responses
    "rollout/logprobs",  # the rollout's policy (old) and reference log-probs
    "rollout/values",  # the critic's values of the rollout (PPO)
    "rollout/reward",  # the reward sources
    "rollout/teacher",  # a distillation teacher's log-probs of the rollout
    "update/policy forward",  # the policy's log-probs in the update (and DPO's)
    "update/reference forward",  # DPO's reference log-probs per step
    "update/critic forward",  # the critic's values in the update (PPO)
    "update/backward",  # every backward pass
    "update/optimizer step",  # the optimizer's step
    "update/engine sync",  # an engine's copy of the weights brought up to date after a step (vLLM's adapter push)
)

_recorders: list[tuple[Recorder, Callable[[], float]]] = []


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the block as phase ``name`` (one of :data:`PHASES`): its seconds go to every installed recorder."""
    if not _recorders:
        yield
        return
    starts = [clock() for _, clock in _recorders]
    try:
        yield
    finally:
        for (recorder, clock), start in zip(_recorders, starts, strict=True):
            recorder(name, clock() - start)


@contextlib.contextmanager
def record_phases(recorder: Recorder, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """Send every phase's seconds to ``recorder`` inside the block; ``clock`` reads the time (a benchmark on a GPU
    gives one that synchronises the device first, so that asynchronous kernels are counted)."""
    entry = (recorder, clock)
    _recorders.append(entry)
    try:
        yield
    finally:
        _recorders.remove(entry)


class Stopwatch:
    """Seconds spent in named parts of a block that alternates between them (the on-policy loop's rollout and
    update): ``with watch.lap("rollout"): ...`` adds the block's seconds to ``watch.seconds["rollout"]``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started = clock()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def lap(self, part: str) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + self.clock() - start

    def elapsed(self) -> float:
        """Seconds since the stopwatch was made."""
        return self.clock() - self.started
