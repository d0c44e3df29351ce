"""What the parent prints: each side's summary over its processes, the iteration table and where ours goes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .measure import GIB

# The printed names of the library's phase markers (rlhf_lightning.utils.timing.PHASES), where a marker's own name
# does not say which models the phase runs; the one place a printed phase name is chosen.
PHASE_LABELS = {
    # the old log-probs are made here unless the update's first pass gives them (PassPlan.reuse_first_pass)
    "rollout/logprobs": "rollout/logprobs (reference; old unless reused)",
    "rollout/values": "rollout/values (critic)",
}


def median(values: list[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else float("nan")


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per side: median iteration seconds, rollout/update split, tokens/s, peak memory over all processes, the
    median ``precompute`` seconds where the processes report one (DPO's reference pass before training), the
    median seconds of each phase where they report phases (ours) and the lengths of the responses of each rollout
    where they report them (the same in every process)."""
    summary = {}
    for side, runs in results.items():
        rows = [row for run in runs for row in run["iterations"]]
        seconds = median([row["seconds"] for row in rows])
        entry: dict[str, Any] = {"seconds": seconds, "peak_rss": max(run["peak_rss"] for run in runs)}
        if runs[0].get("peak_cuda") is not None:
            entry["peak_cuda"] = max(run["peak_cuda"] for run in runs)
        if "rollout" in rows[0]:
            entry["rollout"] = median([row["rollout"] for row in rows])
            entry["update"] = median([row["seconds"] - row["rollout"] for row in rows])
            entry["tokens_per_second"] = median([row["tokens"] for row in rows]) / seconds
        if "lengths" in runs[0]:  # the responses' lengths of every rollout (--lengths other than equal)
            if any(run["lengths"] != runs[0]["lengths"] for run in runs):
                raise RuntimeError(f"{side}'s processes realised different response lengths")
            entry["lengths"] = runs[0]["lengths"]
        if "precompute" in runs[0]:  # seconds of a pass made once per process, before the measured iterations
            entry["precompute"] = median([run["precompute"] for run in runs])
        if "phases" in rows[0]:
            names = {name for row in rows for name in row["phases"]}
            entry["phases"] = {name: median([row["phases"].get(name, 0.0) for row in rows]) for name in sorted(names)}
        summary[side] = entry
    return summary


def print_iteration_table(summary: dict[str, dict[str, Any]], sides: Sequence[str],
                          floors: dict[str, dict[str, Any]], weights: int, memory_key: str) -> None:
    """The online benchmarks' table: per side (in ``sides`` order) seconds per iteration, its rollout/update
    split, generated tokens per second and peak memory; then each floor with its pieces."""
    print(f"\none copy of the weights: {weights / GIB:.3f} GiB; peak memory = {memory_key}")
    print(f"{'side':<16} {'s/iter':>8} {'rollout':>8} {'update':>8} {'tok/s':>8} {'peak GiB':>9} {'x weights':>9}")
    for side in sides:
        if side in summary:
            s = summary[side]
            print(f"{side:<16} {s['seconds']:>8.2f} {s['rollout']:>8.2f} {s['update']:>8.2f} "
                  f"{s['tokens_per_second']:>8.1f} {s[memory_key] / GIB:>9.3f} {s[memory_key] / weights:>9.1f}")
    for name, floor in floors.items():
        if floor:
            print(f"{name:<16} {floor['seconds']:>8.2f} {'':>8} {'':>8} {'':>8} {floor['peak'] / GIB:>9.3f} "
                  f"{floor['peak'] / weights:>9.1f}")
            for piece, seconds in floor["pieces"].items():
                print(f"  {piece:<14} {seconds:>8.2f} s")


def print_phases(heading: str, entry: dict[str, Any], other: str, digits: int = 2) -> None:
    """Where one of our iterations goes: ``heading``, then the median seconds of each phase the library marked
    (``rlhf_lightning.utils.timing.PHASES``, by name), then the rest of the iteration's seconds as ``other``."""
    phases = entry.get("phases", {})
    print(f"\n{heading}:")
    for name in sorted(phases):
        print(f"  {PHASE_LABELS.get(name, name):<38} {phases[name]:>7.{digits}f}")
    print(f"  {other:<38} {entry['seconds'] - sum(phases.values()):>7.{digits}f}")
