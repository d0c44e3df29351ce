"""Nothing is lost when a job is stopped: a ``kill -TERM`` (or Ctrl-C, or SLURM's SIGUSR1) in the middle of a step
ends the fit at that step's end with ``last.ckpt``, one line saying where to resume from and a non-zero status,
and ``--ckpt_path last`` then continues exactly (SFT, reward model, GRPO, DPO; and GRPO under FSDP2 when only rank 0
gets the signal); a second signal stops at once without a broken file; a ``kill -9`` inside a validation loses no
validation (GRPO, DPO); and a fresh run never writes over another run's folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import STRATEGIES
from tests.helpers.environment import with_repo_on_path
from tests.helpers.preemption import COMMON, assert_same_training, drive, run, stage

REPO = Path(__file__).resolve().parents[2]


def checkpoint(kind: str, every: int) -> dict:
    if kind in ("grpo",):
        return {"class_path": "rlhf_lightning.callbacks.IterationCheckpoint",
                "init_args": {"every_n_iterations": every, "save_last": True, "enable_version_counter": False}}
    return {"class_path": "rlhf_lightning.callbacks.Checkpoint",
            "init_args": {"every_n_train_steps": every, "save_last": True, "enable_version_counter": False}}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "reward", "grpo", "dpo"])
def test_sigterm_mid_step_checkpoints_that_step_exits_143_and_resumes_exactly(tiny_model_dir, reward_dir, tmp_path,
                                                                            kind):
    arguments, per_batch = stage(kind, tiny_model_dir, reward_dir)
    batches = 4 if kind == "grpo" else 5
    arguments = [*arguments, *COMMON, f"--trainer.limit_train_batches={batches}", "--trainer.limit_val_batches=0"]
    every = 50  # periodic checkpoints far apart: the signal's checkpoint is the only one
    # the uninterrupted run, then (in the same process: one start fewer) the one signalled in batch 3
    signalled = drive(tmp_path, "signalled", [run(tmp_path, "full", arguments, checkpoint(kind, every)),
                                              run(tmp_path, "signalled", arguments, checkpoint(kind, every),
                                                  {"class_path": "tests.helpers.equivalence.SignalAt",
                                                   "init_args": {"batch": 3, "step": per_batch}})])
    last = tmp_path / "signalled" / "checkpoints" / "last.ckpt"
    assert signalled.returncode == 128 + signal.SIGTERM, signalled.stderr[-3000:]
    assert error_lines(signalled.stderr) == [
        f"error: stopped by SIGTERM after step {3 * per_batch} (training batch 3): checkpoint {last} written; "
        "resume with --ckpt_path last"]
    assert "Traceback" not in signalled.stderr
    assert ("SIGTERM received: the run stops after the current step, with a checkpoint (send it again to stop at "
            "once)\n") in signalled.stderr
    assert torch.load(last, weights_only=False)["global_step"] == 3 * per_batch  # the step of the signal
    assert not (tmp_path / "signalled" / "adapters").exists() and not (tmp_path / "signalled" / "model").exists()

    resumed = drive(tmp_path, "resumed", [run(tmp_path, "signalled", arguments, checkpoint(kind, every), resume=True)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_training(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "signalled.pt"), 4, per_batch)


@pytest.mark.slow
def test_a_signal_to_rank_0_alone_stops_every_fsdp2_rank_with_one_checkpoint(tiny_model_dir, reward_dir, tmp_path):
    arguments, per_batch = stage("grpo", tiny_model_dir, reward_dir)
    arguments = [*arguments, *COMMON, *STRATEGIES["fsdp2"], "--trainer.limit_train_batches=4",
                 "--trainer.limit_val_batches=0"]
    signalled = drive(tmp_path, "signalled", [run(tmp_path, "full", arguments, checkpoint("grpo", 50)),
                                              run(tmp_path, "signalled", arguments, checkpoint("grpo", 50),
                                                  {"class_path": "tests.helpers.equivalence.SignalAt",
                                                   "init_args": {"batch": 2, "step": 1}})])
    assert signalled.returncode == 128 + signal.SIGTERM, signalled.stderr[-3000:]
    assert len(error_lines(signalled.stderr)) == 1  # rank 0 says it, once
    state = torch.load(tmp_path / "signalled" / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2 * per_batch and all("lora_" in key for key in state["state_dict"])
    resumed = drive(tmp_path, "resumed", [run(tmp_path, "signalled", arguments, checkpoint("grpo", 50), resume=True)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_training(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "signalled.pt"), 3, per_batch)


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_leaves_the_last_complete_checkpoint(tiny_model_dir, reward_dir, tmp_path):
    arguments, _ = stage("sft", tiny_model_dir, reward_dir)
    arguments = [*arguments, *COMMON, "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=0"]
    twice = [{"class_path": "tests.helpers.equivalence.SignalAt", "init_args": {"batch": 4, "name": "SIGINT"}},
             {"class_path": "tests.helpers.equivalence.SignalAt", "init_args": {"batch": 4, "name": "SIGINT"}}]
    result = drive(tmp_path, "twice", [run(tmp_path, "twice", arguments, checkpoint("sft", 2), *twice)])
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
    assert error_lines(result.stderr) == ["error: stopped at once by a second SIGINT: nothing was saved of the "
                                          "current step (the last complete checkpoint stays as it was)"]
    folder = tmp_path / "twice" / "checkpoints"
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 2  # step 2's, complete
    assert not [path for path in folder.iterdir() if ".tmp" in path.name]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "dpo"])
def test_a_kill_9_inside_a_validation_loses_no_validation(tiny_model_dir, reward_dir, tmp_path, kind):
    """Validation after every second batch; checkpoints too, written once that validation is logged. Killed in the
    middle of the second validation, the run resumes from the first checkpoint and logs the second validation and
    the third, with the uninterrupted run's values."""
    arguments, per_batch = stage(kind, tiny_model_dir, reward_dir)
    arguments = [*arguments, *COMMON, "--trainer.limit_train_batches=6", "--trainer.val_check_interval=2",
                 "--trainer.check_val_every_n_epoch=null", "--trainer.limit_val_batches=2"]
    killed = drive(tmp_path, "killed", [run(tmp_path, "full", arguments, checkpoint(kind, 2)),
                                        run(tmp_path, "killed", arguments, checkpoint(kind, 2),
                                            {"class_path": "tests.helpers.equivalence.KillInValidation",
                                             "init_args": {"number": 3}})])  # the starting policy's is the first
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = drive(tmp_path, "resumed", [run(tmp_path, "killed", arguments, checkpoint(kind, 2), resume=True)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def validations(name: str) -> list[dict]:
        path = tmp_path / f"{name}.pt.validations.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    expected = validations("full")
    assert [v["batch"] for v in expected] == [0, 2, 4, 6] and all(len(v) > 2 for v in expected)
    logged = validations("killed")  # the killed run's, then the resumed run's
    assert sorted({v["batch"] for v in logged}) == [0, 2, 4, 6]  # every validation, none lost
    for record in logged:
        assert record == next(v for v in expected if v["batch"] == record["batch"])  # equal values
    assert_same_training(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "killed.pt"), 3, per_batch)


@pytest.mark.slow
def test_a_fresh_run_never_writes_over_another_runs_folder(tiny_model_dir, tmp_path):
    from rlhf_lightning.cli import main

    arguments = ["fit", *stage("sft", tiny_model_dir, tiny_model_dir)[0], *COMMON, "--trainer.max_steps=2",
                 "--trainer.limit_val_batches=0", "--trainer.callbacks+=rlhf_lightning.callbacks.Checkpoint",
                 "--trainer.callbacks.save_last=true"]
    main(arguments)
    run_folder = tmp_path / "outputs" / "sft"
    assert (run_folder / "model" / "config.json").exists() and (run_folder / "checkpoints" / "last.ckpt").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 1
    main([*arguments, "--trainer.default_root_dir=outputs/sft-2"])  # one setting moves all of it
    moved = tmp_path / "outputs" / "sft-2"
    assert (moved / "model" / "config.json").exists() and (moved / "checkpoints" / "last.ckpt").exists()
    main([*arguments[:-3], "--trainer.max_steps=3", *arguments[-2:], "--ckpt_path=last"])  # continue in place


@pytest.mark.slow
def test_resume_last_in_an_empty_folder_says_a_new_run_starts_and_a_resume_is_not_warned_about_its_folder(
        tiny_model_dir, capsys):
    import warnings

    from rlhf_lightning.cli import main

    arguments = ["fit", *stage("sft", tiny_model_dir, tiny_model_dir)[0], *COMMON, "--trainer.limit_val_batches=1",
                 "--trainer.max_epochs=5", "--trainer.default_root_dir=outputs/sft-new"]  # the config's last.ckpt

    def warned(command: list[str]) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            main(command)
        return [str(warning.message) for warning in caught]

    said = warned([*arguments, "--trainer.max_steps=2", "--ckpt_path=last"])  # a misspelt folder, a job's first start
    assert ("--ckpt_path last: no checkpoint to resume from (run folder outputs/sft-new does not exist): a new run "
            "starts there\n") in capsys.readouterr().out
    assert not [line for line in said if "no last checkpoint" in line]  # Lightning's HINT to set save_last
    said = warned([*arguments, "--trainer.max_steps=3", "--ckpt_path=last"])  # resumed there
    assert not [line for line in said if line.startswith("Checkpoint directory")]
    assert "a new run starts" not in capsys.readouterr().out
    assert torch.load(Path("outputs/sft-new/checkpoints/last.ckpt"), weights_only=False)["global_step"] == 3


def test_the_refusal_is_one_line_naming_the_folder_and_the_ways_on(tiny_model_dir, tmp_path, capsys):
    from rlhf_lightning.cli import main

    arguments = ["fit", *stage("sft", tiny_model_dir, tiny_model_dir)[0], *COMMON, "--trainer.max_steps=1",
                 "--trainer.limit_val_batches=0", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"]
    main(arguments)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(arguments)
    lines = error_lines(capsys.readouterr().err)
    assert lines == [f"error: run folder outputs/sft already holds a run: {Path('outputs/sft/model')} (exports); "
                     "continue that run with --ckpt_path last, or give this one its own folder with "
                     "--trainer.default_root_dir=DIR (or remove those files)"]


@pytest.mark.slow
def test_under_slurm_sigusr1_checkpoints_and_requeues_the_job(tiny_model_dir, reward_dir, tmp_path):
    """Lightning's SLURM environment (found from SLURM's variables) with its default auto_requeue: SIGUSR1 writes
    the checkpoint, then ``scontrol requeue <job>`` (a stand-in on PATH records the call: there is no SLURM here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    arguments, _ = stage("sft", tiny_model_dir, reward_dir)
    arguments = [*arguments, *COMMON, "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=0"]
    runs_file = tmp_path / "slurm.json"
    runs_file.write_text(json.dumps([run(tmp_path, "slurm", arguments, checkpoint("sft", 50),
                                         {"class_path": "tests.helpers.equivalence.SignalAt",
                                          "init_args": {"batch": 2, "name": "SIGUSR1"}})]))
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "rlhf", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "1"}
    env = with_repo_on_path(**slurm, PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "equivalence.py"), str(runs_file)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    last = tmp_path / "slurm" / "checkpoints" / "last.ckpt"
    assert error_lines(result.stderr) == [f"error: stopped by SIGUSR1 after step 2 (training batch 2): checkpoint {last} "
                                          "written; resume with --ckpt_path last; SLURM job 4242 requeued"]
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert torch.load(last, weights_only=False)["global_step"] == 2


def test_without_a_checkpoint_callback_the_signal_line_says_nothing_will_be_saved(tmp_path, capsys):
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from rlhf_lightning.callbacks import Preemption

    preemption = Preemption()
    for checkpointing, saying in ((False, "without a checkpoint (no checkpoint callback is configured: "
                                          "trainer.enable_checkpointing)"), (True, "with a checkpoint")):
        trainer = L.Trainer(enable_checkpointing=checkpointing, logger=False, default_root_dir=tmp_path)
        trainer.strategy.connect(BoringModel())
        preemption.on_train_start(trainer, trainer.lightning_module)
        try:
            preemption._handle(signal.SIGTERM, None)  # what the signal calls
        finally:
            preemption._restore()
        assert capsys.readouterr().err == (f"SIGTERM received: the run stops after the current step, {saying} "
                                           "(send it again to stop at once)\n")
