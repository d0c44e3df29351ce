"""Checkpoints survive a crash at any moment: writes are atomic, a torn or cut-short file is never loaded, and a
PPO run resumed with ckpt_path="last" after one reproduces the uninterrupted run's next iterations exactly."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from rlhf_lightning import SFT
from rlhf_lightning.callbacks import AtomicCheckpointIO, CheckpointError, IterationCheckpoint
from rlhf_lightning.runs.resume import CLASS_KEY
from rlhf_lightning.utils.atomic_io import atomic_write, checkpoint_problem, is_leftover
from rlhf_lightning.utils.compatibility import MOVED_ARGUMENTS
from tests.helpers.models import tiny_spec
from tests.helpers.online import Recorder, make_ppo, prompts

ITERATIONS = 3
STEPS_PER_ITERATION = 4  # update.epochs=2 x update.num_minibatches=2 (make_ppo's defaults)


class SimulatedKill(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way up handles it."""


class TornWriteIO(AtomicCheckpointIO):
    """Writes half of the checkpoint of step ``kill_at_step`` into ``kill_in`` and then 'dies'."""

    def __init__(self, kill_in: str, kill_at_step: int) -> None:
        super().__init__()
        self.kill_in, self.kill_at_step, self._target = kill_in, kill_at_step, ""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self._target = Path(path).name
        super().save_checkpoint(checkpoint, path, storage_options)

    def write(self, checkpoint, file) -> None:
        if self._target == self.kill_in and checkpoint["global_step"] == self.kill_at_step:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            file.flush()
            raise SimulatedKill
        super().write(checkpoint, file)


def fit_ppo(tiny_model_dir, reward_dir, directory: Path, ckpt_path: str | None = None, plugins=()):
    """``ITERATIONS`` tiny PPO iterations, a checkpoint after each (every one kept, and last.ckpt)."""
    module = make_ppo(tiny_model_dir, reward_dir, kl={"target": 0.5})
    recorder = Recorder()
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=ITERATIONS, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, plugins=list(plugins),
        callbacks=[recorder, IterationCheckpoint(dirpath=directory, every_n_iterations=1, save_top_k=-1,
                                                 save_last=True, enable_version_counter=False)],
    )
    trainer.fit(module, datamodule=prompts(module, n=8 * ITERATIONS), ckpt_path=ckpt_path)
    return recorder.rows


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, reward_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    return fit_ppo(tiny_model_dir, reward_dir, directory), directory


def step_file(directory: Path, iteration: int) -> Path:
    return directory / f"epoch=0-step={iteration * STEPS_PER_ITERATION}.ckpt"


def test_a_kill_while_writing_last_leaves_the_previous_last_and_resume_reproduces_the_run(
        tiny_model_dir, reward_dir, uninterrupted, tmp_path):
    full_rows, _ = uninterrupted
    killed = TornWriteIO(kill_in="last.ckpt", kill_at_step=2 * STEPS_PER_ITERATION)
    with pytest.raises(SimulatedKill):
        fit_ppo(tiny_model_dir, reward_dir, tmp_path, plugins=[killed])
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 1 * STEPS_PER_ITERATION  # still iteration 1's, complete
    assert checkpoint_problem(step_file(tmp_path, 2)) is None  # iteration 2's own file was written before
    # kill -9 gets no chance to remove its temp file: leave one as it would.
    leftover = tmp_path / ".last.ckpt.tmp-99999"
    leftover.write_bytes(step_file(tmp_path, 2).read_bytes()[:1000])

    resumed = fit_ppo(tiny_model_dir, reward_dir, tmp_path, ckpt_path="last")
    assert resumed == full_rows[1:]  # iterations 2 and 3, number for number
    assert not [path for path in tmp_path.iterdir() if is_leftover(path)]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == ITERATIONS * STEPS_PER_ITERATION


