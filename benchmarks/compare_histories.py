"""Two run folders' W&B histories compared row for row: is a refactor free of behaviour changes?

Run the same command on two checkouts (or before and after a change), then::

    python benchmarks/compare_histories.py outputs/ppo-before outputs/ppo-after

It prints one line per run pair: rows in each, the keys they share and those only one has, the rows and keys that
differ and the largest difference. Wall-clock keys (``time/``, ``throughput/``, ``perf/``: rates and shares of the
wall time, ``_runtime``, ``_timestamp``) are left out: they differ between any two runs. Exit status 0 when every
value is equal (to ``--tolerance``, 0 by default: identical), 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from rlhf_lightning.runs.wandb_offline import read_history

CLOCK_GROUPS = {"time", "throughput", "perf"}  # ppo/time/rollout, ppo/perf/mfu, ppo/perf/share/update/backward, ...
CLOCK_KEYS = ("_runtime", "_timestamp", "_wandb")


def is_clock(key: str) -> bool:
    """A key whose value is a wall-clock reading (differs between any two runs)."""
    return key.startswith(CLOCK_KEYS) or bool(CLOCK_GROUPS & set(key.split("/")))


def numbers(row: dict) -> dict[str, float]:
    """The row's numeric, non-clock values."""
    return {key: float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not is_clock(key)}


def compare(before: list[dict], after: list[dict], tolerance: float) -> dict:
    """What differs between two histories, row by row."""
    keys_before = set().union(*(numbers(row) for row in before)) if before else set()
    keys_after = set().union(*(numbers(row) for row in after)) if after else set()
    differing_rows, differing_keys, largest = 0, set(), 0.0
    for old, new in zip(before, after, strict=False):
        old, new = numbers(old), numbers(new)
        bad = {key for key in old.keys() & new.keys()
               if not (old[key] == new[key] or (math.isnan(old[key]) and math.isnan(new[key]))
                       or abs(old[key] - new[key]) <= tolerance)}
        bad |= old.keys() ^ new.keys()
        if bad:
            differing_rows += 1
            differing_keys |= bad
            largest = max([largest, *(abs(old[key] - new[key]) for key in bad if key in old and key in new)])
    return {"rows": (len(before), len(after)), "shared": len(keys_before & keys_after),
            "only_before": sorted(keys_before - keys_after), "only_after": sorted(keys_after - keys_before),
            "differing_rows": differing_rows, "differing_keys": sorted(differing_keys), "largest": largest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path, help="a run folder (or its wandb/ folder, or a .wandb file)")
    parser.add_argument("after", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.0, help="largest absolute difference taken as equal")
    args = parser.parse_args(argv)
    result = compare(read_history(args.before), read_history(args.after),
                     args.tolerance)
    same = (result["rows"][0] == result["rows"][1] and not result["differing_rows"]
            and not result["only_before"] and not result["only_after"])
    print(f"| {args.before} | {args.after} | rows {result['rows'][0]} / {result['rows'][1]} | keys {result['shared']} "
          f"| differing rows {result['differing_rows']} | largest difference {result['largest']:.3g} "
          f"| {'identical' if same else 'DIFFERENT'} |")
    for label in ("only_before", "only_after", "differing_keys"):
        if result[label]:
            print(f"  {label}: {', '.join(result[label][:20])}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
