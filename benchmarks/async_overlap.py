"""Asynchronous overlap: GRPO's iterations per hour at ``asynchronous.max_staleness`` S = 0 (synchronous), 1 and 2,
on vLLM's own server bound to some cores and the trainer to the others, on two workloads; the same model, prompts,
seeds and update for every S, each S in fresh processes.

    python benchmarks/async_overlap.py                          # both workloads, S = 0,1,2; server core 0, trainer 1
    python benchmarks/async_overlap.py --workloads balanced --staleness 0,1 --repeats 3 --iterations 8
    python benchmarks/async_overlap.py --balanced group=8,response=64,epochs=3   # rebalance workload (a)
    python benchmarks/async_overlap.py --dry-run                # tiny and quick: the command works

Workloads (``--workloads``; each ``group=G,response=R,epochs=E``: G responses per prompt, R new tokens each, E
passes of the update over the rollout; ``--prompts`` prompts of ``--prompt-length`` tokens per iteration):

- ``balanced`` (a), ``--balanced``, default ``group=8,response=64,epochs=2``: generation on the server and the rest
  of the iteration on the trainer (the log-probs, the two update passes, the adapter pushes) take comparable time
  (at S = 0 on this 2-core machine, the default Llama shape of 4 layers x 256: generation 2.8 s and the rest 2.5 s
  with one other job running, 5.1 s of 8.1 s under a heavier one); the overlap's ceiling is about 2x;
- ``generation`` (b), ``--generation``, default ``group=16,response=128,epochs=1``: generation dominates (twice the
  samples, twice the tokens, one update pass; 8 s of 13 s at S = 0 here under load): the trainer waits for the
  server whatever S is, and the overlap can only hide the shorter rest.

Each S is a side of :func:`harness.processes.run_rounds` (``balanced/S0``, ``balanced/S1``, ...), rounds alternating
(``--repeats``), every side a fresh process whose fit starts its own server (``VLLMServer`` with ``cpus:
--server-cores``; on CPU with ``--no-enable-chunked-prefill``, see ``CPU_SERVER_ARGS``), the trainer bound to
``--trainer-cores`` with as many torch threads. Steady state only: a side at S runs ``1 + S`` warm-up iterations
before its ``--iterations`` measured ones, and the warm-up is excluded: the first iteration starts the server and
draws the first rollout while the trainer waits, and the next S finish filling the pipeline (the rollouts of
iterations 2..S+1 were all drawn by the starting policy, submitted at once). An iteration's seconds run from the end
of the one before to its own end (everything the loop does counts); the producer draws ahead past the last measured
iteration, so the server is as busy at the end as in the middle.

Printed, per workload and S: iterations per hour (3600 x measured iterations / their seconds in each process, the
median over the rounds), its ratio to S = 0, the median seconds per iteration, the mean per iteration of
``time/rollout_wait`` (seconds the trainer waited for the producer; S = 0 has none: the trainer draws itself), of the
trainer's share of generation (the ``rollout/generate`` phase: the whole draw at S = 0, submitting and waiting at
S > 0), of ``time/update``, and ``rollout/staleness_mean`` (checked: S at every measured iteration). Under each
workload: the overlap's ceiling from S = 0's split, ``s/iter / max(generation, rest)``. Needs vLLM (the README's vLLM
environment: ``.venv-vllm/bin/python benchmarks/async_overlap.py``). The default run is 12 processes (2 workloads x 3
S x 2 rounds), each starting a server; ``--repeats 3`` (18 processes) took 26 minutes on the 2 quiet cores of the
CPU VM, and 36 for 12 processes with another job's vLLM server bound to the same core 0 (load average 9 to 28),
where a server sharing its core with another stalls for tens of seconds: the per-process lines printed as they end
(each iteration's seconds and wait) show such stalls.

On a GPU machine (not run here): with two GPUs, the server on one and the trainer on the other (physical ids, as
``CUDA_VISIBLE_DEVICES`` names them; the cores are left unbound on CUDA unless given), at a shape where a GPU has
work, rebalancing workload (a) from S = 0's ``generate s`` and ``update s`` columns::

    python benchmarks/async_overlap.py --device cuda --server-gpu 0 --trainer-gpu 1 --layers 16 --hidden 1024 \\
        --vocab 32000 --prompts 16 --prompt-length 128 --kv-cache-gib 8 --balanced group=8,response=256,epochs=2 \\
        --generation group=16,response=1024,epochs=1

and with one GPU, colocated (the server shares the trainer's GPU; cap its memory):

    python benchmarks/async_overlap.py --device cuda --layers 16 --hidden 1024 --vocab 32000 --prompts 16 \\
        --prompt-length 128 --kv-cache-gib 8 --server-args="--gpu-memory-utilization 0.3"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.fixtures import prepare_workdir, prompt_ids  # noqa: E402
from harness.processes import report, run_rounds  # noqa: E402
from harness.settings import GRPOSettings, llama_shape  # noqa: E402

WORKLOADS = {"balanced": "group=8,response=64,epochs=2", "generation": "group=16,response=128,epochs=1"}
WORKLOAD_FIELDS = {"group": "group_size", "response": "response_length", "epochs": "ppo_epochs"}
PREFIX = "grpo"
# What each iteration logs that the table reads (the module's metrics, under PREFIX/).
METRICS = ("time/rollout_wait", "time/rollout", "time/update", "time/iteration", "rollout/staleness_mean")
# vLLM 0.32's CPU build stops its engine ("CPU Generator does not use offset") when it splits a seeded request's
# prefill over two steps, which it does once a rollout's prompt tokens pass max_num_batched_tokens (2048 here: 4
# prompts x 16 responses x 64 tokens do): the whole prefill in one step, as the GPU build does without that fault.
CPU_SERVER_ARGS = "--no-enable-chunked-prefill"
TARGET = 1.3  # the target: S = 1 at 1.3x the iterations per hour of S = 0 on the balanced workload


def workload(text: str) -> dict[str, int]:
    """``group=8,response=64,epochs=2`` as GRPOSettings fields."""
    fields = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in WORKLOAD_FIELDS or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: give group=N,response=N,epochs=N (positive integers)")
        fields[WORKLOAD_FIELDS[key]] = int(value)
    if len(fields) != len(WORKLOAD_FIELDS):
        raise argparse.ArgumentTypeError(f"{text!r}: give all of group=N,response=N,epochs=N")
    return fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="heads of 64 dimensions (vLLM's CPU kernels')")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--workloads", default=None, help=f"default {','.join(WORKLOADS)} (--dry-run: balanced)")
    parser.add_argument("--balanced", type=workload, default=WORKLOADS["balanced"], help="workload (a)")
    parser.add_argument("--generation", type=workload, default=WORKLOADS["generation"], help="workload (b)")
    parser.add_argument("--staleness", default="0,1,2", help="the asynchronous.max_staleness values; 0 is the reference")
    parser.add_argument("--iterations", type=int, default=4, help="measured iterations, after 1 + S warm-up ones")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every side")
    parser.add_argument("--server-cores", default=None, help="the server's cores (default: 0 on CPU, unbound on CUDA)")
    parser.add_argument("--trainer-cores", default=None, help="the trainer's cores (default: 1 on CPU, unbound on "
                        "CUDA)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--server-args", default=None, help=f"further arguments of the server, one string (default: "
                        f"{CPU_SERVER_ARGS!r} on CPU, none on CUDA)")
    parser.add_argument("--server-gpu", default="", help="CUDA: the server's GPU, with --trainer-gpu (else colocated)")
    parser.add_argument("--trainer-gpu", default="", help="CUDA: the trainer's GPU, with --server-gpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", default="", help="the model's folder (default: a temporary one)")
    parser.add_argument("--dry-run", action="store_true", help="2 layers x 64, 2 prompts x 2, 8 tokens, S = 0,1, "
                        "one round of one measured iteration")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workloads = args.workloads or ("balanced" if args.dry_run else ",".join(WORKLOADS))
    if unknown := set(args.workloads.split(",")) - set(WORKLOADS):
        parser.error(f"--workloads: unknown {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    try:
        args.staleness_values = sorted({int(value) for value in args.staleness.split(",")})
    except ValueError:
        parser.error(f"--staleness: integers separated by commas, not {args.staleness!r}")
    if args.staleness_values[0] != 0 or len(args.staleness_values) < 2:
        parser.error("--staleness: 0 (the synchronous reference) and at least one S > 0")
    if bool(args.server_gpu) != bool(args.trainer_gpu) or (args.server_gpu and args.server_gpu == args.trainer_gpu):
        parser.error("--server-gpu and --trainer-gpu: two different GPUs, or neither (colocated)")
    on_cpu = not args.device.startswith("cuda")
    args.server_cores = args.server_cores if args.server_cores is not None else ("0" if on_cpu else "")
    args.trainer_cores = args.trainer_cores if args.trainer_cores is not None else ("1" if on_cpu else "")
    args.server_args = args.server_args if args.server_args is not None else (CPU_SERVER_ARGS if on_cpu else "")
    if args.dry_run:
        args.layers, args.hidden, args.vocab, args.prompts, args.prompt_length = 2, 64, 512, 2, 8
        args.balanced = {"group_size": 2, "response_length": 8, "ppo_epochs": 1}
        args.generation = {"group_size": 2, "response_length": 8, "ppo_epochs": 1}
        args.staleness_values, args.iterations, args.repeats = [0, 1], 1, 1
    return args


def cores(text: str) -> list[int]:
    return [int(core) for core in text.split(",") if core != ""]


def prompt_loader(settings: GRPOSettings, tokenizer):
    """The benchmark's prompts in the loader an asynchronous run needs (one that hands out its next batches ahead,
    ``ResumableLoader``, given to the trainer as the data module's is: ``{"prompts": loader}``), in order, each batch
    numbered by its rows (``index``: the rollout drawn ahead is checked to answer the rows the loader hands out)."""
    import torch

    from rlhf_lightning.data.loader import ResumableLoader

    count = settings.warmup + settings.iterations
    ids = prompt_ids(settings, settings.prompts * count)
    texts = tokenizer.batch_decode(ids)

    def collate(rows: list[int]) -> dict[str, Any]:
        index = torch.tensor(rows)
        return {"input_ids": ids[index], "attention_mask": torch.ones_like(ids[index]),
                "prompt": [texts[i] for i in rows], "index": index}

    return ResumableLoader(list(range(len(ids))), settings.prompts, collate, shuffle=False, limit=count)


def fit(module, settings: GRPOSettings, device_index: int, root: Path) -> list[dict[str, Any]]:
    """Train ``module`` for ``warmup + iterations`` iterations under a real ``lightning.Trainer`` (as
    ``bench_ours.fit``, on the loader of :func:`prompt_loader`) and return the measured iterations: their seconds
    and phases (``bench_ours.make_callback``) and the :data:`METRICS` each logged. ``root``: the run folder (the
    server's adapters and log, under ``engine-adapters``)."""
    import bench_ours
    import lightning as L
    from harness.measure import Stopwatch

    watch = Stopwatch(settings.device)
    timer = bench_ours.make_callback(watch, settings, False, PREFIX)

    class Metrics(L.Callback):
        """The iteration's logged :data:`METRICS`, read as the iteration ends."""

        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            logged = trainer.callback_metrics
            self.rows.append({name: float(logged[f"{PREFIX}/{name}"]) for name in METRICS
                              if f"{PREFIX}/{name}" in logged})

    metrics = Metrics()
    trainer = L.Trainer(
        accelerator="gpu" if settings.device.startswith("cuda") else "cpu",
        devices=[device_index] if settings.device.startswith("cuda") else 1,
        precision=settings.precision, max_epochs=1, limit_train_batches=settings.warmup + settings.iterations,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, metrics], default_root_dir=str(root),
    )
    with watch.recording_phases():
        trainer.fit(module, train_dataloaders={"prompts": prompt_loader(settings, module.tokenizer)})
    rows = [{**timed, **logged} for timed, logged in zip(timer.rows, metrics.rows, strict=True)]
    return rows[settings.warmup:]


