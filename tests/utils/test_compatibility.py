"""Every old name, in one module (``rlhf_lightning/utils/compatibility.py``), answers as it did until the release
that removes it: a moved module imports as the same module object at its new place with a FutureWarning naming it
(the module's own spec kept), a moved argument is refused in one line naming its new key, a renamed hook is refused
when a subclass defines it, and the one-line errors read the same tables. Once the package's version reaches
:data:`REMOVED_IN`, a test here fails until the module is deleted."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest
from packaging.version import Version

import rlhf_lightning
from rlhf_lightning.cli.errors import unknown_class
from rlhf_lightning.utils.checks import GROUP_CLASSES
from rlhf_lightning.utils.compatibility import (
    MOVED_ARGUMENTS,
    MOVED_INTO_GROUPS,
    MOVED_MODULES,
    REMOVED_IN,
    RENAMED_HOOKS,
    _OldNames,
    moved_arguments,
    moved_module,
    renamed_hooks,
)
from tests.helpers.cli import REPO


def versions_past_removal(versions: dict[str, str]) -> list[str]:
    """The ``place: version`` of ``versions`` at or past :data:`REMOVED_IN`."""
    return [f"{place}: {version}" for place, version in versions.items() if Version(version) >= Version(REMOVED_IN)]


def test_the_compatibility_module_goes_in_its_release():
    pyproject = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    versions = {"pyproject.toml": pyproject.group(1), "rlhf_lightning.__version__": rlhf_lightning.__version__}
    reached = versions_past_removal(versions)
    assert not reached, (
        f"the package is at {', '.join(reached)}, at or past {REMOVED_IN}, the release that removes the old names: "
        "delete rlhf_lightning/utils/compatibility.py (with the lines that import it and install_old_names() in "
        "rlhf_lightning/__init__.py) and this test file")


def test_the_version_check_can_fail():
    assert versions_past_removal({"a": REMOVED_IN, "b": "99.0", "c": "0.1.0", "d": "0.2.9"}) == [
        f"a: {REMOVED_IN}", "b: 99.0"]


# ---- moved modules --------------------------------------------------------------------------------------------------

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


def test_the_import_hook_is_one_finder_last_on_the_path_that_answers_the_old_names_only():
    """Importing the package adds one finder (the module's docstring says why one is needed), after Python's own;
    it answers nothing but the table's names, so no other import goes through it."""
    code = ("import sys; before = list(sys.meta_path); import rlhf_lightning; "
            "print([type(finder).__name__ for finder in sys.meta_path if finder not in before])")
    added = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert added.stdout.split() == ["['_OldNames']"], added.stderr
    assert [type(finder) for finder in sys.meta_path].count(_OldNames) == 1
    finder = next(finder for finder in sys.meta_path if isinstance(finder, _OldNames))
    for name in ("numpy", "rlhf_lightning", "rlhf_lightning.stages.ppo", "rlhf_lightning.ppo_extra", "ppo"):
        assert finder.find_spec(name) is None, name
    assert finder.find_spec("rlhf_lightning.ppo").name == "rlhf_lightning.ppo"


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


# ---- moved arguments and renamed hooks ----------------------------------------------------------------------------

@pytest.mark.parametrize("old", sorted(MOVED_ARGUMENTS))
def test_every_moved_argument_is_refused_in_one_line_naming_its_new_key(old):
    group, field = MOVED_ARGUMENTS[old].split(".")
    with pytest.raises(TypeError, match=rf"^PPO\({old}=\.\.\.\): {old} is now {group}\.{field}; pass {group}=") as error:
        moved_arguments("PPO", ["beta", old])
    assert "\n" not in str(error.value) and f"write {group}: {{{field}: ...}} in a config" in str(error.value)
    assert MOVED_INTO_GROUPS[old] == (group, MOVED_ARGUMENTS[old])  # the command line names the same key
    moved_arguments("PPO", ["beta", group])  # the new names pass


# The flat arguments that became the fields of episodes, asynchronous and loss, and their new keys.
EPISODES_ASYNCHRONOUS_AND_LOSS = {
    "environment": "episodes.environment", "max_turns": "episodes.max_turns", "max_episode_tokens": "episodes.max_tokens",
    "max_staleness": "asynchronous.max_staleness", "rollout_timeout": "asynchronous.rollout_timeout",
    "loss_aggregation": "loss.aggregation", "mask_truncated_completions": "loss.mask_truncated_completions",
    "ent_coef": "loss.ent_coef", "ptx_coef": "loss.ptx_coef",
}


@pytest.mark.parametrize("old", sorted(EPISODES_ASYNCHRONOUS_AND_LOSS))
def test_the_old_names_of_episodes_asynchronous_and_loss_are_refused_naming_their_new_keys(old):
    """The table holds each of them (the test above reads the table, so it cannot miss one the table lacks), a
    class that takes the group is told the new key, and one that does not (online DPO has no ``loss``) is not."""
    new = EPISODES_ASYNCHRONOUS_AND_LOSS[old]
    group, field = new.split(".")
    assert MOVED_ARGUMENTS[old] == new and MOVED_INTO_GROUPS[old] == (group, new)
    with pytest.raises(TypeError) as error:
        moved_arguments("GRPO", [old], ["base", "episodes", "asynchronous", "loss"])
    assert str(error.value) == (f"GRPO({old}=...): {old} is now {new}; pass {group}={{'{field}': ...}} (its other "
                                f"fields keep the module's defaults) or {GROUP_CLASSES[group]}(...), or write "
                                f"{group}: {{{field}: ...}} in a config")
    moved_arguments("NoGroups", [old], ["base", "beta"])  # a class without the group: its own error, not this one


def test_every_renamed_hook_is_refused_in_one_line_naming_what_took_its_place():
    for name, new in RENAMED_HOOKS.items():
        with pytest.raises(TypeError, match=rf"^Mine\.{name}: the loop no longer reads '{name}'; ") as error:
            renamed_hooks(type("Mine", (), {name: True}))
        assert str(error.value).endswith(new) and "\n" not in str(error.value)
    renamed_hooks(type("Mine", (), {"collect_experience": True, "pass_settings": True}))
