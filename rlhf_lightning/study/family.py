"""Which method buys the most true reward per nat of KL and per CPU-second? The family study on the embedded task.

``python -m rlhf_lightning.study.family`` runs, for every seed of the pipeline (SFT model, reward model and prompts
all drawn from the seed), PPO, GRPO, GRPO with CISPO, Dr. GRPO, RLOO, REINFORCE++-baseline, on-policy distillation
from the seed's GRPO policy, online DPO, DPO, length-normalised DPO, KTO and SimPO, each at three KL strengths, and
best-of-n of the SFT policy, all from the same SFT model against the same reward model. Every run goes through the
framework's CLI with its shipped config, logs to W&B in one group, and is evaluated by the same callback on the same
held-out prompts with fixed sampling seeds (gold reward, the reward model's score, KL to the SFT policy, training CPU
time). It writes

* ``kl.png``: gold and proxy gain over the SFT policy against sqrt(KL), a band over seeds per method;
* ``compute.png``: gold gain against training CPU-seconds;
* ``table.md`` and ``family.json``: gold gain at matched KL, mean ± spread over seeds, Gao et al.'s fits;

and logs the figures and the table to a ``summary`` W&B run. Finished runs are kept under ``--out`` and reused, so
an interrupted study resumes where it stopped. ``--quick`` is the laptop version (two seeds, two strengths, a
quarter of the training); ``--jobs 2`` runs two processes of one thread each.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_lightning.study.best_of_n import BestOfNPoint, best_of_n_curve, powers_of_two, sample_reference
from rlhf_lightning.study.evaluation import HeldOutEvaluation, MethodRun
from rlhf_lightning.study.frontier import (
    compute_table,
    gao_fits,
    markdown_compute_table,
    markdown_table,
    matched_kl_table,
)
from rlhf_lightning.study.methods import BEST_OF_N, METHODS, run_arguments
from rlhf_lightning.study.runs import build_cli, held_out_batches

log = logging.getLogger(__name__)

FULL = {"seeds": [0, 1, 2], "kls": [2.0, 5.0, 10.0], "budgets": [10.0, 20.0, 40.0, 80.0], "best_of_n": 64,
        "eval_prompts": 256, "fraction": 1.0, "out": "outputs/family"}
QUICK = {"seeds": [0, 1], "kls": [0.5, 1.0, 2.0], "budgets": [5.0, 10.0, 20.0], "best_of_n": 16, "eval_prompts": 128,
         "fraction": 0.25, "out": "outputs/family_quick", "sft_steps": 500, "reward_steps": 200}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf_lightning.study.family",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the laptop version: {QUICK['seeds']} seeds, two strengths per method, "
                             f"{QUICK['fraction']:g} of each run's training, shorter SFT and reward stages")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"seeds of the pipeline (default {FULL['seeds']}, quick {QUICK['seeds']})")
    parser.add_argument("--methods", nargs="+", default=[*METHODS, BEST_OF_N],
                        choices=[*METHODS, BEST_OF_N], help="methods to run")
    parser.add_argument("--configs", default="configs", help="folder of the shipped configs")
    parser.add_argument("--out", default=None, help=f"output folder (default {FULL['out']}, quick {QUICK['out']})")
    parser.add_argument("--sft-model", default=None,
                        help="SFT model of each seed, {seed} filled in (default OUT/seed{seed}/sft/model; "
                             "trained with configs/sft.yaml when missing)")
    parser.add_argument("--reward-adapter", default=None,
                        help="reward adapter of each seed, {seed} filled in (default "
                             "OUT/seed{seed}/reward/adapters/reward; trained with configs/reward.yaml when missing)")
    parser.add_argument("--kls", type=float, nargs="+", default=None,
                        help=f"matched KLs of the table (default {FULL['kls']}, quick {QUICK['kls']})")
    parser.add_argument("--budgets", type=float, nargs="+", default=None,
                        help=f"training CPU-seconds of the compute table (default {FULL['budgets']}, quick "
                             f"{QUICK['budgets']})")
    parser.add_argument("--fraction", type=float, default=None,
                        help="share of each shipped config's training batches to run (default 1, quick 0.25)")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="held-out prompts of every evaluation (default 256, quick 128)")
    parser.add_argument("--evaluations", type=int, default=None,
                        help="evaluations per run after the first (default: the shipped config's validation "
                             "interval; half of it, at least, in a shortened run)")
    parser.add_argument("--best-of-n", type=int, default=None,
                        help="largest n of best-of-n (default 64, quick 16; 0 = no best-of-n)")
    parser.add_argument("--fit-min-d", type=float, default=1.0,
                        help="Gao's RL form is fitted to points with sqrt(KL) >= this (it does not hold near 0)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process with cores/jobs threads")
    parser.add_argument("--group", default=None, help="W&B group (default family-<time>)")
    parser.add_argument("--png-dir", default=None, help="also copy the figures and the table here (e.g. docs/)")
    parser.add_argument("--override", action="append", default=[],
                        help="extra CLI argument for every run (repeatable)")
    parser.add_argument("--method-override", action="append", default=[], metavar="METHOD=ARGUMENT",
                        help="extra CLI argument for one method's runs (repeatable), e.g. "
                             "grpo=--model.init_args.policy_lr=5e-4")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name in ("seeds", "kls", "budgets", "best_of_n", "eval_prompts", "fraction", "out"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    args.sft_steps, args.reward_steps = defaults.get("sft_steps"), defaults.get("reward_steps")
    args.sft_model = args.sft_model or str(Path(args.out) / "seed{seed}" / "sft" / "model")
    args.reward_adapter = args.reward_adapter or str(Path(args.out) / "seed{seed}" / "reward" / "adapters" / "reward")
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must lie in (0, 1], got {args.fraction}")
    for name in ("eval_prompts", "jobs", "evaluations"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.best_of_n < 0:
        parser.error(f"--best-of-n must be >= 0, got {args.best_of_n}")
    if args.best_of_n == 0:
        args.methods = [name for name in args.methods if name != BEST_OF_N]
    args.group = args.group or time.strftime("family-%Y%m%d-%H%M%S")
    args.method_overrides = {}
    for item in args.method_override:
        name, _, argument = item.partition("=")
        if name not in METHODS or not argument:
            parser.error(f"--method-override takes METHOD=ARGUMENT with METHOD one of {sorted(METHODS)}, got {item!r}")
        args.method_overrides.setdefault(name, []).append(argument)
    return args


@dataclass(frozen=True)
class Unit:
    """One piece of the study's work: a method at one strength on one seed, or best-of-n on one seed."""

    seed: int
    method: str
    strength: float | None = None

    @property
    def name(self) -> str:
        return f"seed{self.seed}-{self.method}" + ("" if self.strength is None else f"-{self.strength:g}")


