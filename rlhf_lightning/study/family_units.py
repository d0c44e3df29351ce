"""The family study's work (see :mod:`rlhf_lightning.study.family`): its units (a method at one strength on one
seed, or best-of-n on one seed), each seed's pipeline (SFT model and reward adapter) and held-out prompts, and running
the units not done yet, here or in worker processes that claim them one by one."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_lightning.study.best_of_n import best_of_n_curve, powers_of_two, sample_reference
from rlhf_lightning.study.evaluation import HeldOutEvaluation, MethodRun
from rlhf_lightning.study.methods import BEST_OF_N, METHODS, run_arguments
from rlhf_lightning.study.runs import build_cli, held_out_batches

log = logging.getLogger(__name__)


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
