"""Runs of every stage in one process, under DDP and under FSDP2, and their comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.environment import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]


MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"


STRATEGIES = {
    "ddp": ["--trainer.devices=2", "--trainer.strategy=ddp"],
    "fsdp2": ["--trainer.devices=2", f"--trainer.strategy={MODEL_PARALLEL}",
              "--trainer.strategy.init_args.data_parallel_size=2", "--trainer.strategy.init_args.tensor_parallel_size=1",
              "--trainer.strategy.init_args.save_distributed_checkpoint=false"],
}


COMMON = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.max_epochs=1",
          "--trainer.num_sanity_val_steps=0", "--data.init_args.synthetic_rows=48", "--data.init_args.val_fraction=0.25"]


ONLINE = ["--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.sampling.max_new_tokens=6",
          "--model.init_args.seed_scope=prompt", "--model.init_args.update.num_minibatches=1", "--model.init_args.update.epochs=2",
          "--model.init_args.update.target_kl=null", "--trainer.limit_train_batches=2", "--trainer.val_check_interval=2",
          "--trainer.limit_val_batches=1"]


OFFLINE = ["--trainer.max_steps=3", "--trainer.limit_val_batches=0"]


PER_RANK = ("policy/approx_kl", "policy/clipfrac", "policy/ratio", "policy/entropy", "value/mean",
            "value/explained_variance", "value/clipfrac", "loss/kl", "loss/entropy", "rollout/mismatch_kl",
            "rollout/mismatch_logprob_diff_mean", "rollout/mismatch_logprob_diff_max", "rollout/correction_weight",
            "rollout/corrected_out")


def stages(model_dir: Path, reward_dir: Path) -> dict[str, tuple[str, list[str], int, int | None]]:
    """Stage -> (config, overrides, global batch size, global validation batch size)."""
    base = f"--model.init_args.base.name_or_path={model_dir}"
    reward = f"--model.init_args.reward.init_args.path={reward_dir}"
    return {
        "sft": ("sft.yaml", [base, *OFFLINE], 8, None),  # full fine-tuning: every weight trains, the root unit too
        "reward": ("reward.yaml", [base, "--model.init_args.lora={r: 4, alpha: 8}", *OFFLINE], 8, None),
        "dpo": ("dpo.yaml", [base, "--model.init_args.policy_lora={r: 4, alpha: 8}",
                             "--model.init_args.precompute_reference=false", *OFFLINE], 8, None),
        "dpo_precomputed": ("dpo.yaml", [base, "--model.init_args.policy_lora={r: 4, alpha: 8}",
                                         "--model.init_args.precompute_reference=true", *OFFLINE], 8, None),
        # KTO's own reference point pairs each prompt with another response of the rank's batch: not the rows one
        # process pairs, so the equivalence is of its reference-point-free loss (the rest of its machinery)
        "kto": ("kto.yaml", [base, "--model.init_args.policy_lora={r: 4, alpha: 8}",
                             "--model.init_args.loss_type=apo_zero_unpaired", *OFFLINE], 8, None),
        # two micro-batches per step; log-probs two positions at a time, recomputed in the backward pass
        "ppo": ("ppo.yaml", [base, reward, *ONLINE, "--model.init_args.critic.lora={r: 4, alpha: 8}",
                             "--model.init_args.update.gradient_accumulation=2", "--model.init_args.logprob_chunk=2"], 8, 8),
        "grpo": ("grpo.yaml", [base, reward, *ONLINE, "--model.init_args.sharded_rollout=per_layer"], 4, 8),
        "rloo": ("rloo.yaml", [base, reward, *ONLINE, "--model.init_args.base.gradient_checkpointing=true"], 4, 8),
        # micro-batches packed by tokens: rows of 8 to 10 tokens pack three or two to a micro-batch, so the ranks
        # pack different counts, and the rank with fewer splits its largest until both run as many backward passes
        "reinforce_pp": ("reinforce_pp.yaml", [base, reward, *ONLINE, "--model.init_args.update.micro_batch_tokens=27"], 4, 8),
        "online_dpo": ("online_dpo.yaml", [base, reward, *ONLINE], 4, 8),  # a prompt's pair stays on one rank
    }


def run_all(runs: list[dict], tmp_path: Path, name: str) -> None:
    runs_file = tmp_path / f"{name}.json"
    runs_file.write_text(json.dumps(runs))
    env = with_repo_on_path()
    result = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "equivalence.py"), str(runs_file)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    # A correct sharded run says nothing alarming (docs/scaling.md): no FSDP2 view warning, no sync_dist advice.
    for alarming in ("returned a view tensor", "It is recommended to use `self.log("):
        assert alarming not in result.stderr, result.stderr[result.stderr.index(alarming) - 300:][:1000]


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(torch.allclose(actual.float(), expected.float(), rtol=rtol, atol=atol))


def largest_differences(full: dict, resumed: dict) -> dict[str, float]:
    """Asserts that ``resumed`` (a run resumed from a checkpoint of another layout) continues ``full`` (the
    uninterrupted run in one process) within the equivalence tolerance: its logged values, the gradients of its
    optimizer steps and its final weights (the metrics that are per-rank means by design excepted); returns the
    largest absolute difference of each."""
    metrics = full["metrics"][-len(resumed["metrics"]):]
    gradients = full["gradients"][-len(resumed["gradients"]):]
    assert resumed["metrics"] and len(resumed["gradients"]) == 2 * len(resumed["metrics"])
    largest = {"metrics": 0.0, "gradients": 0.0, "weights": 0.0}
    for expected, actual in zip(metrics, resumed["metrics"], strict=True):
        assert expected.keys() == actual.keys()
        for name, value in expected.items():
            if not name.endswith(PER_RANK):
                assert actual[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
                largest["metrics"] = max(largest["metrics"], abs(actual[name] - value))
    for expected, actual in zip(gradients, resumed["gradients"], strict=True):
        assert expected.keys() == actual.keys() and expected
        for name, value in expected.items():
            assert close(actual[name], value, 1e-4, 1e-6), name
            largest["gradients"] = max(largest["gradients"], float((actual[name] - value).abs().max()))
    assert full["weights"].keys() == resumed["weights"].keys()
    for name, value in full["weights"].items():
        assert close(resumed["weights"][name], value, 1e-5, 1e-5), name
        largest["weights"] = max(largest["weights"], float((resumed["weights"][name] - value).abs().max()))
    return largest
