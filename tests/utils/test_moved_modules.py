"""Modules that moved keep their old names for a release: the same module object under both, a FutureWarning that
names the new place, the module's own spec kept; the one-line errors read the same table."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import rlhf_lightning
from rlhf_lightning.cli.errors import unknown_class
from rlhf_lightning.utils.moved_modules import MOVED_MODULES, moved_module
from tests.helpers.cli import REPO


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_every_old_name_imports_the_module_at_its_new_place_with_a_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=f"{old} moved to {MOVED_MODULES[old]}: import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED_MODULES[old])
    assert module.__spec__.name == MOVED_MODULES[old] and module.__name__ == MOVED_MODULES[old]


def test_the_old_names_of_classes_are_the_classes():
    for old in ("rlhf_lightning.ppo", "rlhf_lightning.loggers"):
        sys.modules.pop(old, None)
    with pytest.warns(FutureWarning):
        from rlhf_lightning.loggers import WandbLogger
        from rlhf_lightning.ppo import PPO
    assert PPO is rlhf_lightning.PPO and WandbLogger.__module__ == "rlhf_lightning.cli.loggers"


def test_a_module_inside_a_moved_package_moves_with_it_and_other_names_stay_unknown():
    assert moved_module("rlhf_lightning.episodes.environment") == "rlhf_lightning.environments.environment"
    assert moved_module("rlhf_lightning.stages.ppo") is None and moved_module("rlhf_lightning.ppo_extra") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rlhf_lightning.no_such_module")


@pytest.mark.slow
def test_a_config_naming_an_old_class_path_runs_and_says_where_it_moved(tmp_path):
    """``--print_config`` with the last release's class paths: it parses, and the warning names the new ones."""
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_lightning", "fit", "--config", str(REPO / "configs" / "ppo.yaml"),
         "--model.class_path=rlhf_lightning.ppo.PPO",
         "--trainer.logger.class_path=rlhf_lightning.loggers.WandbLogger", "--print_config"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "class_path: rlhf_lightning.ppo.PPO" in result.stdout
    assert "rlhf_lightning.ppo moved to rlhf_lightning.stages.ppo" in result.stderr


def test_a_name_the_module_does_not_have_says_where_the_module_went():
    assert unknown_class("model.init_args.environment", "rlhf_lightning.episodes.Nothing") == (
        "model.init_args.environment: rlhf_lightning.episodes.Nothing: rlhf_lightning.episodes moved to "
        "rlhf_lightning.environments; write rlhf_lightning.environments.Nothing")
