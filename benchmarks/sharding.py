"""Sharding: one PPO and one GRPO iteration at 1, 2 and 4 CPU ranks under FSDP2, memory and time per rank.

Each run is the real command line (``python -m rlhf_lightning fit --config configs/{ppo,grpo}.yaml``) in a fresh
process group, on a random GPT-2-shaped model built here (``--layers`` x ``--width``, by default 8 x 512: about
25M parameters, 800 times the test model) with the synthetic tokenizer and a random reward adapter, so that PPO
holds four roles (policy, critic, reward, reference) on the one base. One rank runs on a single device
(``devices: 1``); N > 1 ranks run under Lightning's ``ModelParallelStrategy`` (FSDP2, ``data_parallel_size: N``),
the same global batch split over them, each rank with ``--threads`` / N intra-op threads (at least 1).

Printed per run and rank, with the ratio to the one-process run of the same algorithm:

- base bytes: the bytes of the base model's parameters this rank holds once the iteration is over (its shards;
  FSDP2 keeps the root unit gathered after a pass, so every unit is resharded first). The target: 1/N within 5%.
- peak RSS: the rank's peak resident set size (``ru_maxrss``), the Python process included, and the peak's rise
  above the resident size when the fit starts (the process, its imports and the process group: about 420 MiB),
  which is what the model, its training and the rollout add. Every run sets glibc's ``MALLOC_MMAP_THRESHOLD_``
  to 128 KiB: by default glibc raises that threshold after freeing a large buffer and keeps later ones of that
  size in its heap, so the all-gather and broadcast buffers the ranks free stay resident and the peak measures
  the allocator's retention (up to 1.7 x the one-process peak at 2 ranks here) rather than what the ranks hold;
- seconds per iteration: the second iteration (the first pays one-time costs), rollout and update together.

Both rollout settings run at N > 1: ``gathered`` (the default: each layer all-gathered once per rollout and kept
until it ends) and ``per_layer`` (each layer gathered for each forward pass, decoded tokens included).

    python benchmarks/sharding.py                    # 8 x 512, ranks 1, 2, 4
    python benchmarks/sharding.py --ranks 1,2 --layers 4 --width 256 --algorithms grpo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from harness.fixtures import save_random_reward_adapter
from harness.measure import peak_rss_bytes, rss_bytes
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20
MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"


class Measure(L.Callback):
    """Writes ``{out}.rank{r}.json`` on every rank: the seconds of each training batch, the base's bytes held by
    the rank after the fit and its peak resident set size.

    Args:
        out: the path prefix of the files.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.seconds: list[float] = []
        self.started = 0.0
        self.start_rss = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.start_rss = rss_bytes(os.getpid())

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self.started)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from rlhf_lightning.models.sharding import local_tensor, reshard_all

        reshard_all(pl_module.model)
        base = [local_tensor(parameter) for _, parameter in pl_module.model.base_parameters()]
        record = {"rank": trainer.global_rank, "seconds": self.seconds,
                  "base_bytes": sum(p.numel() * p.element_size() for p in base),
                  "peak_rss": peak_rss_bytes(), "start_rss": self.start_rss}
        Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def prepare(workdir: Path, layers: int, width: int) -> tuple[Path, Path]:
    """A random GPT-2-shaped model with the synthetic tokenizer, and a random reward adapter on it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_lightning.models.loading import load_tokenizer
    from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec

    torch.manual_seed(0)
    tokenizer = load_tokenizer(BaseModelSpec(tokenizer="synthetic"))
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=8, n_positions=128, vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model_dir = workdir / "model"
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, save_random_reward_adapter(model_dir, LoraSpec(r=16, alpha=32), workdir / "adapters")


def command(algorithm: str, ranks: int, rollout: str, model_dir: Path, reward_dir: Path, out: Path,
            args: argparse.Namespace) -> list[str]:
    """The ``fit`` arguments of one run (the same global batch at every rank count)."""
    prompts = args.prompts // ranks if algorithm == "ppo" else args.prompts // args.group_size // ranks
    strategy = (["--trainer.devices=1"] if ranks == 1 else
                [f"--trainer.devices={ranks}", f"--trainer.strategy={MODEL_PARALLEL}",
                 f"--trainer.strategy.init_args.data_parallel_size={ranks}",
                 "--trainer.strategy.init_args.tensor_parallel_size=1",
                 "--trainer.strategy.init_args.save_distributed_checkpoint=false"])
    group = [] if algorithm == "ppo" else [f"--model.init_args.samples_per_prompt={args.group_size}"]
    measure = {"class_path": "benchmarks.sharding.Measure", "init_args": {"out": str(out)}}
    return ["fit", "--config", str(REPO / "configs" / f"{algorithm}.yaml"), "--trainer.accelerator=cpu",
            *strategy, "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.callbacks=[{json.dumps(measure)}]", f"--trainer.limit_train_batches={args.iterations}",
            "--trainer.limit_val_batches=0", "--trainer.max_epochs=1",
            f"--model.init_args.base.name_or_path={model_dir}", f"--model.init_args.reward.init_args.path={reward_dir}",
            "--model.init_args.policy_lora={r: 16, alpha: 32}", *(["--model.init_args.critic.lora={r: 16, alpha: 32}"]
                                                                   if algorithm == "ppo" else []),
            f"--model.init_args.sampling.max_new_tokens={args.response_length}",
            "--model.init_args.sampling.stop_token=null",
            f"--model.init_args.sharded_rollout={rollout}", "--model.init_args.export_dir=null", *group,
            f"--data.init_args.batch_size={prompts}", f"--data.init_args.synthetic_rows={args.prompts * 4}",
            "--data.init_args.val_fraction=0.0"]


def run(algorithm: str, ranks: int, rollout: str, model_dir: Path, reward_dir: Path, workdir: Path,
        args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run in a fresh process group; the records of its ranks."""
    out = workdir / f"{algorithm}-{ranks}-{rollout}"
    threads = str(max(1, args.threads // ranks))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    child = [sys.executable, __file__, "--child", json.dumps(command(algorithm, ranks, rollout, model_dir,
                                                                       reward_dir, out, args))]
    result = subprocess.run(child, cwd=workdir, env=env, capture_output=True, text=True, start_new_session=True)
    if result.returncode != 0:
        raise RuntimeError(f"{algorithm} on {ranks} ranks ({rollout}) failed:\n{result.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--algorithms", default="ppo,grpo")
    parser.add_argument("--ranks", default="1,2,4", help="rank counts to run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16, help="responses per iteration (GRPO: prompts x group)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads in all")
    args = parser.parse_args()
    if args.child:
        from rlhf_lightning.cli import main as cli_main

        cli_main(json.loads(args.child))
        return
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        model_dir, reward_dir = prepare(workdir, args.layers, args.width)
        parameters = sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())
        print(f"base: GPT-2 {args.layers} x {args.width}, {parameters / 1e6:.1f}M parameters "
              f"({parameters * 4 / MIB:.1f} MiB fp32); {args.prompts} responses x {args.response_length} tokens")
        print(f"{'algorithm':<9} {'ranks':>5} {'rollout':<9} {'rank':>4} {'base MiB':>9} {'ratio':>6} "
              f"{'peak RSS MiB':>12} {'ratio':>6} {'peak-start':>10} {'ratio':>6} {'s/iteration':>11} {'ratio':>6}")
        results = []
        for algorithm in args.algorithms.split(","):
            baseline = None
            for ranks in (int(n) for n in args.ranks.split(",")):
                for rollout in (["gathered"] if ranks == 1 else ["gathered", "per_layer"]):
                    records = run(algorithm, ranks, rollout, model_dir, reward_dir, workdir, args)
                    baseline = baseline or records[0]
                    for record in records:
                        seconds = record["seconds"][-1]
                        rise, baseline_rise = (r["peak_rss"] - r["start_rss"] for r in (record, baseline))
                        print(f"{algorithm:<9} {ranks:>5} {rollout:<9} {record['rank']:>4} "
                              f"{record['base_bytes'] / MIB:>9.2f} {record['base_bytes'] / baseline['base_bytes']:>6.3f} "
                              f"{record['peak_rss'] / MIB:>12.0f} {record['peak_rss'] / baseline['peak_rss']:>6.3f} "
                              f"{rise / MIB:>10.0f} {rise / baseline_rise:>6.3f} "
                              f"{seconds:>11.2f} {seconds / baseline['seconds'][-1]:>6.2f}", flush=True)
                    results.append({"algorithm": algorithm, "ranks": ranks, "rollout": rollout, "records": records})
        print(json.dumps({"parameters": parameters, "results": results}))


if __name__ == "__main__":
    main()
