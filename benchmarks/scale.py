"""Scale: PPO and GRPO on a 1.1B-parameter Llama-shaped model on this machine, ours against TRL's stacks.

The model has TinyLlama-1.1B's shape (22 layers, width 2048, SwiGLU 5632, 32 query / 4 key-value heads, 32,000
ids; 1,100,048,384 parameters, 4.1 GiB in fp32) with random weights, built locally from a ``LlamaConfig`` and a
word-level tokenizer of 32,000 ids (``harness.settings.llama_shape``; nothing comes from a hub). The sides, each one
iteration in a fresh process (so its peak resident memory is its own):

- ``ours_ppo``: ``rlhf_lightning.PPO``, four roles on one base (``bench_ours.run``); ``ours_grpo``: our GRPO with
  a LoRA policy and the reference = adapters off (``bench_ours.run_grpo``);
- ``trl_ppo``: TRL 1.12's ``PPOTrainer`` as documented, four models (policy, reference, value, reward), policy and
  value trained in full; ``trl_ppo_lora``: the same with a LoRA policy (no reference copy; the value model is
  still trained in full, as TRL does) (``bench_trl.run``);
- ``trl_grpo_lora``: TRL 1.16's ``GRPOTrainer`` with a LoRA policy, reference = adapters off; ``trl_grpo``: the
  whole model trained, a second copy as the reference at beta > 0 (``bench_trl_grpo.run``).

Nothing is run into the kernel's OOM killer. First every side runs at a few smaller shapes of the same width and
vocabulary (``--fit-layers``, by default 1, 2 and 4 layers of width 2048: 0.17B-0.29B parameters), and its peak is
fitted as ``peak = a + b x parameters``; along the depth of a fixed width every term of the peak (weights, their
gradients and optimizer states, activations, caches) grows linearly in the layer count, so the line extrapolates.
At the target shape a side runs only when its prediction x (1 + ``--margin``) fits in the memory available, and
its predicted process time is within ``--max-seconds``; every child is watched and killed past the available
memory (``harness.processes.run_child(rss_limit=...)``) should a prediction be wrong. Reported per side: predicted
and measured peak, fits (in ``--memory-gib``, by default this machine's total), and the largest model it can run
here: the layer count at width 2048 where the fitted line reaches the memory, and the largest of 22 x 2^k layers
under it (the doubling), with ``--run-largest`` measured where its predicted time allows.

TRL 1.12 (PPO) and TRL 1.16 (GRPO) live in separate virtualenvs, each with this package installed
(``pip install -e '.[bench]'``: trl==1.12.0; ``pip install -e '.[bench-grpo]'``: trl==1.16.*), named by
``--trl112-python`` and ``--trl116-python``; ours runs with the interpreter running this script. From the
repository, on a quiet machine (the numbers are of a process alone on it)::

    venv-trl116/bin/python benchmarks/scale.py --trl112-python venv-trl112/bin/python \\
        --trl116-python venv-trl116/bin/python
    python benchmarks/scale.py --dry-run --sides ours_ppo,ours_grpo   # the whole pipeline at a tiny shape
    python benchmarks/scale.py --shape 4x256 --fit-layers 1,2 --sides ours_ppo,ours_grpo

The rollout: ``--prompts`` responses per iteration on both algorithms (GRPO: ``prompts / group_size`` prompts x
``--group-size``), ``--prompt-length`` prompt tokens, ``--response-length`` tokens sampled (no stop), ``--epochs``
update passes; fp32 weights (``--precision 32``). Peak memory is the child's peak resident set size (``ru_maxrss``),
the weights are one copy of the base in fp32. The last line printed is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.arguments import add_dry_run_argument, parse_with_dry_run, side_order
from harness.fixtures import prepare_workdir
from harness.measure import GIB, meminfo_bytes, weights_bytes
from harness.processes import MemoryLimitExceeded, report, run_child
from harness.settings import TINYLLAMA, GRPOSettings, Settings, llama_parameters, llama_shape
from harness.tables import median

TARGET_RATIO = 2.5  # the target: our PPO iteration's peak <= 2.5 x one copy of the fp32 weights
# side: (algorithm, environment, what it is)
SIDES: dict[str, tuple[str, str, str]] = {
    "ours_ppo": ("ppo", "ours", "rlhf_lightning PPO, four roles on one base"),
    "ours_grpo": ("grpo", "ours", "rlhf_lightning GRPO, LoRA policy, reference = adapters off"),
    "trl_ppo": ("ppo", "trl112", "TRL 1.12 PPO, four models, policy and value trained in full"),
    "trl_ppo_lora": ("ppo", "trl112", "TRL 1.12 PPO, LoRA policy, value trained in full, reward model"),
    "trl_grpo_lora": ("grpo", "trl116", "TRL 1.16 GRPO, LoRA policy, reference = adapters off"),
    "trl_grpo": ("grpo", "trl116", "TRL 1.16 GRPO, whole model trained, reference a second copy"),
}
TRL_VERSIONS = {"trl112": "1.12.", "trl116": "1.16."}
DRY_RUN = {"shape": "16x128", "fit_layers": "2,8", "prompts": 4, "group_size": 2, "prompt_length": 8,
           "response_length": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--dry-run``: the tiny sizes of ``DRY_RUN`` where not given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None,
                        help="the target Llama shape, LAYERSxHIDDEN with TinyLlama's proportions (llama_shape), "
                             "e.g. 4x256; default TinyLlama's 22x2048")
    parser.add_argument("--vocab", type=int, default=TINYLLAMA["vocab_size"], help="vocabulary (tokenizer ids)")
    parser.add_argument("--fit-layers", default="1,2,4",
                        help="layer counts of the smaller shapes (the target's width) every side is measured at")
    add_dry_run_argument(parser, DRY_RUN)
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    parser.add_argument("--prompts", type=int, default=8,
                        help="responses per iteration (PPO: prompts; GRPO: prompts/group-size prompts x group)")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1, help="update passes over each rollout")
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO's KL coefficient (> 0: a reference pass)")
    parser.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    parser.add_argument("--iterations", type=int, default=1, help="measured iterations per process")
    parser.add_argument("--warmup", type=int, default=0, help="unmeasured iterations first, per process")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process; 0 = torch's default")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL GRPO with its default gradient checkpointing (ours has none)")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="the memory a side must fit in (default: this machine's MemTotal)")
    parser.add_argument("--margin", type=float, default=0.15,
                        help="run a side at the target only if prediction x (1 + margin) fits in the memory "
                             "available then")
    parser.add_argument("--headroom-gib", type=float, default=1.0,
                        help="kept free of every child: it is killed past MemAvailable - headroom")
    parser.add_argument("--max-seconds", type=float, default=3600.0,
                        help="do not run a side whose predicted process time exceeds this (report the estimate)")
    parser.add_argument("--no-target", action="store_true", help="fit and predict only; run nothing at the target")
    parser.add_argument("--run-largest", action="store_true",
                        help="also measure each side at its largest doubling of the layers predicted to fit")
    parser.add_argument("--trl112-python", default=sys.executable, help="interpreter with TRL 1.12 (PPO sides)")
    parser.add_argument("--trl116-python", default=sys.executable, help="interpreter with TRL 1.16 (GRPO sides)")
    parser.add_argument("--workdir", default=None, help="folder for the models and logs (default: a temp dir)")
    parser.add_argument("--keep-models", action="store_true", help="keep every shape's model folder")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    return parse_with_dry_run(parser, argv, DRY_RUN)


def parse_shape(text: str | None, vocab: int) -> dict[str, int]:
    """The Llama shape of ``--shape`` (``LAYERSxHIDDEN``; TinyLlama's when None) with ``vocab`` ids."""
    if text is None:
        return dict(TINYLLAMA, vocab_size=vocab)
    layers, _, hidden = text.lower().partition("x")
    return llama_shape(int(layers), int(hidden), vocab)


# ---- the children ---------------------------------------------------------------------------------------


def child_main(side: str, settings_json: str) -> None:
    """Run ``side`` in this process: ``prepare`` writes a shape's model folder, the others measure one side."""
    if side == "prepare":
        settings = Settings.from_json(settings_json)
        prepare_workdir(settings, reward_adapter=True)
        report({"side": side, "iterations": [], "weights": weights_bytes(settings),
                "parameters": llama_parameters(settings.llama)})
        return
    if SIDES[side][0] == "ppo":  # each TRL side checks its TRL version as it loads (load_trl_side)
        settings = Settings.from_json(settings_json)
        if side == "ours_ppo":
            import bench_ours

            bench_ours.run(settings)
        else:
            import bench_trl

            bench_trl.run(settings, lora=side == "trl_ppo_lora")
    else:
        settings = GRPOSettings.from_json(settings_json)
        if side == "ours_grpo":
            import bench_ours

            bench_ours.run_grpo(settings, settings.beta)
        else:
            import bench_trl_grpo

            bench_trl_grpo.run(settings, settings.beta, lora=side == "trl_grpo_lora")


# ---- the parent -----------------------------------------------------------------------------------------


class Scale:
    """Runs the sides shape by shape, fits their peaks and decides what to run at the target."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sides = side_order(args.sides, list(SIDES))
        if args.prompts % args.group_size:
            raise SystemExit(f"--prompts {args.prompts} is not a multiple of --group-size {args.group_size}")
        self.target = parse_shape(args.shape, args.vocab)
        self.memory = int(args.memory_gib * GIB) if args.memory_gib else meminfo_bytes("MemTotal")
        self.headroom = int(args.headroom_gib * GIB)
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="scale-bench-"))
        self.python = {"ours": sys.executable, "trl112": args.trl112_python, "trl116": args.trl116_python}
        # side -> list of runs: {"layers", "parameters", "peak", "seconds", "process_seconds"} or an "error"
        self.runs: dict[str, list[dict[str, Any]]] = {side: [] for side in self.sides}
        self.unfit: dict[str, str] = {}

    # -- settings and processes

    def settings(self, side: str, shape: dict[str, int]) -> Settings:
        args = self.args
        common = dict(
            prompt_length=args.prompt_length, response_length=args.response_length, ppo_epochs=args.epochs,
            num_minibatches=args.minibatches, precision=args.precision, iterations=args.iterations,
            warmup=args.warmup, repeats=1, lora_r=args.lora_r, lora_alpha=2.0 * args.lora_r, threads=args.threads,
            workdir=str(self.shape_dir(shape)), llama=shape,
        )
        if side == "prepare" or SIDES[side][0] == "ppo":
            return Settings(prompts=args.prompts, **common)
        return GRPOSettings(prompts=args.prompts // args.group_size, group_size=args.group_size, beta=args.beta,
                            trl_gradient_checkpointing=args.trl_gradient_checkpointing, **common)

    def shape_dir(self, shape: dict[str, int]) -> Path:
        return self.workdir / f"llama_{shape['num_hidden_layers']}x{shape['hidden_size']}"

    def check_interpreters(self) -> None:
        """Every environment the chosen sides need imports rlhf_lightning, and TRL of the right version."""
        for environment in sorted({SIDES[side][1] for side in self.sides}):
            code = "import rlhf_lightning, peft; import importlib.metadata as m; print(m.version('trl'))" \
                if environment in TRL_VERSIONS else "import rlhf_lightning, lightning; print('-')"
            result = subprocess.run([self.python[environment], "-c", code], capture_output=True, text=True)
            found = result.stdout.strip()
            if result.returncode or (environment in TRL_VERSIONS and not found.startswith(TRL_VERSIONS[environment])):
                raise SystemExit(f"{self.python[environment]} cannot run the {environment} sides (TRL found: "
                                 f"{found or result.stderr.strip()[-300:]}); pass --{environment}-python")

    def limit(self) -> int:
        """The resident memory a child may reach now: what is available, less the headroom."""
        return meminfo_bytes("MemAvailable") - self.headroom

    def prepare(self, shape: dict[str, int], required: bool = True) -> dict[str, Any] | None:
        """Write the model folder of ``shape`` (random weights, tokenizer, our reward adapter) in a child; a
        failure is fatal if ``required``, else reported (None)."""
        self.shape_dir(shape).mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            result = run_child(__file__, "prepare", self.settings("prepare", shape), rss_limit=self.limit())
        except RuntimeError as error:  # MemoryLimitExceeded included
            if required:
                raise
            print(f"{self.shape_dir(shape).name}: could not be written: {error}", flush=True)
            return None
        print(f"{self.shape_dir(shape).name}: {result['parameters'] / 1e9:.3f}B parameters, "
              f"{result['weights'] / GIB:.3f} GiB fp32, written in {time.perf_counter() - start:.0f} s "
              f"(peak {result['peak_rss'] / GIB:.2f} GiB)", flush=True)
        return result

    def run(self, side: str, shape: dict[str, int], role: str) -> dict[str, Any]:
        """One process of ``side`` at ``shape``; ``role``: fit, target or largest."""
        entry: dict[str, Any] = {"role": role, "layers": shape["num_hidden_layers"],
                                 "parameters": llama_parameters(shape)}
        limit = self.limit()
        start = time.perf_counter()
        try:
            result = run_child(__file__, side, self.settings(side, shape), python=self.python[SIDES[side][1]],
                               rss_limit=limit)
        except MemoryLimitExceeded as error:
            entry.update(killed=True, peak=error.rss, limit=limit)
            print(f"  {side:<14} {role:<7} KILLED at {error.rss / GIB:.2f} GiB (limit {limit / GIB:.2f})", flush=True)
        except RuntimeError as error:
            entry["error"] = str(error).splitlines()[0]
            print(f"  {side:<14} {role:<7} FAILED: {error}", flush=True)
        else:
            rows = result["iterations"]
            entry.update(peak=result["peak_rss"], seconds=median([row["seconds"] for row in rows]),
                         rollout=median([row["rollout"] for row in rows]))
            print(f"  {side:<14} {role:<7} peak {entry['peak'] / GIB:7.3f} GiB  iteration {entry['seconds']:7.1f} s "
                  f"(rollout {entry['rollout']:.1f})  process {time.perf_counter() - start:6.0f} s", flush=True)
        entry["process_seconds"] = time.perf_counter() - start
        self.runs[side].append(entry)
        return entry

    def cleanup(self, shape: dict[str, int]) -> None:
        if not self.args.keep_models:
            for name in ("model", "adapters"):
                shutil.rmtree(self.shape_dir(shape) / name, ignore_errors=True)

    # -- the fit and the predictions

    def fit(self, side: str, roles: tuple[str, ...] = ("fit",)) -> dict[str, Any] | None:
        """The lines through ``side``'s runs of ``roles``: peak, iteration and process seconds against parameters;
        None (and ``self.unfit[side]`` says why) with fewer than two shapes or a peak that does not grow."""
        points = [(r["parameters"], r["peak"], r["seconds"], r["process_seconds"]) for r in self.runs[side]
                  if r["role"] in roles and "seconds" in r]
        if len({p[0] for p in points}) < 2:
            self.unfit[side] = f"{len(points)} fit shape(s) measured, two needed"
            return None
        memory = line([p[0] for p in points], [p[1] for p in points])
        if memory(1) - memory(0) <= 0:
            self.unfit[side] = ("the peak does not grow with the parameters at the fit shapes (allocator noise "
                                "over too small layers): choose more layers apart or a wider shape")
            return None
        seconds = line([p[0] for p in points], [p[2] for p in points])
        process = line([p[0] for p in points], [p[3] for p in points])
        residual = max(abs(memory(p[0]) - p[1]) for p in points)
        return {"memory": memory, "seconds": seconds, "process": process,
                "fixed_gib": memory(0) / GIB, "bytes_per_parameter": memory(1) - memory(0),
                "max_residual_gib": residual / GIB,
                "points": [[p[0], round(p[1] / GIB, 3), round(p[2], 2)] for p in points]}

    def should_run(self, side: str, fit: dict[str, Any] | None, parameters: int) -> tuple[bool, str]:
        if fit is None:
            return False, f"no prediction: {self.unfit.get(side)}"
        predicted = fit["memory"](parameters)
        available = min(self.memory, self.limit())
        if predicted * (1 + self.args.margin) > available:
            return False, (f"predicted {predicted / GIB:.1f} GiB x {1 + self.args.margin:.2f} > "
                           f"{available / GIB:.1f} GiB available")
        if fit["process"](parameters) > self.args.max_seconds:
            return False, f"predicted {fit['process'](parameters):.0f} s > --max-seconds {self.args.max_seconds:.0f}"
        return True, ""

    def largest(self, fit: dict[str, Any]) -> dict[str, Any]:
        """The largest model of the target's width the fitted line puts within ``memory``: the layer count, and
        the largest of target x 2^k layers (the doubling, k >= 0, or halving when the target does not fit)."""
        def at(layers: int) -> dict[str, Any]:
            shape = dict(self.target, num_hidden_layers=layers)
            parameters = llama_parameters(shape)
            return {"layers": layers, "parameters": parameters,
                    "predicted_gib": round(fit["memory"](parameters) / GIB, 2),
                    "predicted_seconds": round(max(0.0, fit["seconds"](parameters)), 1),
                    "fits": fit["memory"](parameters) <= self.memory}

        per_layer = llama_parameters(dict(self.target, num_hidden_layers=1)) - llama_parameters(
            dict(self.target, num_hidden_layers=0))
        slope = fit["memory"](per_layer) - fit["memory"](0)  # bytes per layer
        free = self.memory - fit["memory"](llama_parameters(dict(self.target, num_hidden_layers=0)))
        layers = math.floor(free / slope) if slope > 0 else None
        doubling, k = [], 0
        while k < 8:
            count = self.target["num_hidden_layers"] * 2**k
            doubling.append(at(count))
            if not doubling[-1]["fits"]:
                break
            k += 1
        while not doubling[0]["fits"] and doubling[0]["layers"] > 1:
            doubling.insert(0, at(max(1, doubling[0]["layers"] // 2)))
        fitting = [d for d in doubling if d["fits"]]
        return {"layers": at(layers) if layers and layers > 0 else None,
                "doubling": fitting[-1] if fitting else None,
                "doubling_steps": {d["layers"]: d["predicted_gib"] for d in doubling}}

    # -- the whole benchmark

    def main(self) -> dict[str, Any]:
        args = self.args
        self.check_interpreters()
        fit_layers = sorted({int(n) for n in args.fit_layers.split(",")})
        fit_shapes = [dict(self.target, num_hidden_layers=n) for n in fit_layers]
        print(f"workdir {self.workdir}; target {self.target} ({llama_parameters(self.target) / 1e9:.3f}B); fit "
              f"layers {fit_layers}; memory {self.memory / GIB:.2f} GiB", flush=True)
        for shape in fit_shapes:
            self.prepare(shape)
            for side in self.sides:
                self.run(side, shape, "fit")
            self.cleanup(shape)
        fits = {side: self.fit(side) for side in self.sides}
        target_parameters = llama_parameters(self.target)
        decisions = {}
        for side in self.sides:
            decisions[side] = (False, "--no-target") if args.no_target else self.should_run(
                side, fits[side], target_parameters)
        if any(run for run, _ in decisions.values()):
            prepared = self.prepare(self.target, required=False)
            for side in self.sides:
                if prepared is None and decisions[side][0]:
                    decisions[side] = (False, "the target's model folder could not be written")
                if decisions[side][0]:
                    self.run(side, self.target, "target")
                else:
                    print(f"  {side:<14} target  not run: {decisions[side][1]}", flush=True)
            self.cleanup(self.target)
        # the largest model: from the fit and the target's measurement where there is one
        refits = {side: self.fit(side, ("fit", "target")) or fits[side] for side in self.sides}
        largest = {side: self.largest(refits[side]) for side in self.sides if refits[side]}
        if args.run_largest:
            self.run_largest(largest, refits)
        return self.results(fits, decisions, largest)

    def run_largest(self, largest: dict[str, dict[str, Any]], fits: dict[str, Any]) -> None:
        """Measure each side at its largest doubling predicted to fit, larger than the target (shapes shared)."""
        wanted: dict[int, list[str]] = {}
        for side, entry in largest.items():
            doubling = entry["doubling"]
            if doubling and doubling["layers"] > self.target["num_hidden_layers"]:
                run, why = self.should_run(side, fits[side], doubling["parameters"])
                if run:
                    wanted.setdefault(doubling["layers"], []).append(side)
                else:
                    print(f"  {side:<14} largest ({doubling['layers']} layers) not run: {why}", flush=True)
        for layers, sides in sorted(wanted.items()):
            shape = dict(self.target, num_hidden_layers=layers)
            if self.prepare(shape, required=False) is None:
                continue
            for side in sides:
                entry = self.run(side, shape, "largest")
                largest[side]["doubling"]["measured_gib"] = round(entry["peak"] / GIB, 3) if "peak" in entry \
                    else None
                largest[side]["doubling"]["killed"] = bool(entry.get("killed"))
            self.cleanup(shape)

    def results(self, fits, decisions, largest) -> dict[str, Any]:
        target_parameters = llama_parameters(self.target)
        weights = 4 * target_parameters  # one copy in fp32
        sides: dict[str, Any] = {}
        for side in self.sides:
            fit = fits[side]
            measured = next((r for r in self.runs[side] if r["role"] == "target"), None)
            predicted = fit["memory"](target_parameters) if fit else None
            entry: dict[str, Any] = {
                "what": SIDES[side][2],
                "predicted_gib": round(predicted / GIB, 2) if predicted is not None else None,
                "predicted_seconds": round(max(0.0, fit["seconds"](target_parameters)), 1) if fit else None,
                "measured_gib": None, "seconds": None, "ratio": None, "run": decisions[side][0],
                "not_run_because": decisions[side][1] or None,
            }
            if measured and "seconds" in measured:
                entry.update(measured_gib=round(measured["peak"] / GIB, 3), seconds=round(measured["seconds"], 1),
                             rollout_seconds=round(measured["rollout"], 1),
                             ratio=round(measured["peak"] / weights, 3), fits=measured["peak"] <= self.memory,
                             basis="measured")
            elif measured and measured.get("killed"):
                entry.update(measured_gib=None, fits=False, basis=f"killed at {measured['peak'] / GIB:.2f} GiB")
            elif predicted is not None:
                entry.update(fits=predicted <= self.memory, basis="predicted")
            else:
                entry.update(fits=None, basis=f"no prediction: {self.unfit.get(side)}; " + "; ".join(
                    r.get("error", "killed") for r in self.runs[side] if "seconds" not in r))
            if predicted is not None:
                entry["predicted_ratio"] = round(predicted / weights, 3)
            if fit:
                entry["fit"] = {"fixed_gib": round(fit["fixed_gib"], 3),
                                "bytes_per_parameter": round(fit["bytes_per_parameter"], 2),
                                "max_residual_gib": round(fit["max_residual_gib"], 3),
                                "points_parameters_gib_seconds": fit["points"]}
                entry["largest"] = largest[side]
            sides[side] = entry
        ours = sides.get("ours_ppo", {})
        return {
            "model": {"shape": self.target, "parameters": target_parameters},
            "weights_gib": round(weights / GIB, 3),
            "memory_gib": round(self.memory / GIB, 2),
            "ours_ppo_peak_gib": ours.get("measured_gib"),
            "ours_ppo_ratio": ours.get("ratio"),
            "ours_ppo_predicted_ratio": ours.get("predicted_ratio"),
            "target_ratio": TARGET_RATIO,
            "target_met": ours["ratio"] <= TARGET_RATIO if ours.get("ratio") is not None else None,
            "fits": {side: entry["fits"] for side, entry in sides.items()},
            "largest_parameters": {side: (entry["largest"]["layers"] or {}).get("parameters")
                                   for side, entry in sides.items() if "largest" in entry},
            "sides": sides,
            "settings": {k: v for k, v in json.loads(self.settings("ours_grpo", self.target).to_json()).items()
                         if k not in ("workdir", "llama", "ppo_options", "repeats", "preset")}
            | {"ppo_prompts": self.args.prompts, "fit_layers": self.args.fit_layers, "margin": self.args.margin},
        }


def line(xs: list[float], ys: list[float]):
    """The least-squares line through ``(xs, ys)``, as a function."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    return lambda x: intercept + slope * x


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']['parameters'] / 1e9:.3f}B parameters, one copy of the fp32 weights "
          f"{result['weights_gib']:.2f} GiB; memory {result['memory_gib']:.2f} GiB")
    print(f"{'side':<14} {'predicted':>9} {'measured':>9} {'x weights':>9} {'s/iter':>8} {'fits':>4} "
          f"{'GiB/B':>6} {'largest: layers':>15} {'B params':>8} {'doubling':>8}")
    for side, entry in result["sides"].items():
        fit = entry.get("fit") or {}
        largest = entry.get("largest") or {}
        exact, doubling = largest.get("layers") or {}, largest.get("doubling") or {}
        ratio = entry["ratio"] if entry["ratio"] is not None else entry.get("predicted_ratio")
        fits = "?" if entry["fits"] is None else "yes" if entry["fits"] else "no"
        per_billion = fit["bytes_per_parameter"] * 1e9 / GIB if fit else None
        print(f"{side:<14} {fmt(entry['predicted_gib'], 9)} {fmt(entry['measured_gib'], 9)} {fmt(ratio, 9)} "
              f"{fmt(entry['seconds'], 8)} {fits:>4} {fmt(per_billion, 6)} {exact.get('layers', '-'):>15} "
              f"{fmt(exact.get('parameters', 0) / 1e9 if exact else None, 8)} {doubling.get('layers', '-'):>8}")
        if entry.get("not_run_because"):
            print(f"  {'':<12} not run at the target: {entry['not_run_because']} ({entry['basis']})")


def fmt(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, args.settings)
        return
    result = Scale(args).main()
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
