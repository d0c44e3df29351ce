"""The machine a run shares: when other jobs already keep its cores busy, torch's default of one thread per core
makes every process compete for them (the quick start's PPO took 27 min 51 s instead of 1 min 39 s at load 4–7 on
2 cores), and one line at the start says what to set."""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The cores this process may run on (its affinity; all of the machine's where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def busy_machine_warning() -> str | None:
    """One line when the machine's load over the last minute exceeds its cores (by half of them, at least one)
    while torch uses more than one thread; None otherwise (or where the load cannot be read)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores, threads = usable_cores(), torch.get_num_threads()
    # Beyond the cores by a margin: the previous stage of a pipeline keeps the one-minute load near the cores
    # for a while after it ends, and that is no other job.
    if load <= cores + max(1.0, cores / 2) or threads <= 1:
        return None
    return (f"this machine is busy (load {load:.1f} over the last minute, {cores} cores): torch's {threads} threads "
            "per process compete with the other jobs, which can make a run several times slower; start it with "
            "OMP_NUM_THREADS=1 (or fewer threads than the cores left free); another thread count rounds floats "
            "otherwise, so the run is another sample of those docs/studies.md measures at 1 and 2 threads: the quick "
            "start's PPO learned on 10 of 10, GRPO, RLOO and REINFORCE++ on 5 of 6 (each failing at seed 0 with "
            "one thread)")
