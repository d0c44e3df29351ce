"""Runs through tests/helpers/equivalence.py that are stopped by a signal, and their comparison."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers.environment import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]


COMMON = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
          "--trainer.enable_model_summary=false", "--trainer.num_sanity_val_steps=0", "--trainer.max_epochs=1",
          "--trainer.log_every_n_steps=1"]


ONLINE = ["--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.sampling.max_new_tokens=6",
          "--model.init_args.update.num_minibatches=1", "--model.init_args.update.epochs=2", "--data.init_args.batch_size=2",
          "--data.init_args.synthetic_rows=64", "--data.init_args.val_fraction=0.25", "--data.init_args.val_batch_size=4"]


OFFLINE = ["--data.init_args.batch_size=4", "--data.init_args.synthetic_rows=120", "--data.init_args.val_fraction=0.2",
           "--data.init_args.val_batch_size=8"]


def stage(kind: str, model_dir: Path, reward_dir: Path) -> tuple[list[str], int]:
    """``(fit arguments, optimizer steps per training batch)`` of a tiny run of ``kind``."""
    base = f"--model.init_args.base.name_or_path={model_dir}"
    if kind == "sft":
        return ["--config", str(REPO / "configs" / "sft.yaml"), base, *OFFLINE], 1
    if kind == "reward":
        return ["--config", str(REPO / "configs" / "reward.yaml"), base, "--model.init_args.lora={r: 4, alpha: 8}",
                *OFFLINE], 1
    if kind == "dpo":
        return ["--config", str(REPO / "configs" / "dpo.yaml"), base, "--model.init_args.policy_lora={r: 4, alpha: 8}",
                "--model.init_args.sampling.max_new_tokens=6", "--model.init_args.sample_eval_batches=1", *OFFLINE], 1
    return ["--config", str(REPO / "configs" / "grpo.yaml"), base, f"--model.init_args.reward.init_args.path={reward_dir}",
            *ONLINE], 2


def drive(tmp_path: Path, name: str, runs: list[dict]) -> subprocess.CompletedProcess:
    """Run ``runs`` through ``tests/helpers/equivalence.py`` in a process group of their own (a kill -9 of the group
    takes every rank and spares pytest)."""
    runs_file = tmp_path / f"{name}.json"
    runs_file.write_text(json.dumps(runs))
    return subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "equivalence.py"), str(runs_file)], cwd=tmp_path,
                          env=with_repo_on_path(), capture_output=True, text=True, timeout=600,
                          start_new_session=True)


def run(tmp_path: Path, name: str, arguments: list[str], *callbacks: dict, resume: bool = False) -> dict:
    return {"args": [*arguments, f"--trainer.default_root_dir={tmp_path / name}",
                     *(["--ckpt_path=last"] if resume else [])],
            "out": str(tmp_path / f"{name}.pt"), "callbacks": list(callbacks)}


def assert_same_training(full: dict, resumed: dict, from_batch: int, steps_per_batch: int) -> None:
    """The resumed run's batches are the uninterrupted run's from ``from_batch`` on, bit for bit."""
    expected = full["metrics"][from_batch - 1:]
    assert len(resumed["metrics"]) == len(expected) > 0
    for want, got in zip(expected, resumed["metrics"], strict=True):
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert got[key] == value, key
    for want, got in zip(full["gradients"][(from_batch - 1) * steps_per_batch:], resumed["gradients"], strict=True):
        for key, value in want.items():
            assert torch.equal(got[key], value), key
    for key, value in full["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


EVERY_ITERATION = {"class_path": "rlhf_lightning.callbacks.IterationCheckpoint",
                   "init_args": {"every_n_iterations": 1, "save_last": True, "enable_version_counter": False}}


def kill_and_resume(tmp_path: Path, arguments: list[str]) -> tuple[dict, dict]:
    """A fit of ``arguments`` (4 iterations, 2 optimizer steps each) run whole, then killed with SIGKILL at iteration
    3's second step and resumed with ``--ckpt_path last`` (a checkpoint every iteration): the two runs' probes,
    after checking that the resumed one continued the whole one bit for bit."""
    full = drive(tmp_path, "full", [run(tmp_path, "full", arguments, EVERY_ITERATION)])
    assert full.returncode == 0, full.stderr[-4000:]
    killed = drive(tmp_path, "killed", [run(tmp_path, "killed", arguments, EVERY_ITERATION, {
        "class_path": "tests.helpers.equivalence.KillAt", "init_args": {"iteration": 3, "step": 2}})])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    resumed = drive(tmp_path, "resumed", [run(tmp_path, "killed", arguments, EVERY_ITERATION, resume=True)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    full_probe, resumed_probe = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "killed.pt")
    assert_same_training(full_probe, resumed_probe, from_batch=3, steps_per_batch=2)
    return full_probe, resumed_probe
