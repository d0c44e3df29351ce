"""A fit whose files could not be written stops before anything is built or trained, with one line naming the
folder and what is wrong: a read-only run folder (through the real command line, in a process of its own), an
export folder that is a file (which would otherwise fail at the very end, the trained model lost), from the command
line and from Python."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

from rlhf_lightning import SFT, SFTDataModule
from rlhf_lightning.cli import main
from rlhf_lightning.cli.errors import TRACEBACK_ENV
from rlhf_lightning.models.spec import BaseModelSpec
from tests.helpers.cli import error_lines, one_line
from tests.helpers.environment import with_repo_on_path
from tests.helpers.preemption import COMMON, stage

REPO = Path(__file__).resolve().parents[2]


def permission_bits_bind() -> list[str]:
    """A command prefix under which a folder's permission bits bind the process: none for a user; for root (whose
    capabilities write anywhere) setpriv, dropping the capability that overrides them."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only folder cannot bind this process")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def sft_arguments(tiny_model_dir: Path, *extra: str) -> list[str]:
    return ["fit", *stage("sft", tiny_model_dir, tiny_model_dir)[0], *COMMON, "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0", *extra]


@pytest.mark.slow
def test_a_read_only_run_folder_is_one_line_before_anything_runs(tiny_model_dir, tmp_path):
    run_folder = tmp_path / "read-only"
    run_folder.mkdir()
    run_folder.chmod(0o555)
    env = with_repo_on_path()
    env.pop(TRACEBACK_ENV, None)
    try:
        result = subprocess.run(
            [*permission_bits_bind(), sys.executable, "-m", "rlhf_lightning",
             *sft_arguments(tiny_model_dir, f"--trainer.default_root_dir={run_folder}")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    finally:
        run_folder.chmod(0o755)
    assert result.returncode == 1, result.stderr[-2000:]
    assert error_lines(result.stderr) == [
        f"error: run folder {run_folder} is not writable: the fit writes its config, checkpoints and logs there; "
        "make it writable, or give another with --trainer.default_root_dir=DIR"]
    assert "Traceback" not in result.stderr


def test_an_export_folder_that_is_a_file_is_one_line_before_the_fit(tiny_model_dir, capsys):
    run_folder = Path("outputs/sft")
    run_folder.mkdir(parents=True)
    (run_folder / "model").write_text("not a folder")  # the config's export_dir: model
    assert one_line(capsys, *sft_arguments(tiny_model_dir)) == (
        f"error: export folder {run_folder / 'model'} is a file, not a folder: the fit writes the trained model there "
        "at its end; move that file away, or give another with --model.init_args.export_dir=DIR")
    assert sorted(path.name for path in run_folder.iterdir()) == ["model"]  # no config, no checkpoint: nothing ran
    # A run folder under a file cannot be made either.
    assert one_line(capsys, *sft_arguments(tiny_model_dir, "--trainer.default_root_dir=outputs/sft/model/run")) == (
        f"error: run folder {run_folder / 'model' / 'run'} cannot be made ({run_folder / 'model'} is a file): the fit "
        "writes its config, checkpoints and logs there; move that file away, or give another with "
        "--trainer.default_root_dir=DIR")


def test_from_python_the_export_folder_is_checked_at_setup_before_the_model_is_built(tiny_model_dir, tmp_path):
    (tmp_path / "export").write_text("not a folder")
    module = SFT(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), export_dir=str(tmp_path / "export"))
    trainer = L.Trainer(default_root_dir=tmp_path / "run", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(NotADirectoryError, match=f"^export folder {tmp_path / 'export'} is a file, not a folder: "):
        trainer.fit(module, datamodule=SFTDataModule(synthetic_rows=40, batch_size=4))
    assert module.model is None  # refused before configure_model read a weight


def test_resuming_a_run_folder_that_holds_a_run_but_no_checkpoint_is_refused(tiny_model_dir, capsys):
    """``--ckpt_path last`` where a run ran but wrote no checkpoint (it stopped before its first) would start from
    zero behind the user's back, mixing two runs in one folder: refused. An empty folder starts afresh (the
    requeue pattern of docs/checkpoints.md: a job's first start has nothing to continue)."""
    run_folder = Path("outputs/sft")
    earlier = run_folder / "wandb" / "offline-run-20261127_070000-abc123" / "run-abc123.wandb"
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"")
    assert one_line(capsys, *sft_arguments(tiny_model_dir, "--ckpt_path=last")) == (
        f"error: --ckpt_path last: run folder {run_folder} holds a run ({run_folder / 'wandb'} (1 W&B run)) but no "
        "checkpoint to continue it from (it stopped before its first); start afresh in another folder with "
        "--trainer.default_root_dir=DIR, or remove those files to start afresh there")
    assert not (run_folder / "checkpoints").exists()
    main(sft_arguments(tiny_model_dir, "--ckpt_path=last", "--trainer.default_root_dir=outputs/fresh"))
    assert sorted(path.name for path in Path("outputs/fresh/checkpoints").iterdir()) == ["last.ckpt"]


def test_resuming_a_finished_run_trains_nothing_and_leaves_its_files_alone(tiny_model_dir, capsys):
    """``--ckpt_path last`` on a run that reached its bounds (what the 'already holds a run' error recommends):
    one line, no fit, the exports and their model card as they were, no new W&B run."""
    arguments = sft_arguments(tiny_model_dir, "--trainer.logger=rlhf_lightning.cli.loggers.WandbLogger",
                              "--trainer.logger.init_args.offline=true")
    main(arguments)
    run_folder = Path("outputs/sft")
    card = (run_folder / "model" / "README.md").read_text()
    before = {path: path.stat().st_mtime_ns for path in run_folder.rglob("*") if path.is_file()}
    capsys.readouterr()
    main([*arguments, "--ckpt_path=last"])
    assert capsys.readouterr().out == (
        f"nothing to train: checkpoint {run_folder / 'checkpoints' / 'last.ckpt'} is of a finished run "
        "(trainer.max_steps=1 reached after 1 optimizer step); raise trainer.max_epochs or trainer.max_steps to train further\n")
    assert {path: path.stat().st_mtime_ns for path in run_folder.rglob("*") if path.is_file()} == before
    assert (run_folder / "model" / "README.md").read_text() == card


def test_a_finished_run_whose_export_is_missing_exports_it_from_its_checkpoint_and_trains_nothing(tiny_model_dir,
                                                                                                 capsys):
    """A run stopped after its last checkpoint but before its fit's end (killed while exporting) resumes into its
    fit's end: the export is written from the checkpoint's weights, nothing trains, and the checkpoint stays."""
    main(sft_arguments(tiny_model_dir))
    run_folder = Path("outputs/sft")
    export = run_folder / "model"
    written = {path.relative_to(export): path.read_bytes() for path in export.rglob("*") if path.is_file()}
    checkpoint = (run_folder / "checkpoints" / "last.ckpt").read_bytes()
    shutil.rmtree(export)
    capsys.readouterr()
    main([*sft_arguments(tiny_model_dir), "--ckpt_path=last"])
    assert capsys.readouterr().out.startswith(
        f"checkpoint {run_folder / 'checkpoints' / 'last.ckpt'} is of a finished run (trainer.max_steps=1 reached after "
        f"1 optimizer step) whose export {export} is missing: exporting it from the checkpoint, nothing trains\n")
    again = {path.relative_to(export): path.read_bytes() for path in export.rglob("*") if path.is_file()}
    weights = [name for name in written if name.suffix == ".safetensors"]
    assert weights and all(again[name] == written[name] for name in weights)  # the same trained weights
    assert (run_folder / "checkpoints" / "last.ckpt").read_bytes() == checkpoint  # no step was taken


def test_the_lines_show_a_run_folders_files_as_the_user_wrote_the_folder(tiny_model_dir, capsys):
    """Relative stays relative: the checkpoint folder (which the checkpoint callback resolves) is shown under the run
    folder as given, as the docs show it."""
    checkpoints = Path("outputs/sft/checkpoints")
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"")
    assert one_line(capsys, *sft_arguments(tiny_model_dir)) == (
        f"error: run folder outputs/sft already holds a run: {checkpoints} (1 checkpoint); continue that run with "
        "--ckpt_path last, or give this one its own folder with --trainer.default_root_dir=DIR (or remove those "
        "files)")
