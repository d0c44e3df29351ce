"""Placement: one GRPO iteration with vLLM in the training process on every core, against vLLM's own server on some
cores and the trainer on the others: the same model, prompts, seeds and update, each placement in fresh processes.

    python benchmarks/placement.py                              # a Llama shape of 4 layers x 256 on this machine
    python benchmarks/placement.py --server-cores 0 --trainer-cores 1 --prompts 4 --group-size 8
    python benchmarks/placement.py --dry-run                    # tiny and quick: the command works

Placements (``--placements``, each a side of :func:`harness.processes.run_rounds`, rounds alternating):

- ``in_process``: ``VLLMEngine``, vLLM in the trainer's process, on every core the machine gives the process;
- ``server``: ``VLLMServer``, a server the fit starts bound to ``--server-cores``, the trainer bound to
  ``--trainer-cores`` with as many torch threads: a disaggregated placement on one machine;
- ``eager``: our own decoder in the trainer's process (no vLLM), for reference.

Printed: seconds per iteration (median over the measured iterations, after the warm-up that builds vLLM or starts
the server), the rollout's seconds, and each placement's ratio to ``in_process``. Needs vLLM (the README's vLLM
environment: ``.venv-vllm/bin/python benchmarks/placement.py``). On a GPU machine the same command takes ``--device
cuda`` (the server then runs on the GPUs it sees: ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fixtures import prepare_workdir  # noqa: E402
from harness.processes import report, run_rounds  # noqa: E402
from harness.settings import GRPOSettings, llama_shape  # noqa: E402

PLACEMENTS = ("in_process", "server", "eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="heads of 64 dimensions (vLLM's CPU kernels')")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations, after one warm-up")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every placement")
    parser.add_argument("--server-cores", default="0", help="the server's cores (placement server)")
    parser.add_argument("--trainer-cores", default="1", help="the trainer's cores (placement server)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default="", help="the model's folder (default: a temporary one)")
    parser.add_argument("--dry-run", action="store_true", help="2 layers x 64, 2 prompts x 2, 8 tokens")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if unknown := set(args.placements.split(",")) - set(PLACEMENTS):
        parser.error(f"--placements: unknown {sorted(unknown)}; choose from {','.join(PLACEMENTS)}")
    if args.dry_run:
        args.layers, args.hidden, args.vocab, args.prompts, args.group_size = 2, 64, 512, 2, 2
        args.prompt_length, args.response_length, args.iterations = 8, 8, 1
    return args


def cores(text: str) -> list[int]:
    return [int(core) for core in text.split(",")]


def child_main(placement: str, settings: GRPOSettings, options: dict[str, Any]) -> None:
    """One placement's iterations in this process (a child of :func:`main`)."""
    import bench_ours
    import torch

    from rlhf_lightning.rollout.engines import EagerDecoder

    if placement == "server":
        from rlhf_lightning.rollout.vllm_server import VLLMServer

        os.sched_setaffinity(0, cores(options["trainer_cores"]))
        torch.set_num_threads(len(cores(options["trainer_cores"])))
        engine = VLLMServer(kv_cache_gib=options["kv_cache_gib"], cpus=cores(options["server_cores"]))
    elif placement == "in_process":
        from rlhf_lightning.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(kv_cache_gib=options["kv_cache_gib"])
    else:
        engine = EagerDecoder()
    torch.manual_seed(settings.seed)
    module = bench_ours.grpo_module(settings, settings.beta, engine=engine)
    rows = bench_ours.fit(module, settings, False, "grpo",
                          default_root_dir=str(Path(settings.workdir) / "runs" / placement))
    report({"side": placement, "iterations": rows})


OPTIONS = "RLHF_LIGHTNING_PLACEMENT"  # the environment variable that hands the placement options to the children


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, GRPOSettings.from_json(args.settings), json.loads(os.environ[OPTIONS]))
        return {}
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="placement-")
    shape = llama_shape(args.layers, args.hidden, vocab=args.vocab)
    settings = GRPOSettings(llama=shape, prompts=args.prompts, group_size=args.group_size,
                            prompt_length=args.prompt_length, response_length=args.response_length, ppo_epochs=1,
                            iterations=args.iterations, warmup=1, repeats=args.repeats, device=args.device,
                            workdir=workdir, lora_r=8, lora_alpha=16.0)
    print(f"workdir {workdir}; Llama {args.layers} x {args.hidden}, {args.prompts} prompts x {args.group_size}, "
          f"prompt {args.prompt_length}, response {args.response_length}; {os.cpu_count()} cores; server cores "
          f"{args.server_cores}, trainer cores {args.trainer_cores}", flush=True)
    prepare_workdir(settings, reward_adapter=False)
    os.environ[OPTIONS] = json.dumps({key: getattr(args, key)
                                      for key in ("server_cores", "trainer_cores", "kv_cache_gib")})
    results = run_rounds(__file__, args.placements.split(","), settings, None)
    summary = {}
    for placement, runs in results.items():
        iterations = [row for run in runs for row in run["iterations"]]
        summary[placement] = {"seconds": statistics.median(row["seconds"] for row in iterations),
                              "rollout": statistics.median(row.get("rollout", 0.0) for row in iterations)}
    reference = summary.get("in_process", next(iter(summary.values())))
    print(f"{'placement':<11} {'s/iter':>7} {'rollout s':>9} {'ratio':>6}")
    for placement, figures in summary.items():
        figures["ratio"] = figures["seconds"] / reference["seconds"]
        print(f"{placement:<11} {figures['seconds']:7.2f} {figures['rollout']:9.2f} {figures['ratio']:6.2f}")
    result = {"settings": vars(args) | {"workdir": workdir}, "placements": summary}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
