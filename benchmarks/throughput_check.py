"""The training loop's own throughput figures (``rlhf_lightning.callbacks.Throughput``: ``ppo/perf/*``) beside the
benchmark harness's counts of the same iterations: our PPO side of ``ppo_vs_trl.py`` (its model, prompts and
settings, a real ``lightning.Trainer``), timed by the harness's iteration timer and measured by the callback at once.

    python benchmarks/throughput_check.py --preset small
    python benchmarks/throughput_check.py --dry-run     # does it run? the tiny shape, one iteration

Printed per iteration: the harness's seconds, its generated tokens per second (response tokens over its own
``rollout/generate`` phase), its analytic FLOPs per second (``harness/flops.py``: the PPO passes counted from the
settings) beside the callback's generated tokens per second, update tokens per second, FLOPs (counted from the passes
the base ran) and MFU. The last line is one JSON object with the medians and the ratios callback / harness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

import bench_ours
import torch
from harness.fixtures import prepare_workdir
from harness.flops import iteration_flops
from harness.measure import Stopwatch
from harness.settings import PRESETS, Settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument("--workdir", default=None, help="folder for the model (default: a temp dir)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset, 2 prompts of 4 + 4 tokens, 1 epoch, "
                        "1 iteration, no warm-up")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.prompts, args.prompt_length, args.response_length = "tiny", 2, 4, 4
        args.ppo_epochs, args.iterations, args.warmup = 1, 1, 0
    return args


def measure(settings: Settings) -> tuple[list[dict[str, Any]], list[dict[str, float]], float]:
    """``(the harness's rows, the callback's figures, the peak the callback measured)`` of one fit."""
    import lightning as L

    from rlhf_lightning.callbacks import Throughput

    class Figures(L.Callback):
        """The callback's figures of each iteration, as logged."""

        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rows.append({key.removeprefix("ppo/perf/"): float(value)
                              for key, value in trainer.callback_metrics.items() if key.startswith("ppo/perf/")})

    torch.manual_seed(settings.seed)
    module = bench_ours.ppo_module(settings)
    watch = Stopwatch(settings.device)
    timer = bench_ours.make_callback(watch, settings, False, "ppo")
    throughput, figures = Throughput(), Figures()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="32", max_epochs=1,
                        limit_train_batches=settings.warmup + settings.iterations, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[throughput, figures, timer])
    with watch.recording_phases():
        trainer.fit(module, train_dataloaders=bench_ours.prompt_loader(settings, module.tokenizer))
    return timer.rows[settings.warmup:], figures.rows[settings.warmup:], float(throughput.peak_flops)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings(preset=args.preset, prompts=args.prompts, prompt_length=args.prompt_length,
                        response_length=args.response_length, ppo_epochs=args.ppo_epochs, iterations=args.iterations,
                        warmup=args.warmup, threads=args.threads, workdir=args.workdir or tempfile.mkdtemp())
    prepare_workdir(settings)
    bench_ours.configure_threads(settings)
    harness_rows, callback_rows, peak = measure(settings)
    flops = iteration_flops(settings)["total"]
    print(f"preset {settings.preset}: {settings.prompts} prompts x ({settings.prompt_length} + "
          f"{settings.response_length}) tokens, {settings.ppo_epochs} epochs; the callback's peak (matmul measured "
          f"here) {peak / 1e9:.1f} GFLOP/s; the harness's analytic FLOPs per iteration {flops / 1e9:.3f} G")
    print("iteration  harness: s    gen tok/s  GFLOP/s | callback: gen tok/s  update tok/s (prompt+response)  "
          "GFLOP  GFLOP/s    MFU")
    for index, (row, perf) in enumerate(zip(harness_rows, callback_rows, strict=True)):
        generate = row["phases"].get("rollout/generate", 0.0)
        print(f"{index + 1:>9}  {row['seconds']:>10.3f}  {row['tokens'] / generate:>9.1f}  "
              f"{flops / row['seconds'] / 1e9:>7.3f} | {perf['generate/response_tokens_per_s']:>19.1f}  "
              f"{perf['update/prompt_tokens_per_s']:>13.1f}+{perf['update/response_tokens_per_s']:<17.1f}  "
              f"{perf['flops'] / 1e9:>5.3f}  {perf['flops_per_s'] / 1e9:>7.3f}  {perf['mfu']:>6.4f}")

    def median(values: list[float]) -> float:
        return statistics.median(values)

    harness_tokens = median([row["tokens"] / row["phases"]["rollout/generate"] for row in harness_rows])
    callback_tokens = median([perf["generate/response_tokens_per_s"] for perf in callback_rows])
    callback_flops = median([perf["flops"] for perf in callback_rows])
    print(json.dumps({
        "settings": {"preset": settings.preset, "prompts": settings.prompts, "prompt_length": settings.prompt_length,
                     "response_length": settings.response_length, "ppo_epochs": settings.ppo_epochs},
        "harness_generated_tokens_per_second": round(harness_tokens, 2),
        "callback_generated_tokens_per_second": round(callback_tokens, 2),
        "generated_tokens_ratio": round(callback_tokens / harness_tokens, 4),
        "harness_flops_per_iteration": flops, "callback_flops_per_iteration": callback_flops,
        "flops_ratio": round(callback_flops / flops, 4),
        "callback_mfu": round(median([perf["mfu"] for perf in callback_rows]), 5), "peak_flops_per_second": peak,
    }))


if __name__ == "__main__":
    main()
