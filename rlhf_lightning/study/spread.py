"""How often does the main job learn? The quick start's pipeline over samples of seeds and thread counts.

``python -m rlhf_lightning.study.spread`` runs, for every seed and thread count, the quick start's commands
(``configs/sft.yaml``, ``configs/reward.yaml``, then each algorithm's config) as a user does, each stage with
``--seed_everything=S --data.init_args.seed=S`` under ``OMP_NUM_THREADS=T``, and prints one row per sample: the
reward model's held-out accuracy (against its labels, and against the gold order), the algorithm's held-out gold
gain in standard deviations of the starting (SFT) policy's gold, its KL to the reference and its response length;
then how many samples learn (gain >= 1 SD) and the mean and spread of the gain.

Finished stages are kept under ``--out`` and reused (an interrupted study resumes where it stopped); a variant of a
stage (``--override reward=--model.init_args.members=5``) gets folders of its own, so the samples of the
stages it does not touch are shared.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlhf_lightning.runs.wandb_offline import read_history
from rlhf_lightning.study.pipeline_runs import Pipeline, Sample, Stage

# The algorithms whose pipelines the study runs: config, the stages each needs, the prefix of its metrics.
ALGORITHMS = {
    "ppo": ("ppo.yaml", ("sft", "reward"), "ppo"),
    "grpo": ("grpo.yaml", ("sft", "reward"), "grpo"),
    "rloo": ("rloo.yaml", ("sft", "reward"), "rloo"),
    "reinforce_pp": ("reinforce_pp.yaml", ("sft", "reward"), "reinforce_pp"),
    "dpo": ("dpo.yaml", ("sft",), "dpo"),
}
LEARNS = 1.0  # a sample learns when its held-out gold gains at least this many SD of the starting policy's gold


@dataclass
class Row:
    """One sample of one algorithm's pipeline: what its reward model and its policy reached."""

    algorithm: str
    seed: int
    threads: int
    rm_accuracy: float | None
    rm_gold_accuracy: float | None
    gold_start: float
    gold_end: float
    gold_sd: float
    kl: float
    length_start: float
    length_end: float
    score_start: float | None
    score_end: float | None
    seconds: float

    @property
    def gain_sd(self) -> float:
        """The held-out gold gain in SD of the starting policy's gold (NaN where every start scored alike)."""
        return (self.gold_end - self.gold_start) / self.gold_sd if self.gold_sd > 0 else math.nan

    @property
    def learns(self) -> bool:
        return self.gain_sd >= LEARNS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf_lightning.study.spread",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds of the pipeline")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="OMP_NUM_THREADS of every stage of a sample")
    parser.add_argument("--algorithms", nargs="+", default=["ppo"], choices=sorted(ALGORITHMS))
    parser.add_argument("--configs", default="configs", help="folder of the shipped configs")
    parser.add_argument("--out", default="outputs/spread", help="the study's folder: every stage's runs")
    parser.add_argument("--override", action="append", default=[], metavar="STAGE=ARG",
                        help="a command-line argument for every run of a stage (sft, reward or an algorithm), "
                             "repeatable: --override reward=--model.init_args.members=5")
    parser.add_argument("--tag", action="append", default=[], metavar="STAGE=NAME",
                        help="the folder name of an overridden stage (default: a hash of its overrides)")
    parser.add_argument("--jobs", type=int, default=1, help="samples run at once (each its stages in order)")
    parser.add_argument("--json", default=None, help="write the rows here (default: <out>/spread-<tags>.json)")
    return parser.parse_args(argv)


