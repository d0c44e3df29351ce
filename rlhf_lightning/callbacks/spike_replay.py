"""The spike check replayed over runs' logged histories: the lines :class:`~rlhf_lightning.callbacks.SpikeCheck`
would have warned, with its defaults or other settings, without training again (the check is a function of the
logged sequence of each watched metric). The way to choose its settings for a new task: replay healthy runs (want
no line) and one that went wrong (want its line)::

    python -m rlhf_lightning.callbacks.spike_replay outputs/ppo outputs/grpo
    python -m rlhf_lightning.callbacks.spike_replay outputs/ppo --floors '{"policy/approx_kl": 0.1}' --cooldown 10
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_lightning.callbacks.spikes import SpikeCheck


def metric_prefix(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> str | None:
    """The metric prefix (``ppo``) under which the history logs a watched metric; None when it logs none."""
    for row in rows:
        for key in row:
            for metric in metrics:
                if key.endswith(f"/{metric}") and "/val/" not in key:
                    return key[: -len(metric) - 1]
    return None


def replay(rows: Sequence[Mapping[str, Any]], check: SpikeCheck | None = None) -> list[str]:
    """The lines ``check`` (the defaults when None) would have warned over ``rows``, a run's logged history in
    order (:func:`~rlhf_lightning.runs.wandb_offline.read_history`): one training batch per row that logs a
    watched metric, numbered by ``<prefix>/iteration`` where logged."""
    check = check or SpikeCheck()
    prefix = metric_prefix(rows, check.metrics)
    if prefix is None or not check.threshold:
        return []
    lines, at = [], 0
    for row in rows:
        values = {metric: float(row[f"{prefix}/{metric}"]) for metric in check.metrics
                  if isinstance(row.get(f"{prefix}/{metric}"), int | float)}
        if not values:
            continue
        iteration = row.get(f"{prefix}/iteration")
        at = int(iteration) if isinstance(iteration, int | float) else at + 1
        found = check.observe(prefix, at, values)
        if found:
            lines.append(f"warning: {SpikeCheck.message(prefix, 'iteration', found)}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print each run folder's replayed lines and their count; the total last."""
    parser = argparse.ArgumentParser(prog="python -m rlhf_lightning.callbacks.spike_replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (or run-*.wandb files): each one's latest run is read")
    parser.add_argument("--threshold", type=float, default=10.0)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cooldown", type=int, default=20)
    parser.add_argument("--floors", type=json.loads, default=None, help='JSON, e.g. \'{"objective/kl": 5}\'')
    arguments = parser.parse_args(argv)
    from rlhf_lightning.runs.wandb_offline import read_history

    total = 0
    for run in arguments.runs:
        try:
            check = SpikeCheck(arguments.threshold, arguments.window, arguments.warmup, floors=arguments.floors,
                               cooldown=arguments.cooldown)
            lines = replay(read_history(run), check)
        except (OSError, ValueError) as error:
            print(f"error: {run}: {error}", file=sys.stderr)
            return 1
        total += len(lines)
        print(f"{run}: {len(lines)} spike warning{'s' if len(lines) != 1 else ''}")
        for line in lines:
            print(f"  {line}")
    print(f"total: {total} spike warning{'s' if total != 1 else ''} in {len(arguments.runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
