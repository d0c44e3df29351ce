"""PPO side by side: rlhf_lightning against TRL 1.12.0's PPOTrainer (as shipped, and with LoRA) and against the
floor (the bare pieces no framework can avoid), on the same random GPT-2-shaped model, prompts and settings.

    pip install -e '.[bench]'
    python benchmarks/ppo_vs_trl.py --preset small
    python benchmarks/ppo_vs_trl.py --preset gpt2 --iterations 2 --repeats 2 --profile
    python benchmarks/ppo_vs_trl.py --dry-run --sides ours,floor   # does it run? every piece at a tiny shape

Every side runs in its own fresh process, alternating (ours, TRL, TRL+LoRA, floor pieces) x ``--repeats``, each
after ``--warmup`` iterations. Reported per side: median seconds per PPO iteration (rollout + update), its split,
generated tokens per second, peak resident memory (and the size of one copy of the weights beside it). The last
line printed is one JSON object with the ratios (ours / theirs, ours / floor) and the settings.

``--lengths equal`` (the default) disables the stop token on every side so all responses are ``--response-length``
long; ``task`` and ``long-tail`` turn it on and force each row's EOS where a seeded plan puts it, the same on every
side (``harness/lengths.py``); ``--workload chat256``/``chat512`` sets chat-like prompt and response lengths.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from harness.arguments import DRY_RUN as COMMON_DRY_RUN
from harness.arguments import (
    add_common_arguments,
    add_dry_run_argument,
    add_workload_arguments,
    common_settings,
    parse_with_dry_run,
    side_order,
)
from harness.fixtures import prepare_workdir
from harness.flops import iteration_flops, matmul_flops_per_second
from harness.lengths import lengths_summary, print_flops_caveat, print_lengths, same_lengths
from harness.measure import GIB, peak_memory_key, weights_bytes
from harness.processes import run_rounds
from harness.settings import Settings
from harness.sides import configure_threads
from harness.tables import print_iteration_table, print_phases, summarise

SIDES = ("ours", "trl", "trl_lora")
DRY_RUN = {**COMMON_DRY_RUN, "prompts": 2, "prompt_length": 4, "response_length": 4, "ppo_epochs": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--dry-run``: the tiny sizes of ``DRY_RUN`` where not given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, iterations=2, unit="iterations", precisions=("32", "bf16-mixed", "bf16-true"))
    parser.add_argument("--prompts", type=int, default=16, help="prompts per PPO iteration")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--sides", default="ours,trl,trl_lora,floor", help="comma-separated subset to run")
    parser.add_argument("--ppo-options", default="{}",
                        help="JSON of extra rlhf_lightning.PPO arguments for our side, e.g. "
                             "'{\"logprob_chunk\": 16}'")
    add_workload_arguments(parser)
    add_dry_run_argument(parser, DRY_RUN)
    return parse_with_dry_run(parser, argv, DRY_RUN)


def child_main(side: str, settings: Settings, profile: bool) -> None:
    """Measure ``side`` in this process (a child of :func:`main`)."""
    if side == "ours":
        import bench_ours

        bench_ours.run(settings, profile)
    elif side in ("trl", "trl_lora"):
        import bench_trl

        bench_trl.run(settings, lora=side == "trl_lora")
    else:
        import bench_floor

        bench_floor.run(settings, side)


def print_flops(ours: dict[str, Any], flops: dict[str, float], matmul: float) -> None:
    """Our iteration's analytic FLOPs by pass, the machine's matmul throughput and the fraction of it we reach."""
    print(f"\nanalytic FLOPs per iteration: {flops['total'] / 1e12:.2f} TFLOP "
          f"(generate {flops['rollout/generate'] / 1e9:.0f} G, scoring "
          f"{sum(v for k, v in flops.items() if k.startswith('rollout/') and k != 'rollout/generate') / 1e9:.0f} G, "
          f"update {sum(v for k, v in flops.items() if k.startswith('update/')) / 1e9:.0f} G)")
    print(f"measured matmul throughput: {matmul / 1e9:.1f} GFLOP/s; achieved: "
          f"{flops['total'] / ours['seconds'] / 1e9:.1f} GFLOP/s = {flops['total'] / ours['seconds'] / matmul:.1%}")


def main(argv: list[str] | None = None) -> None:
    """Prepare the model folder, run the rounds, print the tables and the JSON line (or, as a child, one side)."""
    args = parse_args(argv)
    if args.child:
        child_main(args.child, Settings.from_json(args.settings), bool(args.profile))
        return
    settings = Settings(
        **common_settings(args, "ppo"), prompts=args.prompts, prompt_length=args.prompt_length,
        response_length=args.response_length, ppo_epochs=args.ppo_epochs, num_minibatches=args.minibatches,
        ppo_options=json.loads(args.ppo_options),
    )
    import bench_floor

    order = side_order(args.sides, SIDES, bench_floor.PIECES)
    print(f"workdir {settings.workdir}; settings {settings.to_json()}", flush=True)
    prepare_workdir(settings)
    weights = weights_bytes(settings)
    configure_threads(settings)  # the children's thread count, so the matmul peak is theirs
    matmul = matmul_flops_per_second(args.device, quick=args.dry_run)
    summary = summarise(run_rounds(__file__, order, settings, args.profile))
    print_lengths(summary, settings)
    lengths = {"response_lengths": lengths_summary(summary), "same_lengths": same_lengths(summary, settings)}
    memory_key = peak_memory_key(args.device)
    summary, floors = bench_floor.split(summary, {"floor": bench_floor.PIECES}, memory_key)
    flops = iteration_flops(settings)
    print_iteration_table(summary, SIDES, floors, weights, memory_key)
    if "ours" in summary:
        print_phases("where our iteration goes (median seconds per piece)", summary["ours"],
                     "other (GAE, losses, clipping, loop)")
        print_flops(summary["ours"], flops, matmul)
        print_flops_caveat(settings)
    print(json.dumps(final_json(summary, floors["floor"], settings, weights, flops, matmul, args.device) | lengths))


def final_json(summary, floor, settings: Settings, weights: int, flops, matmul: float, device: str) -> dict:
    """The last line printed: the ratios (ours / theirs, ours / the floor), seconds, memory and the settings."""
    memory_key = "peak_cuda" if device.startswith("cuda") else "peak_rss"

    def ratio(ours_key: str, other: dict | None, other_key: str) -> float | None:
        if "ours" not in summary or not other:
            return None
        return round(summary["ours"][ours_key] / other[other_key], 3)

    ours = summary.get("ours", {})
    return {
        "time_ratio": ratio("seconds", summary.get("trl"), "seconds"),
        "memory_ratio": ratio(memory_key, summary.get("trl"), memory_key),
        "time_ratio_lora": ratio("seconds", summary.get("trl_lora"), "seconds"),
        "memory_ratio_lora": ratio(memory_key, summary.get("trl_lora"), memory_key),
        "floor_time_ratio": ratio("seconds", floor, "seconds"),
        "floor_memory_ratio": ratio(memory_key, floor, "peak"),
        "seconds": {side: round(s["seconds"], 3) for side, s in summary.items()} | (
            {"floor": round(floor["seconds"], 3)} if floor else {}),
        "peak_gib": {side: round(s[memory_key] / GIB, 3) for side, s in summary.items()} | (
            {"floor": round(floor["peak"] / GIB, 3)} if floor else {}),
        "weights_gib": round(weights / GIB, 3),
        "ours_tokens_per_second": round(ours["tokens_per_second"], 1) if ours else None,
        "flops_per_iteration": flops["total"],
        "matmul_flops_per_second": matmul,
        "achieved_fraction": round(flops["total"] / ours["seconds"] / matmul, 3) if ours else None,
        "settings": {k: v for k, v in json.loads(settings.to_json()).items() if k != "workdir"},
    }


if __name__ == "__main__":
    main()
