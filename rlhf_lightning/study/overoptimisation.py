"""Reward-model over-optimisation on the embedded task: is the policy getting better, or fooling the proxy?

``python -m rlhf_lightning.study.overoptimisation`` runs PPO from one SFT model against one reward model at
several KL coefficients (0 included), measures the hidden gold reward and the proxy score against
``d = sqrt(KL)``, fits Gao et al.'s RL form ``d (alpha - beta ln d)`` to the gold gain, measures best-of-n of
the SFT policy against its KL ``log n - (n - 1)/n``, and writes a figure (PNG, also logged to W&B in a summary
run) and a JSON summary, which it also prints.

Every PPO run goes through the framework's CLI with ``configs/ppo.yaml`` (or ``--config``) and logs to W&B
in one group (offline unless an API key is configured). ``--override`` passes any further CLI argument to
every run, e.g. ``--override=--model.init_args.optimizer.lr=5e-4``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_lightning.study.analysis import analyse
from rlhf_lightning.study.best_of_n import BestOfNPoint, best_of_n_curve, powers_of_two, sample_reference
from rlhf_lightning.study.runs import RunResult, build_cli, held_out_batches, ppo_arguments, run_ppo

log = logging.getLogger(__name__)

DEFAULT_SFT = "outputs/sft/model"
DEFAULT_REWARD = "outputs/reward/adapters/reward"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_lightning.study.overoptimisation",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default="configs/ppo.yaml", help="PPO config every run starts from")
    parser.add_argument("--sft-model", default=DEFAULT_SFT,
                        help="the SFT model: base and reference of every run")
    parser.add_argument("--reward-adapter", default=DEFAULT_REWARD, help="the proxy reward model's adapter")
    parser.add_argument("--kl-coefs", type=float, nargs="+", default=[0.0, 0.05, 0.15],
                        help="fixed KL coefficients, one PPO run each")
    parser.add_argument("--iterations", type=int, default=96, help="PPO iterations per run")
    parser.add_argument("--eval-every", type=int, default=4,
                        help="evaluate on the held-out prompts every this many iterations")
    parser.add_argument("--fit-on", choices=("eval", "train"), default="eval",
                        help="points of the gold fit: held-out evaluations, or every training rollout")
    parser.add_argument("--fit-min-d", type=float, default=1.5,
                        help="fit the RL form to points with d = sqrt(KL) >= this: the form has an infinite "
                             "slope at d = 0 and does not hold near the origin (Gao et al.); 0 = every point")
    parser.add_argument("--best-of-n", type=int, default=64,
                        help="largest n of best-of-n (samples per prompt from the SFT policy); 0 = no "
                             "curve (the SFT policy's gold is still measured, one sample per prompt)")
    parser.add_argument("--best-of-n-prompts", type=int, default=128,
                        help="held-out prompts used for best-of-n (at most the validation set)")
    parser.add_argument("--out", default="outputs/study", help="output folder (runs, figure, JSON)")
    parser.add_argument("--png", default=None,
                        help="also copy the figure here (e.g. docs/overoptimisation.png)")
    parser.add_argument("--group", default=None,
                        help="W&B group of the runs (default: overoptimisation-<time>)")
    parser.add_argument("--table-every", type=int, default=16,
                        help="log the completions table every this many iterations")
    parser.add_argument("--override", action="append", default=[],
                        help="extra CLI argument for every PPO run (repeatable), e.g. "
                             "--override=--model.init_args.optimizer.lr=5e-4")
    parser.add_argument("--no-train-missing", dest="train_missing", action="store_false",
                        help="fail instead of training the default SFT model / reward adapter when missing")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.eval_every < 1:
        parser.error("--iterations and --eval-every must be positive")
    return args


def ensure_models(args: argparse.Namespace) -> None:
    """Train the SFT model and the reward model with their stage configs when their default paths are
    empty."""
    from rlhf_lightning.cli import main as cli_main

    configs = Path(args.config).parent
    stages = ((args.sft_model, DEFAULT_SFT, "config.json", "sft.yaml"),
              (args.reward_adapter, DEFAULT_REWARD, "adapter_config.json", "reward.yaml"))
    for path, default, marker, config in stages:
        if (Path(path) / marker).exists():
            continue
        if not args.train_missing or Path(path) != Path(default) or not (configs / config).exists():
            raise FileNotFoundError(f"{path} has no {marker}: train it first "
                                    f"(python -m rlhf_lightning fit --config configs/{config})")
        log.warning("%s is missing: training it with %s first", path, configs / config)
        cli_main(["fit", "--config", str(configs / config)])


def measure_best_of_n(args: argparse.Namespace) -> tuple[tuple[float, float], list[BestOfNPoint]]:
    """The SFT policy's mean ``(gold, proxy)`` and the best-of-n curve, on the held-out prompts."""
    cli = build_cli(["--config", args.config, f"--model.init_args.base.name_or_path={args.sft_model}",
                     f"--model.init_args.reward.init_args.path={args.reward_adapter}",
                     "--trainer.logger=false", "--trainer.callbacks=[]",
                     "--trainer.enable_checkpointing=false", *args.override])
    module, data = cli.model, cli.datamodule
    data.tokenizer = module.tokenizer
    data.setup("fit")
    n_max = max(args.best_of_n, 1)
    batches = held_out_batches(data, args.best_of_n_prompts, "best-of-n")
    proxy, gold = sample_reference(module, batches, n_max, seed=cli.config.get("seed_everything") or 0)
    baseline = (float(gold.mean()), float(proxy.mean()))
    curve = best_of_n_curve(proxy, gold, powers_of_two(n_max)) if args.best_of_n > 0 else []
    return baseline, curve


