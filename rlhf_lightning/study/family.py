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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_lightning.study.family_summary import analyse, load_results, log_summary
from rlhf_lightning.study.family_units import (
    Unit,
    claim,
    ensure_pipeline,
    ensure_teacher,
    held_out,
    result_path,
    run_unit,
    seed_module,
    units,
    work,
    worker_loop,
)
from rlhf_lightning.study.methods import BEST_OF_N, METHODS

__all__ = ["FULL", "QUICK", "Unit", "analyse", "claim", "ensure_pipeline", "ensure_teacher", "held_out",
           "load_results", "log_summary", "main", "parse_args", "result_path", "run_unit", "seed_module", "units",
           "work", "worker_loop"]

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
                             "grpo=--model.init_args.optimizer.lr=5e-4")
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
