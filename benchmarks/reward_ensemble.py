"""What a reward-model ensemble costs: K reward adapters on the one base, K = 1, 3, 5, at the quick start's shapes.

Each K runs in a process of its own (so that its peak memory is its own), on the same random model of the quick
start's SFT shape (``configs/sft.yaml``'s GPT-2: 4 layers, width 96, the synthetic tokenizer) and the same K reward
adapters:

* the reward stage (``configs/reward.yaml``'s batches of 64 pairs) with ``members: K``: seconds per training step;
* PPO (``configs/ppo.yaml``) scored by ``EnsembleReward`` of K members (K = 1: the ``AdapterReward`` of the quick
  start): seconds per iteration and of its scoring phase (``ppo/time/rollout/reward``);
* the parameters the process holds (the base once, the adapters and heads, by count) and its peak resident memory.

From the repository::

    python benchmarks/reward_ensemble.py                 # K = 1, 3, 5; 40 reward steps, 8 PPO iterations each
    python benchmarks/reward_ensemble.py --dry-run       # does it run?

Prints a table with each K's ratios to K = 1 (run in the same invocation), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = {"model_type": "gpt2", "n_layer": 4, "n_embd": 96, "n_head": 4, "n_positions": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1, 3, 5], help="ensemble sizes (1 first)")
    parser.add_argument("--reward-steps", type=int, default=40, help="reward-stage steps timed per K")
    parser.add_argument("--iterations", type=int, default=8, help="PPO iterations timed per K (after one warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny: K = 1, 2; 1 step and 1 iteration (of one epoch) after the warm-up, batches of 8, "
                             "4 new tokens")
    parser.add_argument("--workdir", default=None, help="where the model and adapters are written (default: a temp)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.members, args.reward_steps, args.iterations = [1, 2], 1, 1
    return args


def prepare(workdir: Path, members: int) -> None:
    """A random model of the quick start's SFT shape and ``members`` random reward adapters saved beside it."""
    import torch

    from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
    from rlhf_lightning.models.shared_base import SharedBase
    from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec

    torch.manual_seed(0)
    spec = BaseModelSpec(architecture=ARCHITECTURE, tokenizer="synthetic")
    tokenizer = load_tokenizer(spec)
    load_causal_lm(spec, tokenizer).save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    base_spec = BaseModelSpec(name_or_path=str(workdir / "model"))
    base = SharedBase(load_causal_lm(base_spec, load_tokenizer(base_spec)))
    names = [f"reward_{k}" for k in range(members)]
    for name in names:
        base.add_adapter(name, LoraSpec(r=16, alpha=32))
        base.add_head(name)
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    for name in names:
        out = base.save_adapter(name, workdir / "ensemble")
        (out / "reward_stats.json").write_text(json.dumps({"mean": 0.0, "std": 1.0, "count": 1}))
    (workdir / "ensemble" / "ensemble.json").write_text(json.dumps({"members": names, "member_data": "shared"}))


DRY = ["--data.init_args.batch_size=8", "--data.init_args.synthetic_rows=200"]


def fit_arguments(config: str, workdir: Path, run: str, dry_run: bool) -> list[str]:
    return ["--config", str(REPO / "configs" / config), *(DRY if dry_run else []),
            f"--model.init_args.base.name_or_path={workdir / 'model'}",
            f"--trainer.default_root_dir={workdir / run}", "--trainer.logger=false", "--trainer.callbacks=[]",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--validate_at_start.enabled=false",
            "--model.init_args.export_dir=null", "--trainer.limit_val_batches=0"]


class Timer:
    """Seconds of every training batch, and of its scoring phase (``rollout/reward``, recorded by :meth:`record`)
    (Lightning callback hooks, duck-typed to stay importable without lightning)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.reward: list[float] = []

    def record(self, name: str, seconds: float) -> None:
        if name == "rollout/reward":
            self.reward[-1] += seconds

    def on_train_batch_start(self, *args) -> None:
        self.reward.append(0.0)
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def child(args: argparse.Namespace) -> dict:
    """One K: the reward stage's steps, then PPO's iterations, in this process."""
    import lightning as L
    import torch

    from rlhf_lightning.models.shared_base import adapter_of
    from rlhf_lightning.study.runs import build_cli
    from rlhf_lightning.utils.timing import record_phases

    if args.threads:
        torch.set_num_threads(args.threads)
    workdir, members = Path(args.workdir), args.child

    class Timing(Timer, L.Callback):
        pass

    reward_timer = Timing()
    cli = build_cli([*fit_arguments("reward.yaml", workdir, f"reward{members}", args.dry_run),
                     f"--model.init_args.members={members}", f"--trainer.max_steps={args.reward_steps + 1}"])
    cli.trainer.callbacks.append(reward_timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    reward = {"class_path": "rlhf_lightning.AdapterReward", "init_args": {"path": str(workdir / "ensemble" / "reward_0")}} \
        if members == 1 else {"class_path": "rlhf_lightning.EnsembleReward",
                              "init_args": {"path": [str(workdir / "ensemble" / f"reward_{k}") for k in range(members)],
                                            "combine": "min"}}
    ppo_timer = Timing()
    cli = build_cli([*fit_arguments("ppo.yaml", workdir, f"ppo{members}", args.dry_run),
                     f"--model.init_args.reward={json.dumps(reward)}", f"--trainer.limit_train_batches={args.iterations + 1}",
                     "--trainer.max_epochs=1", *(["--model.init_args.sampling.max_new_tokens=4",
                                                  "--model.init_args.update.epochs=1"] if args.dry_run else [])])
    cli.trainer.callbacks.append(ppo_timer)
    with record_phases(ppo_timer.record):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    model = cli.model.model
    return {
        "members": members,
        "reward_step_s": statistics.median(reward_timer.seconds[1:]),
        "ppo_iteration_s": statistics.median(ppo_timer.seconds[1:]),
        "ppo_reward_phase_s": statistics.median(ppo_timer.reward[1:]),
        "base_parameters": sum(p.numel() for _, p in model.base_parameters()),
        "reward_parameters": sum(p.numel() for n, p in model.model.named_parameters()
                                 if (adapter_of(n) or "").startswith("reward"))
        + sum(p.numel() for name, head in model.heads.items() if name.startswith("reward") for p in head.parameters()),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return []
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(args.workdir or temporary)
        workdir.mkdir(parents=True, exist_ok=True)
        prepare(workdir, max(args.members))
        rows = []
        for members in args.members:
            command = [sys.executable, __file__, "--child", str(members), "--workdir", str(workdir),
                       "--reward-steps", str(args.reward_steps), "--iterations", str(args.iterations),
                       "--threads", str(args.threads), *(["--dry-run"] if args.dry_run else [])]
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                raise RuntimeError(f"K = {members} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = rows[0]
    print("K  reward step s  ratio  PPO iteration s  ratio  scoring s  base params  reward params  peak RSS MB  ratio")
    for row in rows:
        print(f"{row['members']:<2} {row['reward_step_s']:>13.3f} {row['reward_step_s'] / first['reward_step_s']:>6.2f} "
              f"{row['ppo_iteration_s']:>16.3f} {row['ppo_iteration_s'] / first['ppo_iteration_s']:>6.2f} "
              f"{row['ppo_reward_phase_s']:>10.3f} {row['base_parameters']:>12,} {row['reward_parameters']:>14,} "
              f"{row['peak_rss_mb']:>12.0f} {row['peak_rss_mb'] / first['peak_rss_mb']:>6.2f}")
    print(json.dumps({"rows": rows}))
    return rows


if __name__ == "__main__":
    main()
