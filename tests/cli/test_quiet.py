"""What a run from the command line prints is what its user needs to read: no library deprecation notices, no
Lightning tips, no progress bars in a log file, our warnings as one line each; and a run that fails before it
logged anything leaves no empty W&B run behind; vLLM's traceback of a chat-template warm-up the engine never uses
is dropped, and anything else those loggers say still gets through."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_lightning.cli.quiet import quiet_libraries
from tests.helpers.environment import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]


def command_line(tmp_path: Path, *arguments: str, warnings: str = "", **environment: str) -> subprocess.CompletedProcess:
    """``python -m rlhf_lightning`` as a user runs it, its output going to a file (not a terminal)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "rlhf_lightning", *arguments], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300,
                          env=with_repo_on_path(PYTHONWARNINGS=warnings, **environment))


@pytest.mark.slow
def test_a_fit_in_a_log_file_prints_no_library_noise_and_our_warnings_in_one_line(tiny_model_dir, tmp_path):
    arguments = ["fit", "--config", str(REPO / "configs" / "sft.yaml"),
                 f"--model.init_args.base.name_or_path={tiny_model_dir}", "--data.init_args.synthetic_rows=200",
                 "--trainer.max_steps=4", "--trainer.val_check_interval=200"]
    result = command_line(tmp_path / "quiet", *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    noises = ("FutureWarning", "DeprecationWarning", "💡 Tip", "it/s]", "warnings.warn(")
    assert [noise for noise in noises if noise in output] == []
    # Python's own choice of warnings (-W / PYTHONWARNINGS) shows the libraries' notices again
    loud = command_line(tmp_path / "loud", *arguments, warnings="default")
    assert "DeprecationWarning" in loud.stderr
    assert ("warning: trainer.val_check_interval=200 is longer than the run's 4 training batches (max_steps x "
            "accumulate_grad_batches): no validation will run; lower it (e.g. to 1) or set "
            "trainer.limit_val_batches=0 to run without validation\n") in result.stderr
    assert "[sft] fit ended: 4 batches, 4 optimizer steps" in result.stdout


@pytest.mark.slow  # a fit in a subprocess
def test_a_run_that_fails_before_logging_leaves_no_wandb_run(tmp_path):
    result = command_line(tmp_path, "fit", "--config", str(REPO / "configs" / "grpo.yaml"),
                          f"--model.init_args.base.name_or_path={tmp_path / 'no_model'}",
                          "--trainer.default_root_dir=run", WANDB_SILENT="false")
    assert result.returncode == 1
    assert f"{tmp_path / 'run' / 'wandb' / 'offline-run-'}" in result.stderr  # W&B had started its run
    assert result.stderr.splitlines()[-1] == f"error: model folder {tmp_path / 'no_model'} does not exist"
    assert not (tmp_path / "run" / "wandb").exists(), sorted(path.name for path in (tmp_path / "run").rglob("*"))


def records_kept(name: str, messages: list[str]) -> list[str]:
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    logger = logging.getLogger(name)
    handler = Keep()
    logger.addHandler(handler)
    try:
        for message in messages:
            try:
                raise ValueError("template")
            except ValueError:
                logger.warning(message, exc_info=True)
    finally:
        logger.removeHandler(handler)
    return kept


def test_vllm_chat_template_warmup_traceback_is_dropped_and_other_lines_kept():
    quiet_libraries()
    quiet_libraries()  # idempotent: one filter
    assert len(logging.getLogger("vllm.renderers.base").filters) == 1
    assert records_kept("vllm.renderers.base", ["Chat template warmup failed", "Renderer is slow"]) == [
        "Renderer is slow"]


def test_lightning_tips_are_dropped():
    quiet_libraries()
    assert records_kept("lightning.pytorch.utilities.rank_zero", ["💡 Tip: try litlogger", "GPU available: False"]) \
        == ["GPU available: False"]
