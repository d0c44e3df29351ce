"""Progress lines: the time left is measured on the steady state (the first batch's warm-up left out), and each
line says the time of day; a busy machine is told what to set at the start."""

from __future__ import annotations

import re
import time

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from rlhf_lightning.callbacks import ProgressLines
from rlhf_lightning.utils import machine


class SlowStart(BoringModel):
    """A first training batch that takes 2 s (loading, compiling), the others a few milliseconds."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            time.sleep(2.0)
        return super().training_step(batch, batch_idx)


def test_the_time_left_leaves_the_warm_up_out(tmp_path, capsys):
    trainer = L.Trainer(max_steps=6, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[ProgressLines(every_seconds=0)])
    trainer.fit(SlowStart())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[SlowStart] batch ")]
    assert len(lines) == 6
    assert re.fullmatch(r"\[SlowStart\] batch 1 · step 1/6 · 2s · \d\d:\d\d:\d\d · first batch 2s \(warm-up\)",
                        lines[0].split(" · train_loss")[0]), lines[0]
    per_batch = float(re.search(r"· ([\d.e-]+) s/batch · ", lines[2]).group(1))
    assert per_batch < 0.5  # the steady state's, not (2 s + ...) / 3 as when the first batch counted
    assert re.search(r" · 0s left", lines[2]), lines[2]


def test_a_busy_machine_is_told_to_use_fewer_threads(monkeypatch):
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (5.2, 4.0, 3.0))
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert machine.busy_machine_warning() == (
        "this machine is busy (load 5.2 over the last minute, 2 cores): torch's 2 threads per process compete with "
        "the other jobs, which can make a run several times slower; start it with OMP_NUM_THREADS=1 (or fewer "
        "threads than the cores left free); another thread count rounds floats otherwise, so the run is another "
        "sample of those docs/studies.md measures at 1 and 2 threads: the quick start's PPO learned on 10 of 10, "
        "GRPO, RLOO and REINFORCE++ on 5 of 6 (each failing at seed 0 with one thread)")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert machine.busy_machine_warning() is None  # already one thread
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (2.9, 1.0, 1.0))
    assert machine.busy_machine_warning() is None  # the cores' worth and a little: a previous stage's tail
