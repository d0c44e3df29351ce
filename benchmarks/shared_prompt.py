"""A group's prompt encoded once (``share_prompt``) against every row encoding it, in one GRPO fit in one process:
the iterations alternate sharing on and off (the same module, weights and sampler; only the passes after sampling
differ), so both see the same machine load. From the repository::

    python benchmarks/shared_prompt.py                       # small preset, prompt 256, k 8, response 32
    python benchmarks/shared_prompt.py --preset gpt2 --lengths long-tail
    python benchmarks/shared_prompt.py --algorithm ppo       # PPO: k responses per prompt, the critic's passes too
    python benchmarks/shared_prompt.py --dry-run             # does it run?

Prints the median seconds per iteration and per phase (sampling, reference pass, update) with sharing on and off,
then one JSON line with ``ratio`` = on / off of the whole iteration and ``ratio_after_sampling`` = on / off of the
iteration less its sampling (what sharing can change). The GRPO settings are ``grpo_vs_trl.py``'s (``bench_ours.
grpo_module``, KL coefficient ``--beta``, so the reference pass runs); PPO's are ``ppo_vs_trl.py``'s
(``bench_ours.ppo_module``: a reward adapter, the critic, ``--group-size`` responses per prompt).

Sharing off is the path of every pass before ``share_prompt`` existed, so ``ratio`` is the iteration against that
path. Both halves keep what else the update does today (micro-batches cut to their rows; with one micro-batch per
step, none here, the cut changes nothing; PPO's old log-probs from its first update pass where it makes one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_ours  # noqa: E402
from harness.arguments import (  # noqa: E402
    DRY_RUN,
    add_common_arguments,
    add_dry_run_argument,
    add_workload_arguments,
    common_settings,
    parse_with_dry_run,
)
from harness.fixtures import prepare_workdir  # noqa: E402
from harness.settings import GRPOSettings  # noqa: E402
from harness.sides import configure_threads  # noqa: E402

SAMPLING = "rollout/generate"  # the phase sharing leaves alone
# the dry run: two iterations (one shared, one not) at the tiny preset
DRY = {**DRY_RUN, "iterations": 2, "prompt_length": 16, "response_length": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, iterations=4, unit="iterations")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO's KL coefficient (> 0: a reference pass)")
    parser.add_argument("--algorithm", choices=("grpo", "ppo"), default="grpo")
    add_workload_arguments(parser)
    add_dry_run_argument(parser, DRY)
    return parse_with_dry_run(parser, argv, DRY)


def alternating(module) -> None:
    """Sharing on in even iterations, off in odd ones (set on the base before each iteration's first pass)."""
    training_step = module.training_step

    def step(batch, batch_idx):
        module.model.share_prompt = batch_idx % 2 == 0
        return training_step(batch, batch_idx)

    module.training_step = step


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds of the whole iteration, of each phase and of the iteration less its sampling."""
    phases = sorted({name for row in rows for name in row["phases"]})
    result = {"iteration": statistics.median(row["seconds"] for row in rows)}
    result.update({name: statistics.median(row["phases"].get(name, 0.0) for row in rows) for name in phases})
    result["after_sampling"] = statistics.median(row["seconds"] - row["phases"].get(SAMPLING, 0.0) for row in rows)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = GRPOSettings(
        **common_settings(args, "shared-prompt"), prompts=args.prompts, prompt_length=args.prompt_length,
        response_length=args.response_length, ppo_epochs=args.epochs, num_minibatches=args.minibatches,
        group_size=args.group_size, beta=args.beta)
    settings.iterations += settings.iterations % 2  # as many on as off
    settings.warmup += settings.warmup % 2  # the first measured iteration shares
    print(f"workdir {settings.workdir}; settings {settings.to_json()}", flush=True)
    ppo = args.algorithm == "ppo"
    prepare_workdir(settings, reward_adapter=ppo)
    configure_threads(settings)
    _, engine = bench_ours.planned_stops(settings)
    module = (bench_ours.ppo_module(settings, settings.group_size, **engine) if ppo
              else bench_ours.grpo_module(settings, settings.beta, **engine))
    alternating(module)
    rows = bench_ours.fit(module, settings, False, module.metric_prefix)
    on, off = medians(rows[0::2]), medians(rows[1::2])
    print(f"{'median seconds':<24}{'shared':>10}{'per row':>10}{'on/off':>9}")
    for name in on:
        ratio = on[name] / off[name] if off[name] else float("nan")
        print(f"{name:<24}{on[name]:>10.3f}{off[name]:>10.3f}{ratio:>9.2f}")
    print(json.dumps({"algorithm": args.algorithm, "ratio": on["iteration"] / off["iteration"],
                      "ratio_after_sampling": on["after_sampling"] / off["after_sampling"],
                      "shared": on, "per_row": off, "iterations_each": len(rows) // 2,
                      "settings": json.loads(settings.to_json())}))


if __name__ == "__main__":
    main()
