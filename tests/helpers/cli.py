"""The command line as the tests drive it: in process, in a subprocess, and what it logged or printed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_lightning.cli import main
from rlhf_lightning.cli.errors import TRACEBACK_ENV
from rlhf_lightning.runs.wandb_offline import read_history
from tests.helpers.environment import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]


def logged_keys(directory: Path, expected: set[str], timeout: float = 30.0) -> set[str]:
    """Keys logged in the W&B run under ``directory``. W&B's writer is a separate process, so give its file a
    few seconds to show every record on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            keys = {key for row in read_history(directory) for key in row}
        except FileNotFoundError:  # no run with history flushed yet
            keys = set()
        if expected <= keys or time.monotonic() > deadline:
            return keys
        time.sleep(0.5)


def cli_subprocess(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = with_repo_on_path()
    env.pop(TRACEBACK_ENV, None)
    return subprocess.run([sys.executable, "-m", "rlhf_lightning", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def one_line(capsys, *arguments: str, code: int = 1) -> str:
    """Run the command line; it must exit with ``code`` and print exactly one ``error:`` line, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(arguments))
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def one_logged_grpo_step(tiny_model_dir, reward_dir, config: Path, root: str) -> None:
    """One GRPO iteration of ``configs/grpo.yaml`` with ``config`` over it, on the tiny model, logged to W&B (offline)
    under ``root``."""
    main(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--config", str(config),
          f"--model.init_args.base.name_or_path={tiny_model_dir}",
          f"--model.init_args.reward.init_args.path={reward_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
          "--model.init_args.sampling.max_new_tokens=4", "--data.init_args.synthetic_rows=24",
          "--data.init_args.batch_size=2", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=0",
          "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}"])


def grpo(tiny_model_dir, reward_dir, *overrides: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "grpo.yaml"), f"--model.init_args.base.name_or_path={tiny_model_dir}",
            f"--model.init_args.reward.init_args.path={reward_dir}", "--model.init_args.policy_lora={r: 4, alpha: 8}",
            "--data.init_args.synthetic_rows=40", "--data.init_args.batch_size=2", "--model.init_args.sampling.max_new_tokens=4",
            "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=0", "--trainer.callbacks=[]",
            "--trainer.enable_checkpointing=false", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            *overrides]
