"""W&B logging that works on a laptop with no account: offline unless an API key is configured."""

from __future__ import annotations

import configparser
import contextlib
import netrc
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lightning.runs.wandb_offline import has_history, wait_until_finished

DEFAULT_HOST = "api.wandb.ai"
GLOBAL_STEP = "trainer/global_step"  # the x-axis of every row, as Lightning's W&B logger names it
FINISH_TIMEOUT_SECONDS = 60.0  # how long finalize waits for W&B's service process to write a finished run


def wandb_host() -> str:
    """The W&B server's host: ``WANDB_BASE_URL``, else the ``base_url`` that ``wandb login --host`` stored in
    W&B's settings file, else the public cloud."""
    url = os.environ.get("WANDB_BASE_URL")
    if not url:
        config_dir = Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb"))
        settings = configparser.ConfigParser()
        with contextlib.suppress(configparser.Error):  # a broken settings file is W&B's to report
            settings.read(config_dir / "settings")
        url = settings.get("default", "base_url", fallback=f"https://{DEFAULT_HOST}")
    return urlparse(url).hostname or DEFAULT_HOST


def wandb_api_key_configured() -> bool:
    """Whether W&B can authenticate: ``WANDB_API_KEY``, an identity token file, or a ``.netrc`` entry for the
    W&B host (see :func:`wandb_host`), as ``wandb login`` writes. A run started by a sweep agent counts too:
    the agent could only reach its sweep with working credentials."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    if os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        return True
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(wandb_host()) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def offline_run_folder(run_file: str | Path) -> bool:
    """Whether ``run_file`` lies in an offline run's folder (``offline-run-<time>-<id>``)."""
    return Path(run_file).parent.name.startswith("offline-run-")


def remove_run(run_folder: Path) -> None:
    """Delete an offline run's folder, and the links W&B left to it (``latest-run``, ``debug*.log``)."""
    shutil.rmtree(run_folder, ignore_errors=True)
    wandb_folder = run_folder.parent
    for path in wandb_folder.iterdir():
        if path.is_symlink() and not path.exists():
            path.unlink()
    with contextlib.suppress(OSError):  # only when nothing else is left in it
        wandb_folder.rmdir()


class WandbLogger(LightningWandbLogger):
    """Lightning's ``WandbLogger``, offline automatically when no W&B API key is configured.

    An offline run is written under ``save_dir/wandb`` and can be uploaded later with ``wandb sync``.
    ``WANDB_MODE=disabled`` in the environment turns W&B off entirely.

    Args:
        project: W&B project.
        name: run name; null lets W&B choose.
        save_dir: folder that receives the ``wandb`` run folder; null = the run folder (the Trainer's
            ``default_root_dir``) when run from the command line, ``outputs`` otherwise.
        offline: force offline (true) or online (false); null = offline unless an API key is configured.
        log_model: upload checkpoints as W&B artifacts (online only).
        tags: W&B tags of the run.
        group: W&B group of the run (e.g. one per pipeline).
    """

    def __init__(
        self,
        project: str = "rlhf-lightning",
        name: str | None = None,
        save_dir: str | None = None,
        offline: bool | None = None,
        log_model: bool = False,
        tags: list[str] | None = None,
        group: str | None = None,
        **kwargs: Any,
    ) -> None:
        if offline is None:
            offline = not wandb_api_key_configured()
        self.follows_run_folder = save_dir is None
        save_dir = save_dir or "outputs"
        super().__init__(
            project=project, name=name, save_dir=save_dir, offline=offline, log_model=log_model and not offline,
            tags=tags, group=group, **kwargs,
        )
        self._wandb_init.pop("anonymous", None)  # deprecated in wandb, which warns about it on every run
        self.set_save_dir(save_dir)

    @property
    def experiment(self) -> Any:
        """The W&B run, started on first use; its folder is made then (a logger that follows the run folder
        leaves no empty ``outputs`` behind in the working directory)."""
        if self._experiment is None:
            Path(self._save_dir).mkdir(parents=True, exist_ok=True)
        return super().experiment

    def set_save_dir(self, save_dir: str) -> None:
        """Write the run under ``save_dir`` (before the run starts; the folder is made when it does)."""
        self._save_dir = save_dir
        # W&B's service process resolves a relative folder against its own working directory, which is the one
        # of the first run in the process: a later run from another folder would write its files elsewhere.
        self._wandb_init["dir"] = str(Path(save_dir).absolute())

    def use_run_folder(self, run_folder: str) -> None:
        """Write under the run folder when no ``save_dir`` was given."""
        if self.follows_run_folder and self._experiment is None:
            self.set_save_dir(run_folder)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Lightning's, with the row's ``trainer/global_step`` taken from the module when it logs one (the optimizer
        steps of the on-policy loop and of validation rows; Lightning's own step counts iterations there)."""
        metrics = dict(metrics)
        own = metrics.pop(GLOBAL_STEP, None)
        super().log_metrics(metrics, step if own is None else int(own))

    def finalize(self, status: str) -> None:
        """Finish the W&B run when the Trainer is done, so its data is complete on disk before the next run in
        the same process (a sweep trial, a study, a test). A later use of this logger resumes the same run."""
        super().finalize(status)
        if self._experiment is not None:
            run_file = self._experiment.settings.sync_file if self._experiment.settings.mode != "disabled" else None
            self._wandb_init.update(id=self._experiment.id, resume="allow")
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None
            if run_file and not wait_until_finished(run_file, FINISH_TIMEOUT_SECONDS):
                rank_zero_warn(f"W&B had not written the end of {run_file} {FINISH_TIMEOUT_SECONDS:.0f} s after the "
                               "run finished: reading it now may miss its last rows")
            elif run_file and status != "success" and offline_run_folder(run_file) and not has_history(run_file):
                remove_run(Path(run_file).parent)  # a run that failed before logging anything leaves nothing
