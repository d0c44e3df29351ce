"""Offline W&B runs read back from their files: history from a run folder, runs that logged nothing
skipped, and the wait for W&B's service process to finish writing a run (``wandb.finish`` returns before it has)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from rlhf_lightning.cli.loggers import WandbLogger
from rlhf_lightning.runs.wandb_offline import (
    BLOCK,
    _records,
    find_run_file,
    is_finished,
    read_history,
    wait_until_finished,
)


def wandb_run(directory: Path, rows: list[dict]) -> Path:
    """A finished offline run under ``directory`` that logged ``rows`` (none: it failed before logging)."""
    import wandb

    run = wandb.init(mode="offline", dir=str(directory), project="p", settings=wandb.Settings(silent=True))
    run_file = Path(run.settings.sync_file)
    for row in rows:
        run.log(row)
    run.finish(exit_code=0 if rows else 1)
    assert wait_until_finished(run_file), f"W&B did not finish writing {run_file} within a minute"
    return run_file


def test_read_history_takes_the_folder_and_skips_runs_that_logged_nothing(tmp_path):
    logged = wandb_run(tmp_path, [{"a": 1.0}, {"a": 2.0}])
    empty = wandb_run(tmp_path, [])  # a run that failed before logging, newer than the good one
    assert empty != logged and empty.stat().st_mtime >= logged.stat().st_mtime
    assert [row["a"] for row in read_history(tmp_path / "wandb")] == [1.0, 2.0]
    assert find_run_file(tmp_path) == logged
    logged.unlink()
    with pytest.raises(FileNotFoundError, match=r"no W&B run with logged history under .* \(1 empty run"):
        read_history(tmp_path / "wandb")


def test_the_tail_of_a_long_run_parses_from_any_block(tmp_path):
    # Rows of 3 kB straddle block boundaries, and one of 80 kB spans several blocks (first, middle, last chunks).
    rows = [{"a": float(i), "text": "x" * (80_000 if i == 7 else 3_000)} for i in range(30)]
    run_file = wandb_run(tmp_path, rows)
    size = run_file.stat().st_size
    assert size > 4 * BLOCK
    every_record = [record.SerializeToString() for record in _records(run_file)]
    assert [record.WhichOneof("record_type") for record in _records(run_file)][-1] == "exit"
    for start in range(0, size, BLOCK):
        tail = [record.SerializeToString() for record in _records(run_file, start)]
        assert tail and tail == every_record[-len(tail):], f"records from block {start // BLOCK}"
    assert [row["a"] for row in read_history(run_file)] == [float(i) for i in range(30)]
    assert is_finished(run_file)


def test_wait_until_finished_waits_for_the_exit_record(tmp_path):
    run_file = wandb_run(tmp_path / "run", [{"a": 1.0}, {"a": 2.0}])
    whole = run_file.read_bytes()
    being_written = tmp_path / "run-being-written.wandb"
    for cut in (len(whole) // 2, len(whole) - 1):
        being_written.write_bytes(whole[:cut])
        assert not is_finished(being_written), cut
    assert not wait_until_finished(being_written, timeout=0.2)
    assert not wait_until_finished(tmp_path / "not-yet-created.wandb", timeout=0.1)

    def finish_writing() -> None:
        time.sleep(0.5)
        with being_written.open("ab") as file:
            file.write(whole[len(whole) - 1:])

    writer = threading.Thread(target=finish_writing)
    started = time.monotonic()
    writer.start()
    assert wait_until_finished(being_written, timeout=30)
    writer.join()
    assert time.monotonic() - started >= 0.5
    assert [row["a"] for row in read_history(being_written)] == [1.0, 2.0]


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("train/loss", output["loss"])
        return output


def test_the_logger_leaves_a_finished_run_when_fit_returns(tmp_path):
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    trainer = L.Trainer(max_steps=4, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    torch.manual_seed(0)
    trainer.fit(LoggingModel())
    run_file = find_run_file(tmp_path)
    assert is_finished(run_file)  # straight after fit: finalize waited for W&B to write the end of the run
    losses = [row["train/loss"] for row in read_history(run_file) if "train/loss" in row]
    assert len(losses) == 4 and all(loss == loss for loss in losses)