def log_summary_to_wandb(args: argparse.Namespace, group: str, png: Path, summary: dict[str, Any],
                         runs: Sequence[RunResult], curve: Sequence[BestOfNPoint]) -> None:
    """A ``summary`` run in the study's W&B group: the figure, the points as tables, the fitted numbers."""
    import wandb

    from rlhf_lightning.cli.loggers import WandbLogger

    logger = WandbLogger(save_dir=args.out, group=group, name="summary", tags=["overoptimisation"])
    rows = [[run.kl_coef, kind, p.iteration, p.kl, p.d, p.gold, p.proxy]
            for run in runs for kind, series in (("train", run.train), ("eval", run.eval)) for p in series]
    logger.experiment.log({
        "study/overoptimisation": wandb.Image(str(png), caption="gold and proxy reward against sqrt(KL)"),
        "study/ppo_points": wandb.Table(columns=["kl_coef", "kind", "iteration", "kl", "d", "gold", "proxy"],
                                        data=rows),
        "study/best_of_n": wandb.Table(columns=["n", "kl", "d", "gold", "proxy"],
                                       data=[[p.n, p.kl, p.d, p.gold, p.proxy] for p in curve]),
    })
    logger.experiment.summary.update({f"study/{k}": v for k, v in summary.items()
                                      if isinstance(v, int | float | str)})
    logger.finalize("success")


def run_study(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command does; returns the JSON summary."""
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    group = args.group or time.strftime("overoptimisation-%Y%m%d-%H%M%S")
    ensure_models(args)

    bon_start = time.perf_counter()
    baseline, curve = measure_best_of_n(args)
    bon_seconds = time.perf_counter() - bon_start

    runs = []
    for kl_coef in args.kl_coefs:
        directory = out / "runs" / f"kl_coef={kl_coef:g}"
        arguments = ppo_arguments(args.config, args.sft_model, args.reward_adapter, kl_coef, directory, group,
                                  args.eval_every, args.table_every, args.override)
        runs.append(run_ppo(arguments, kl_coef, args.iterations, directory))
        log.info("kl_coef=%g: %d iterations in %.0f s", kl_coef, len(runs[-1].train), runs[-1].seconds)

    summary, points, fits, bon_fit = analyse(runs, curve, baseline, args.fit_on, args.fit_min_d)
    png = out / "overoptimisation.png"
    from rlhf_lightning.study.plot import plot_study

    headline = summary["fit_kl_coef"]
    plot_study(png, runs, points, baseline, {headline: fits[headline]} if headline is not None else {}, curve,
               bon_fit, fit_min_d=args.fit_min_d,
               title=f"Reward-model over-optimisation on the embedded task ({args.fit_on} points)")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        Path(args.png).write_bytes(png.read_bytes())
    summary.update(iterations=args.iterations, best_of_n_seconds=round(bon_seconds, 1), png=str(png),
                   wall_seconds=round(time.perf_counter() - start, 1))
    (out / "runs.json").write_text(json.dumps([run.as_dict() for run in runs], indent=1))
    (out / "study.json").write_text(json.dumps(summary, indent=1))
    log_summary_to_wandb(args, group, png, summary, runs, curve)
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point: run the study, print its JSON summary, return it."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    summary = run_study(parse_args(argv))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
