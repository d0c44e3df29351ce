"""Modules that moved, and the import hook that keeps their old names working for a release.

:data:`MOVED_MODULES` is the one table: the command line's one-line errors read it, and
:func:`install_old_names` (called when the package is imported) makes ``import rlhf_lightning.ppo`` give the module
now at ``rlhf_lightning.stages.ppo`` -- the same module object, so classes, checkpoints that name the old class path
and pickles keep working -- with a ``FutureWarning`` that names the new place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

_STAGES = ("ppo", "grpo", "rloo", "reinforce_pp", "distill", "online_dpo", "dpo", "kto", "sft", "reward_model")

# An old module (or package) -> where it is now. The layer-table release moved the package root's modules into
# stages/, cli/, runs/ and utils/; older entries first.
MOVED_MODULES: dict[str, str] = {
    "rlhf_lightning.episodes": "rlhf_lightning.environments",
    **{f"rlhf_lightning.{name}": f"rlhf_lightning.stages.{name}" for name in _STAGES},
    "rlhf_lightning.prm": "rlhf_lightning.stages.process_reward_model",
    "rlhf_lightning.errors": "rlhf_lightning.cli.errors",
    "rlhf_lightning.quiet": "rlhf_lightning.cli.quiet",
    "rlhf_lightning.rank_failures": "rlhf_lightning.cli.rank_failures",
    "rlhf_lightning.loggers": "rlhf_lightning.cli.loggers",
    "rlhf_lightning.model_card": "rlhf_lightning.cli.model_card",
    "rlhf_lightning.merge": "rlhf_lightning.cli.merge_command",
    "rlhf_lightning.run_folder": "rlhf_lightning.runs.run_folder",
    "rlhf_lightning.resume": "rlhf_lightning.runs.resume",
    "rlhf_lightning.wandb_offline": "rlhf_lightning.runs.wandb_offline",
    "rlhf_lightning.plots": "rlhf_lightning.runs.plots",
    "rlhf_lightning.metrics": "rlhf_lightning.utils.metrics",
    "rlhf_lightning.optim": "rlhf_lightning.utils.optim",
    "rlhf_lightning.timing": "rlhf_lightning.utils.timing",
    "rlhf_lightning.core.pass_at_k": "rlhf_lightning.core.held_out_pass_at_k",
    "rlhf_lightning.rewards.process": "rlhf_lightning.rewards.process_reward",
}


def moved_module(module: str) -> str | None:
    """Where ``module`` (or a module inside a package that moved) is now, or None if it did not move."""
    if module in MOVED_MODULES:
        return MOVED_MODULES[module]
    return next((new + module[len(old):] for old, new in MOVED_MODULES.items() if module.startswith(old + ".")),
                None)


class _OldName(importlib.abc.Loader):
    """Loads an old module name as the module at its new place (the same object, under both names)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # Attributed to this file, not to the importer: that is often a library (jsonargparse reading a config,
        # torch.load), whose warnings the command line hides; this one is for the user.
        warnings.warn_explicit(f"{spec.name} moved to {self.new}: import it from there (the old name goes in the "
                               "next release)", FutureWarning, __file__, 0, module=__name__)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # importlib gave it the old name's spec: the module keeps its own


class _OldNames(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED_MODULES` (and of the modules inside a moved package)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = moved_module(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _OldName(new))


def install_old_names() -> None:
    """Put the finder of old module names on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
        sys.meta_path.append(_OldNames())