def stage_settings(pairs: Sequence[str], option: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for pair in pairs:
        stage, separator, value = pair.partition("=")
        if not separator or not value:
            raise SystemExit(f"error: {option} {pair!r}: expected STAGE=VALUE, e.g. reward=--trainer.max_steps=300")
        settings.setdefault(stage, []).append(value)
    return settings


def pipeline(args: argparse.Namespace) -> Pipeline:
    """The study's stages: SFT, the reward model and every algorithm asked for, with their overrides and tags."""
    overrides, tags = stage_settings(args.override, "--override"), stage_settings(args.tag, "--tag")
    stages = {"sft": ("sft.yaml", ()), "reward": ("reward.yaml", ("sft",))}
    stages.update({name: ALGORITHMS[name][:2] for name in args.algorithms})
    unknown = sorted((set(overrides) | set(tags)) - set(stages))
    if unknown:
        raise SystemExit(f"error: --override/--tag name stage(s) {unknown}; this study's stages: {sorted(stages)}")
    return Pipeline(Path(args.out), {
        name: Stage(name, str(Path(args.configs) / config), needs, tuple(overrides.get(name, ())),
                    tags.get(name, [None])[-1])
        for name, (config, needs) in stages.items()})


def last(history: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in history if key in row]
    return float(values[-1]) if values else None


def first(history: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in history if key in row]
    return float(values[0]) if values else None


def measure(runs: Pipeline, algorithm: str, sample: Sample) -> Row:
    """Run ``algorithm``'s pipeline on ``sample`` (what is not done yet) and read its row from the runs' W&B files."""
    seconds = sum(runs.run(stage, sample) for stage in ("sft", *ALGORITHMS[algorithm][1][1:], algorithm))
    prefix = ALGORITHMS[algorithm][2]
    history = read_history(runs.folder(algorithm, sample))
    rm = read_history(runs.folder("reward", sample)) if "reward" in ALGORITHMS[algorithm][1] else []
    values = {key: (first(history, f"{prefix}/val/{key}"), last(history, f"{prefix}/val/{key}"))
              for key in ("gold", "kl", "length", "score")}
    gold_sd = first(history, f"{prefix}/val/gold_std")
    if values["gold"][0] is None or gold_sd is None:
        raise RuntimeError(f"{runs.folder(algorithm, sample)} logged no {prefix}/val/gold and gold_std: the study "
                           "needs the held-out evaluation of the starting policy and of the last one")
    return Row(algorithm, sample.seed, sample.threads, last(rm, "rm/val/accuracy"), last(rm, "rm/val/gold_accuracy"),
               *values["gold"], gold_sd, values["kl"][1], *values["length"], *values["score"], seconds)


def mean_sd(values: Sequence[float], sign: str = "+") -> str:
    if len(values) < 2:
        return f"{values[0]:{sign}.2f}" if values else "-"
    return f"{statistics.mean(values):{sign}.2f} ± {statistics.stdev(values):.2f}"


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Row]) -> str:
    """The rows as a markdown table, then per algorithm how many samples learn and the gain's mean ± SD."""
    lines = ["| algorithm | seed | threads | RM accuracy (labels) | RM accuracy (gold order) | gold start → end "
             "| gain (SD of the start) | KL | length start → end | proxy start → end | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        proxy = "-" if row.score_start is None else f"{row.score_start:+.2f} → {row.score_end:+.2f}"
        lines.append(f"| {row.algorithm} | {row.seed} | {row.threads} | {_number(row.rm_accuracy)} "
                     f"| {_number(row.rm_gold_accuracy)} | {row.gold_start:+.3f} → {row.gold_end:+.3f} "
                     f"| {row.gain_sd:+.2f}{'' if row.learns else ' ✗'} | {row.kl:.2f} "
                     f"| {row.length_start:.1f} → {row.length_end:.1f} | {proxy} | {row.seconds:.0f} |")
    lines.append("")
    for algorithm in dict.fromkeys(row.algorithm for row in rows):
        mine = [row for row in rows if row.algorithm == algorithm]
        lines.append(f"{algorithm}: {sum(row.learns for row in mine)} of {len(mine)} samples learn (gain >= "
                     f"{LEARNS:g} SD); gain {mean_sd([row.gain_sd for row in mine])} SD, KL "
                     f"{mean_sd([row.kl for row in mine], '')}, gold at the end {mean_sd([row.gold_end for row in mine])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    runs = pipeline(args)
    samples = [Sample(seed, threads) for threads in args.threads for seed in args.seeds]
    work = [(algorithm, sample) for algorithm in args.algorithms for sample in samples]
    # The shared stages of a sample first, one job per sample, so that no two jobs train the same stage.
    shared = [stage for stage in ("sft", "reward") if any(stage in ALGORITHMS[a][1] for a in args.algorithms)]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda sample: [runs.run(stage, sample) for stage in shared], samples))
        rows = list(pool.map(lambda item: measure(runs, *item), work))
    print(table(rows))
    tags = "-".join(runs.folder_name(stage) for stage in runs.stages)
    path = Path(args.json or Path(args.out) / f"spread-{tags}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{**asdict(row), "gain_sd": row.gain_sd, "learns": row.learns} for row in rows],
                               indent=1))
    print(f"rows written to {path}")
    return rows


if __name__ == "__main__":
    main()
