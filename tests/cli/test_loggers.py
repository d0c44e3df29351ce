"""When the W&B logger goes online: only with credentials for the configured host."""

from __future__ import annotations

import pytest

from rlhf_lightning.cli.loggers import WandbLogger, wandb_api_key_configured, wandb_host


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home: no .netrc, no W&B settings, no W&B variables."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_SWEEP_ID", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / ".config" / "wandb"))
    return tmp_path


def _login(home, host: str) -> None:
    (home / ".netrc").write_text(f"machine {host}\n  login user\n  password secret\n")


def test_no_credentials_means_offline(home):
    assert wandb_host() == "api.wandb.ai"
    assert not wandb_api_key_configured()
    assert WandbLogger(save_dir=str(home / "runs"))._offline


def test_a_netrc_entry_for_the_cloud_counts(home):
    _login(home, "api.wandb.ai")
    assert wandb_api_key_configured()


def test_self_hosted_server_from_the_environment(home, monkeypatch):
    _login(home, "wandb.example.org")
    assert not wandb_api_key_configured()  # the key is for another host than the cloud
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_api_key_configured()


def test_self_hosted_server_from_wandb_login_host(home):
    # `wandb login --host http://localhost:8080` writes the host into W&B's settings file, not the environment.
    settings = home / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\nbase_url = http://localhost:8080\n")
    _login(home, "localhost")
    assert wandb_host() == "localhost"
    assert wandb_api_key_configured()


def test_a_sweep_agent_run_goes_online_unless_told_otherwise(home, monkeypatch):
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_api_key_configured()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert not wandb_api_key_configured()


def test_a_logger_that_follows_the_run_folder_leaves_no_outputs_folder_behind(home, tmp_path, monkeypatch):
    work, run_folder = tmp_path / "work", tmp_path / "runs" / "ppo"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger()  # no save_dir: the command line gives it the run folder
    assert not (work / "outputs").exists()
    logger.use_run_folder(str(run_folder))
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert list(work.iterdir()) == []
    assert [path.name for path in run_folder.iterdir()] == ["wandb"]
