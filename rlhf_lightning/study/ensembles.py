"""Do reward-model ensembles stop over-optimisation on the embedded task? Coste et al. 2023 reproduced.

``python -m rlhf_lightning.study.ensembles`` runs, for every seed of the pipeline (SFT model, preference data, held-out
prompts and reward models all drawn from the seed) and every label noise (none, and 25 % of the labels flipped):

1. the SFT stage, then the reward stage with ``members: K``, ``label_noise`` p and each ``member_data`` of
   ``--member-data`` (``shared``: the members differ by their initialisation alone, as Coste et al.'s differ by their
   seed; ``bootstrap`` and ``partition`` also give each member other pairs);
2. best-of-n of the SFT policy: N samples per held-out prompt scored by every member, then the expected gold reward of
   the pick of one member (averaged over the members), of their mean, of the worst case (WCO) and of UWO, for every
   n up to N, against the best-of-n KL ``log n - (n - 1)/n``, from the same samples;
3. with noisy labels (``--ppo-noise``), PPO (``configs/ppo.yaml``) at a small KL coefficient against one member (an
   ensemble of one: standardised as the others), the mean, WCO and UWO, and one member at the shipped coefficient,
   its held-out gold reward measured along the run.

It prints and writes (``--out``) tables of both, mean and spread over the seeds, and two figures. Every stage is a
``python -m rlhf_lightning fit`` of its shipped config with the study's arguments
(:mod:`~rlhf_lightning.study.pipeline_runs`); finished stages are kept and reused (an interrupted study resumes), and
the SFT stage is shared with :mod:`~rlhf_lightning.study.spread` when both write to one ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from rlhf_lightning.algorithms.ensemble import MEMBER_DATA, combine_members
from rlhf_lightning.study.best_of_n import best_of_n_curve, powers_of_two, sample_reference
from rlhf_lightning.study.pipeline_runs import Pipeline, Sample, Stage
from rlhf_lightning.study.runs import build_cli, held_out_batches

log = logging.getLogger(__name__)
RULES = ("single", "mean", "min", "uwo")  # one member alone, then the three ways to combine them


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf_lightning.study.ensembles",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the pipeline")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every stage")
    parser.add_argument("--jobs", type=int, default=2, help="stages run at once")
    parser.add_argument("--members", type=int, default=4, help="reward models of each ensemble")
    parser.add_argument("--label-noise", type=float, nargs="+", default=[0.0, 0.25],
                        help="fractions of flipped preference labels, one ensemble each")
    parser.add_argument("--member-data", nargs="+", choices=MEMBER_DATA, default=["shared"],
                        help="what each member trains on, one ensemble each (the PPO runs use the first)")
    parser.add_argument("--uwo-coef", type=float, default=0.5, help="UWO's lambda, on standardised scores")
    parser.add_argument("--best-of-n", type=int, default=64, help="samples per prompt of the SFT policy (largest n)")
    parser.add_argument("--best-of-n-prompts", type=int, default=128, help="held-out prompts of best-of-n")
    parser.add_argument("--ppo-noise", type=float, default=0.25, help="the label noise of the PPO runs' ensembles")
    parser.add_argument("--ppo-runs", nargs="*", default=["single:0.01", "mean:0.01", "min:0.01", "uwo:0.01",
                                                          "single:0.07"],
                        help="PPO runs, RULE:KL_COEF each (RULE one of single, mean, min, uwo); none = no PPO")
    parser.add_argument("--ppo-epochs", type=int, default=6,
                        help="passes over the PPO prompts (ppo.yaml: 32 iterations each)")
    parser.add_argument("--eval-every", type=int, default=16, help="PPO iterations between held-out evaluations")
    parser.add_argument("--configs", default="configs", help="folder of the shipped configs")
    parser.add_argument("--out", default="outputs/ensembles", help="the study's folder")
    parser.add_argument("--png-dir", default=None, help="also copy the figures here (e.g. docs)")
    parser.add_argument("--override", action="append", default=[], metavar="STAGE=ARG",
                        help="a further argument for every run of a stage (sft, reward or ppo), repeatable")
    args = parser.parse_args(argv)
    for run in args.ppo_runs:
        rule, _, kl = run.partition(":")
        if rule not in RULES or not kl:
            parser.error(f"--ppo-runs {run!r}: expected RULE:KL_COEF with RULE one of {', '.join(RULES)}")
    return args


def reward_source(rule: str, reward: str, uwo_coef: float, members: int) -> str:
    """The ``--model.init_args.reward`` of a PPO run scored by ``rule`` (``{reward}``: the sample's ensemble)."""
    if rule == "single":
        init = {"path": [f"{reward}/reward_0"], "combine": "mean"}  # an ensemble of one: standardised alike
    else:
        init = {"path": reward, "combine": rule, **({"uncertainty_coef": uwo_coef} if rule == "uwo" else {})}
    return "--model.init_args.reward=" + json.dumps({"class_path": "rlhf_lightning.EnsembleReward", "init_args": init})


def ensemble_name(noise: float, member_data: str) -> str:
    """The name of the reward stage of one ensemble (``shared`` members keep the study's first names)."""
    return f"noise{noise:g}" if member_data == "shared" else f"{member_data}-noise{noise:g}"


def tagged(tag: str, overrides: Sequence[str]) -> str:
    """A stage's folder tag, with a hash of the study's further ``--override`` arguments when there are any (so that
    other overrides never reuse a run)."""
    return f"{tag}-{hashlib.sha256(chr(10).join(overrides).encode()).hexdigest()[:8]}" if overrides else tag


def pipeline(args: argparse.Namespace) -> Pipeline:
    """The study's stages: the SFT stage, an ensemble per label noise, the PPO runs."""
    extra: dict[str, list[str]] = {}
    for pair in args.override:
        stage, _, value = pair.partition("=")
        extra.setdefault(stage, []).append(value)
    configs = Path(args.configs)
    stages = {"sft": Stage("sft", str(configs / "sft.yaml"), overrides=tuple(extra.get("sft", ())))}
    for noise in args.label_noise:
        for member_data in args.member_data:
            name = ensemble_name(noise, member_data)
            stages[f"reward-{name}"] = Stage(
                "reward", str(configs / "reward.yaml"), ("sft",),
                (f"--model.init_args.members={args.members}", f"--model.init_args.member_data={member_data}",
                 f"--data.init_args.label_noise={noise}", *extra.get("reward", ())),
                tag=tagged(f"ensemble{args.members}-{name}", extra.get("reward", ())), kind="reward")
    ppo_ensemble = ensemble_name(args.ppo_noise, args.member_data[0])
    for run in args.ppo_runs:
        rule, kl = run.split(":")
        stages[f"ppo-{run}"] = Stage(
            "ppo", str(configs / "ppo.yaml"), ("sft", f"reward-{ppo_ensemble}"),
            (reward_source(rule, "{reward}", args.uwo_coef, args.members), f"--model.init_args.kl.coef={kl}",
             f"--trainer.max_epochs={args.ppo_epochs}", f"--trainer.val_check_interval={args.eval_every}",
             *extra.get("ppo", ())),
            tag=tagged(f"{rule}-kl{kl}-{ppo_ensemble}-ensemble{args.members}",
                       [*extra.get("reward", ()), *extra.get("ppo", ())]), kind="ppo")
    return Pipeline(Path(args.out), stages)


def best_of_n(args: argparse.Namespace, runs: Pipeline, sample: Sample, noise: float, member_data: str) -> dict:
    """Best-of-n of the SFT policy of ``sample`` against the ensemble trained at ``noise`` on ``member_data``: every
    member's score and the gold reward of ``--best-of-n`` samples per held-out prompt (kept in an ``.npz``), then each
    rule's curve."""
    name = ensemble_name(noise, member_data)
    path = Path(args.out) / "best_of_n" / f"{sample.name}-{name}-ensemble{args.members}.npz"
    if not path.exists():
        ensemble = runs.output(f"reward-{name}", sample)
        members = [{"class_path": "rlhf_lightning.EnsembleReward",
                    "init_args": {"path": [str(ensemble / f"reward_{k}")], "combine": "mean"}}
                   for k in range(args.members)]
        cli = build_cli(["--config", str(Path(args.configs) / "ppo.yaml"), f"--seed_everything={sample.seed}",
                         f"--data.init_args.seed={sample.seed}",
                         f"--model.init_args.base.name_or_path={runs.output('sft', sample)}",
                         f"--model.init_args.reward={json.dumps(members)}", "--model.init_args.critic.from_reward=false",
                         "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"])
        cli.datamodule.tokenizer = cli.model.tokenizer
        cli.datamodule.setup("fit")
        batches = held_out_batches(cli.datamodule, args.best_of_n_prompts, "best-of-n")
        torch.set_num_threads(args.threads)
        scores, gold = sample_reference(cli.model, batches, args.best_of_n, seed=sample.seed, per_source=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, scores=scores, gold=gold)
    saved = np.load(path)
    return {"seed": sample.seed, "threads": sample.threads, "noise": noise, "member_data": member_data,
            "curves": best_of_n_curves(saved["scores"], saved["gold"], args.best_of_n, args.uwo_coef)}


def best_of_n_curves(scores: np.ndarray, gold: np.ndarray, largest: int, uwo_coef: float) -> dict[str, list[dict]]:
    """Each rule's best-of-n curve from the members' scores ``[P, N, K]`` and the gold ``[P, N]``; ``single`` is the
    curve of each member alone, averaged over the members."""
    ns = powers_of_two(largest)
    members = torch.as_tensor(scores)
    curves = {rule: [vars(p) for p in best_of_n_curve(combine_members(members, rule, uwo_coef).numpy(), gold, ns)]
              for rule in RULES[1:]}
    alone = [best_of_n_curve(scores[..., k], gold, ns) for k in range(scores.shape[-1])]
    curves["single"] = [{**vars(points[0]), "gold": float(np.mean([p.gold for p in points])),
                         "proxy": float(np.mean([p.proxy for p in points]))} for points in zip(*alone, strict=True)]
    return curves


def main(argv: Sequence[str] | None = None) -> dict:
    from rlhf_lightning.study.ensemble_summary import summarise

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    runs = pipeline(args)
    samples = [Sample(seed, args.threads) for seed in args.seeds]
    ensembles = [(noise, member_data) for noise in args.label_noise for member_data in args.member_data]
    rewards = [f"reward-{ensemble_name(*ensemble)}" for ensemble in ensembles]
    ppo = [stage for stage in runs.stages if stage.startswith("ppo-")]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda sample: runs.run("sft", sample), samples))
        list(pool.map(lambda item: runs.run(*item), [(stage, s) for s in samples for stage in rewards]))
        # best-of-n first (minutes), the PPO runs after (most of the study's time)
        bon = [best_of_n(args, runs, sample, *ensemble) for sample in samples for ensemble in ensembles]
        ppo_seconds = list(pool.map(lambda item: runs.run(*item), [(stage, s) for s in samples for stage in ppo]))
    log.info("PPO runs took %.0f s in all", sum(ppo_seconds))
    return summarise(args, runs, samples, bon, ppo)


if __name__ == "__main__":
    main()