def child_main(side: str, settings: GRPOSettings, options: dict[str, Any]) -> None:
    """One side's iterations in this process (a child of :func:`main`)."""
    import bench_ours
    import torch

    from rlhf_lightning.rollout.vllm_server import VLLMServer

    if trainer_cores := cores(options["trainer_cores"]):
        os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(len(trainer_cores))
    engine = VLLMServer(kv_cache_gib=options["kv_cache_gib"], cpus=cores(options["server_cores"]) or None,
                        server_args=shlex.split(options["server_args"]))
    torch.manual_seed(settings.seed)
    module = bench_ours.grpo_module(settings, settings.beta, engine=engine)
    # Two GPUs: the children see "server,trainer" (main): the server takes the first, the trainer the second.
    rows = fit(module, settings, 1 if options["server_gpu"] else 0,
               Path(settings.workdir) / "runs" / side.replace("/", "_"))
    report({"side": side, "iterations": rows})


OPTIONS = "RLHF_LIGHTNING_ASYNC_OVERLAP"  # the environment variable that hands the options to the children


def side_settings(base: GRPOSettings, args: argparse.Namespace, side: str) -> GRPOSettings:
    """The settings of side ``workload/S<s>``: the workload's shape, ``asynchronous.max_staleness`` s, ``1 + s``
    warm-up iterations."""
    name, staleness = side.split("/S")
    return dataclasses.replace(base, **getattr(args, name), warmup=1 + int(staleness),
                               ppo_options={"asynchronous": {"max_staleness": int(staleness)}})


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over its rounds (see the module docstring)."""
    iterations = [row for run in runs for row in run["iterations"]]

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    per_round = [3600 * len(run["iterations"]) / sum(row["seconds"] for row in run["iterations"]) for run in runs]
    return {"iterations_per_hour": statistics.median(per_round), "iterations_per_hour_rounds": per_round,
            "seconds": statistics.median(row["seconds"] for row in iterations),
            "rollout_wait": mean([row["time/rollout_wait"] for row in iterations if "time/rollout_wait" in row]),
            "generate": mean([row["phases"].get("rollout/generate", 0.0) for row in iterations]),
            "update": mean([row["time/update"] for row in iterations]),
            "staleness": mean([row.get("rollout/staleness_mean", 0.0) for row in iterations])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, GRPOSettings.from_json(args.settings), json.loads(os.environ[OPTIONS]))
        return {}
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="async-overlap-")
    shape = llama_shape(args.layers, args.hidden, vocab=args.vocab)
    base = GRPOSettings(llama=shape, prompts=args.prompts, prompt_length=args.prompt_length,
                        iterations=args.iterations, repeats=args.repeats, device=args.device, workdir=workdir,
                        lora_r=8, lora_alpha=16.0)
    workloads = args.workloads.split(",")
    order = [f"{name}/S{staleness}" for name in workloads for staleness in args.staleness_values]
    placement = (f"server GPU {args.server_gpu}, trainer GPU {args.trainer_gpu}" if args.server_gpu else
                 f"server cores {args.server_cores or 'unbound'}, trainer cores {args.trainer_cores or 'unbound'}")
    print(f"workdir {workdir}; Llama {args.layers} x {args.hidden}, {args.prompts} prompts of {args.prompt_length} "
          f"tokens; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {args.device}, {placement}", flush=True)
    for name in workloads:
        fields = getattr(args, name)
        print(f"  {name}: {fields['group_size']} responses per prompt of {fields['response_length']} tokens, "
              f"{fields['ppo_epochs']} update pass(es); S = {args.staleness_values}, 1 + S warm-up + "
              f"{args.iterations} measured iterations per process, {args.repeats} round(s)", flush=True)
    prepare_workdir(base, reward_adapter=False)
    os.environ[OPTIONS] = json.dumps({key: getattr(args, key) for key in
                                      ("server_cores", "trainer_cores", "kv_cache_gib", "server_args", "server_gpu")})
    if args.server_gpu:  # the children's GPUs: the server's first (vLLM takes the first it sees), the trainer's
        os.environ["CUDA_VISIBLE_DEVICES"] = f"{args.server_gpu},{args.trainer_gpu}"

    def staleness_checked(side: str, result: dict[str, Any]) -> str:
        expected = float(side.split("/S")[1])
        ages = [row.get("rollout/staleness_mean", 0.0) for row in result["iterations"]]
        if any(age != expected for age in ages):
            raise RuntimeError(f"{side}: the measured iterations trained on rollouts {ages} iterations old, not "
                               f"{expected:g}: the overlap is not in its steady state")
        waits = [f"{row['time/rollout_wait']:.2f}" for row in result["iterations"] if "time/rollout_wait" in row]
        return f" wait {waits}" if waits else ""

    results = run_rounds(__file__, order, base, None, lambda side: side_settings(base, args, side),
                         details=staleness_checked)
    summary: dict[str, dict[str, Any]] = {}
    print(f"{'workload':<11} {'S':>2} {'iter/h':>7} {'ratio':>6} {'s/iter':>7} {'wait s':>7} {'generate s':>10} "
          f"{'update s':>8} {'staleness':>9}")
    for name in workloads:
        sides = {staleness: summarise(results[f"{name}/S{staleness}"]) for staleness in args.staleness_values}
        reference = sides[0]
        for staleness, figures in sides.items():
            figures["ratio"] = figures["iterations_per_hour"] / reference["iterations_per_hour"]
            wait = "-" if figures["rollout_wait"] is None else f"{figures['rollout_wait']:.2f}"
            print(f"{name:<11} {staleness:>2} {figures['iterations_per_hour']:7.0f} {figures['ratio']:6.2f} "
                  f"{figures['seconds']:7.2f} {wait:>7} {figures['generate']:10.2f} {figures['update']:8.2f} "
                  f"{figures['staleness']:9.2f}")
        seconds = 3600 / reference["iterations_per_hour"]
        ceiling = seconds / max(reference["generate"], seconds - reference["generate"])
        losses = [f"S = {staleness} ({figures['ratio']:.2f}x)" for staleness, figures in sides.items()
                  if figures["ratio"] < 1]
        print(f"  {name}: at S = 0, generation {reference['generate']:.2f} s of {seconds:.2f} s per iteration; "
              f"the overlap's ceiling {ceiling:.2f}x; slower than S = 0: {', '.join(losses) or 'none'}", flush=True)
        summary[name] = {"ceiling": ceiling,
                         "sides": {f"S{staleness}": figures for staleness, figures in sides.items()}}
    if "balanced" in summary and "S1" in summary["balanced"]["sides"]:
        ratio = summary["balanced"]["sides"]["S1"]["ratio"]
        print(f"target: S = 1 at >= {TARGET}x the iterations per hour of S = 0 on the balanced workload: "
              f"{ratio:.2f}x, {'met' if ratio >= TARGET else 'NOT met'}")
    result = {"settings": vars(args) | {"workdir": workdir},
              "load_average": os.getloadavg()[0], "workloads": summary}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