def units(args: argparse.Namespace) -> list[Unit]:
    """Every unit of the study, seed by seed, best-of-n first."""
    work = []
    for seed in args.seeds:
        if BEST_OF_N in args.methods:
            work.append(Unit(seed, BEST_OF_N))
        for name in args.methods:
            if name in METHODS:
                method = METHODS[name]
                work += [Unit(seed, name, s) for s in (method.quick_strengths() if args.quick else method.strengths)]
    return work


def result_path(args: argparse.Namespace, unit: Unit) -> Path:
    return Path(args.out) / "runs" / f"{unit.name}.json"


# ---- the pipeline of a seed ------------------------------------------------------------------------------

def ensure_pipeline(args: argparse.Namespace, seed: int) -> tuple[str, str]:
    """The seed's SFT model and reward adapter, trained with the shipped stage configs when missing."""
    from rlhf_lightning.cli import main as cli_main

    sft, reward = args.sft_model.format(seed=seed), args.reward_adapter.format(seed=seed)
    stages = ((sft, "config.json", "sft.yaml", args.sft_steps, []),
              (reward, "adapter_config.json", "reward.yaml", args.reward_steps,
               [f"--model.init_args.base.name_or_path={sft}"]))
    for path, marker, config, steps, extra in stages:
        if (Path(path) / marker).exists():
            continue
        root = Path(path).parent if marker == "config.json" else Path(path).parent.parent
        export = path if marker == "config.json" else str(Path(path).parent)
        log.warning("seed %d: %s is missing: training it with %s", seed, path, config)
        cli_main(["fit", "--config", str(Path(args.configs) / config), f"--seed_everything={seed}",
                  f"--data.init_args.seed={seed}", f"--model.init_args.export_dir={Path(export).absolute()}",
                  f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
                  f"--trainer.logger.init_args.group={args.group}",
                  f"--trainer.logger.init_args.name={Path(config).stem}-seed{seed}",
                  "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
                  "--trainer.enable_progress_bar=false",
                  *([f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}"] if steps else []),
                  *extra])
    return sft, reward


_HELD_OUT: dict[int, list[dict[str, Any]]] = {}


def seed_module(args: argparse.Namespace, seed: int, sft: str, reward: str) -> tuple[Any, Any]:
    """A GRPO module on the seed's models and its prompt data module (set up): what best-of-n samples with. The
    module's model is built when it is first sampled from (:func:`sample_reference`)."""
    cli = build_cli(["--config", str(Path(args.configs) / METHODS["grpo"].config), f"--seed_everything={seed}",
                     f"--data.init_args.seed={seed}", f"--model.init_args.base.name_or_path={sft}",
                     f"--model.init_args.reward.init_args.path={reward}", "--trainer.logger=false",
                     "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false", *args.override])
    cli.datamodule.tokenizer = cli.model.tokenizer
    cli.datamodule.setup("fit")
    return cli.model, cli.datamodule


def held_out(args: argparse.Namespace, seed: int, sft: str, reward: str, datamodule: Any = None
             ) -> list[dict[str, Any]]:
    """The seed's held-out prompt batches, built once per seed and process from ``datamodule`` (the seed's, from
    :func:`seed_module`; built here when None). Only the batches are kept: a run must not hold a second copy of
    the base beside its own."""
    if seed not in _HELD_OUT:
        if datamodule is None:
            _, datamodule = seed_module(args, seed, sft, reward)
        _HELD_OUT[seed] = held_out_batches(datamodule, args.eval_prompts, "the family study")
    return _HELD_OUT[seed]


# ---- running units -----------------------------------------------------------------------------------------

def run_unit(args: argparse.Namespace, unit: Unit) -> None:
    """Run one unit and write its result (atomically: a half-written result is never reused)."""
    sft, reward = ensure_pipeline(args, unit.seed)
    module, datamodule = seed_module(args, unit.seed, sft, reward) if unit.method == BEST_OF_N else (None, None)
    batches = held_out(args, unit.seed, sft, reward, datamodule)
    started = time.perf_counter()
    if unit.method == BEST_OF_N:
        cpu = time.process_time()
        proxy, gold = sample_reference(module, batches, args.best_of_n, seed=unit.seed)
        seconds = time.process_time() - cpu
        curve = best_of_n_curve(proxy, gold, powers_of_two(args.best_of_n))
        result = {"seed": unit.seed, "cpu_seconds": seconds, "curve": [vars(p) for p in curve]}
    else:
        method = METHODS[unit.method]
        steps = max(1, round(method.steps * args.fraction))
        # A shorter run is evaluated more often, but not proportionally: evaluations cost as much as in a long run.
        every = (math.ceil(steps / args.evaluations) if args.evaluations
                 else max(1, round(method.every * max(args.fraction, 0.5))))
        directory = Path(args.out) / "runs" / unit.name
        run = MethodRun(unit.method, unit.strength, unit.seed, directory=str(directory))
        teacher = [f"--model.init_args.teacher={ensure_teacher(args, unit.seed, method.teacher)}"] \
            if method.teacher else []
        arguments = run_arguments(method, unit.strength, unit.seed, args.configs, sft, reward, directory,
                                  args.group, steps,
                                  [*teacher, *args.override, *args.method_overrides.get(unit.method, [])])
        cli = build_cli(arguments[1:])
        cli.trainer.callbacks.append(HeldOutEvaluation(run, batches, every, steps, reward))
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        if len(run.points) < 2 or run.points[-1].step != steps:
            raise RuntimeError(f"{unit.name}: the run stopped after {run.points[-1].step} of {steps} batches")
        run.wall_seconds = time.perf_counter() - started
        result = run.as_dict()
    path = result_path(args, unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(result, indent=1))
    os.replace(temporary, path)
    path.with_suffix(".claim").unlink(missing_ok=True)
    log.info("%s done in %.0f s", unit.name, time.perf_counter() - started)


def ensure_teacher(args: argparse.Namespace, seed: int, method: str) -> Path:
    """The exported policy adapter of ``method``'s run at its shipped strength on ``seed``, run first if needed (a
    teacher for distillation, on the same base)."""
    unit = Unit(seed, method, METHODS[method].shipped)
    adapter = Path(args.out) / "runs" / unit.name / "adapters" / "policy"
    if not (adapter / "adapter_config.json").exists():
        if claim(args, unit):
            log.warning("seed %d: the teacher %s is missing: running %s first", seed, adapter, unit.name)
            run_unit(args, unit)
        elif result_path(args, unit).exists():
            raise FileNotFoundError(f"{unit.name} is done but its adapter {adapter} is missing; remove "
                                    f"{result_path(args, unit)} to run it again as the teacher")
        while not result_path(args, unit).exists():  # another worker is running it
            time.sleep(10)
    return adapter.absolute()


def claim(args: argparse.Namespace, unit: Unit) -> bool:
    """Whether this process takes ``unit``: not done and not claimed by another worker (an exclusive create)."""
    if result_path(args, unit).exists():
        return False
    marker = result_path(args, unit).with_suffix(".claim")
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def work(args: argparse.Namespace) -> None:
    """Run every unit not done yet: here, or in ``--jobs`` worker processes that share the units."""
    for marker in (Path(args.out) / "runs").glob("*.claim"):
        marker.unlink()  # left by an interrupted study
    for seed in args.seeds:  # before the workers: two processes must not train the same stage
        ensure_pipeline(args, seed)
    if args.jobs == 1:
        for unit in units(args):
            if claim(args, unit):
                run_unit(args, unit)
        return
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    argv = sys.argv[1:] if args.argv is None else args.argv
    command = [sys.executable, "-m", "rlhf_lightning.study.family", *argv, "--group", args.group]
    workers = [subprocess.Popen([*command, "--worker", str(k)], env=environment)
               for k in range(args.jobs)]
    failed = [k for k, worker in enumerate(workers) if worker.wait() != 0]
    if failed:
        raise RuntimeError(f"study workers {failed} failed (their output is above); finished runs are kept: "
                           "run the same command again to resume")


def worker_loop(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for unit in units(args):
        if claim(args, unit):
            run_unit(args, unit)


# ---- analysis -----------------------------------------------------------------------------------------------

def load_results(args: argparse.Namespace) -> tuple[list[MethodRun], dict[int, list[BestOfNPoint]], dict[int, float]]:
    runs, curves, seconds = [], {}, {}
    for unit in units(args):
        row = json.loads(result_path(args, unit).read_text())
        if unit.method == BEST_OF_N:
            curves[unit.seed] = [BestOfNPoint(**point) for point in row["curve"]]
            seconds[unit.seed] = float(row["cpu_seconds"])
        else:
            runs.append(MethodRun.from_dict(row))
    return runs, curves, seconds


def analyse(args: argparse.Namespace) -> dict[str, Any]:
    """Figures, table and summary from the finished runs."""
    from rlhf_lightning.study.family_plot import plot_compute, plot_kl

    runs, curves, seconds = load_results(args)
    names = [name for name in args.methods if name in METHODS]
    labels = {name: METHODS[name].label for name in names}
    shipped = {name: METHODS[name].shipped for name in names}
    fits = gao_fits(runs, curves, [name for name in names if METHODS[name].uses_reward_model], args.fit_min_d)
    rows = matched_kl_table(runs, curves, args.kls, labels)
    out = Path(args.out)
    mode = "quick" if args.quick else "full"
    share = "each config's full training" if args.fraction == 1 else f"{args.fraction:g} of each config's training"
    title = f"{len(args.seeds)} seeds of the pipeline ({mode} mode), {args.eval_prompts} held-out prompts, {share}"
    kl_png = plot_kl(out / "kl.png", runs, curves, labels, title)
    compute_png = plot_compute(out / "compute.png", runs, curves, seconds, labels, shipped, title)
    compute_rows = compute_table(runs, curves, seconds, args.budgets, labels, shipped)
    table = markdown_table(rows, args.kls, fits) + "\n\n" + markdown_compute_table(compute_rows, args.budgets)
    (out / "table.md").write_text(table + "\n")
    summary = {"mode": mode, "seeds": args.seeds, "kls": args.kls, "budgets": args.budgets,
               "fraction": args.fraction, "eval_prompts": args.eval_prompts, "group": args.group, "table": rows,
               "compute_table": compute_rows, "gao_fits": fits, "shipped_strengths": shipped,
               "strengths": {name: list(METHODS[name].quick_strengths() if args.quick else METHODS[name].strengths)
                             for name in names},
               "sft": {run.seed: {"gold": run.points[0].gold, "proxy": run.points[0].proxy} for run in runs},
               "figures": [str(kl_png), str(compute_png)], "table_markdown": table}
    (out / "family.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    if args.png_dir:
        target = Path(args.png_dir)
        target.mkdir(parents=True, exist_ok=True)
        for path in (kl_png, compute_png, out / "table.md"):
            (target / f"family_{mode}_{path.name}").write_bytes(path.read_bytes())
    log_summary(args, kl_png, compute_png, rows, compute_rows)
    return summary


def log_summary(args: argparse.Namespace, kl_png: Path, compute_png: Path, rows: Sequence[dict[str, Any]],
                compute_rows: Sequence[dict[str, Any]]) -> None:
    """A ``summary`` run in the study's W&B group: both figures as images and both tables."""
    import wandb

    from rlhf_lightning.cli.loggers import WandbLogger

    logger = WandbLogger(save_dir=args.out, group=args.group, name="summary", tags=["family"])
    columns = ["method", *[f"gold gain at KL {kl:g}" for kl in args.kls], "peak gain", "peak KL"]
    data = [[row["label"], *[_mean(row[f"kl_{kl:g}"]) for kl in args.kls], _mean(row["peak"]),
             _mean(row["peak_kl"])] for row in rows]
    logger.experiment.log({
        "study/family_kl": wandb.Image(str(kl_png), caption="gold and proxy gain against sqrt(KL)"),
        "study/family_compute": wandb.Image(str(compute_png), caption="gold gain against CPU-seconds"),
        "study/family_table": wandb.Table(columns=columns, data=data),
        "study/family_compute_table": wandb.Table(
            columns=["method", *[f"gold gain after {b:g} CPU-s" for b in args.budgets]],
            data=[[row["label"], *[_mean(row[f"cpu_{b:g}"]) for b in args.budgets]] for row in compute_rows]),
    })
    logger.finalize("success")


def _mean(cell: dict[str, Any] | None) -> float | None:
    return None if cell is None else cell["mean"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Entry point: run what is missing, then print the table and write the figures."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.argv = None if argv is None else list(argv)
    if args.worker is not None:
        worker_loop(args)
        return None
    started = time.perf_counter()
    work(args)
    summary = analyse(args)
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(summary["table_markdown"])
    print(json.dumps({key: summary[key] for key in ("mode", "seeds", "kls", "figures", "wall_seconds")}))
    return summary


if __name__ == "__main__":
    main()