def test_a_cut_short_last_checkpoint_falls_back_to_the_newest_complete_one_with_a_warning(
        tiny_model_dir, reward_dir, uninterrupted, tmp_path):
    full_rows, full_dir = uninterrupted
    for iteration in (1, 2):
        shutil.copy2(step_file(full_dir, iteration), tmp_path)  # modification times kept: 2 is the newest
    (tmp_path / "last.ckpt").write_bytes(step_file(full_dir, 3).read_bytes()[:5000])  # a disk that filled up
    with pytest.warns(UserWarning, match=rf"checkpoint .*last\.ckpt: it is cut short .*resuming from the newest "
                                         rf"complete checkpoint .*epoch=0-step={2 * STEPS_PER_ITERATION}\.ckpt"):
        resumed = fit_ppo(tiny_model_dir, reward_dir, tmp_path, ckpt_path="last")
    assert resumed == full_rows[2:]


def test_an_explicit_broken_checkpoint_is_named_in_the_error(tiny_model_dir, reward_dir, uninterrupted, tmp_path):
    _, full_dir = uninterrupted
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(step_file(full_dir, 3).read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=rf"^checkpoint {broken}: it is cut short or not a torch checkpoint"):
        fit_ppo(tiny_model_dir, reward_dir, tmp_path / "run", ckpt_path=str(broken))
    with pytest.raises(FileNotFoundError, match=rf"checkpoint {tmp_path / 'missing.ckpt'}: it does not exist"):
        fit_ppo(tiny_model_dir, reward_dir, tmp_path / "run", ckpt_path=str(tmp_path / "missing.ckpt"))


def test_a_checkpoint_that_names_the_class_by_its_path_before_the_move_resumes_the_run(
        tiny_model_dir, reward_dir, uninterrupted, tmp_path, monkeypatch):
    """A checkpoint of the last release records ``rlhf_lightning.ppo.PPO`` (the module before stages/) and its
    hyper-parameters by their flat names (``kl_target``, ``max_new_tokens``, ``policy_lr``, ``max_turns``,
    ``ent_coef``: before the typed groups): it still resumes a PPO run, number for number."""
    full_rows, full_dir = uninterrupted
    checkpoint = torch.load(step_file(full_dir, 1), weights_only=False)
    assert checkpoint[CLASS_KEY] == "rlhf_lightning.stages.ppo.PPO"
    checkpoint[CLASS_KEY] = "rlhf_lightning.ppo.PPO"
    saved = checkpoint["hyper_parameters"]
    for old, new in MOVED_ARGUMENTS.items():
        group, field = new.split(".")
        if field in saved.get(group, {}):
            saved[old] = saved[group][field]
    for group in {new.split(".")[0] for new in MOVED_ARGUMENTS.values()} & saved.keys():
        del saved[group]
    assert saved["kl_target"] == 0.5 and "kl" not in saved
    assert (saved["max_turns"], saved["max_episode_tokens"], saved["max_staleness"], saved["loss_aggregation"]) == (
        4, None, 0, "token_mean")
    assert not {"episodes", "asynchronous", "loss"} & saved.keys()
    torch.save(checkpoint, tmp_path / "old.ckpt")
    # the warning comes with the old module's first import: not one an earlier test in this process made
    monkeypatch.delitem(sys.modules, "rlhf_lightning.ppo", raising=False)
    with pytest.warns(FutureWarning, match="rlhf_lightning.ppo moved to rlhf_lightning.stages.ppo"):
        resumed = fit_ppo(tiny_model_dir, reward_dir, tmp_path / "run", ckpt_path=str(tmp_path / "old.ckpt"))
    assert resumed == full_rows[1:]


def test_a_checkpoint_of_another_module_class_is_refused(uninterrupted, tmp_path):
    _, full_dir = uninterrupted
    checkpoint = step_file(full_dir, 1)
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.raises(CheckpointError) as error:
        trainer.fit(SFT(base=tiny_spec()), train_dataloaders=[{}], ckpt_path=str(checkpoint))
    assert str(error.value).startswith(f"checkpoint {checkpoint} was written by rlhf_lightning.stages.ppo.PPO, but this "
                                       "run's model is rlhf_lightning.stages.sft.SFT")


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_write(path, lambda file: torch.save({"step": 1}, file))

    def disk_full(file) -> None:
        file.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, disk_full)
    assert torch.load(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
