"""The methods a subclass overrides to change one step of the on-policy loop (docs/ppo.md, "Extending by
subclassing") are what the page says: each is defined by every class its row names, with the parameters its row
shows, and the loop's steps are the module's methods or its two parts' (``collector``, ``updater``)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import rlhf_lightning as r
from rlhf_lightning.core.collect import Collector
from rlhf_lightning.core.online import OnlineRL
from rlhf_lightning.core.policy_gradient import PolicyGradient
from rlhf_lightning.core.update import PolicyUpdate

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ppo.md"
CLASSES = {"OnlineRL": OnlineRL, "PolicyGradient": PolicyGradient, "PPO": r.PPO}
METHOD = re.compile(r"`(\w+)\((self(?:, \w+)*)\)`")


def documented_hooks() -> list[tuple[str, list[str], list[str]]]:
    """``(method, its parameters, the classes that define it)`` of each row of the page's table."""
    section = PAGE.read_text().split("## Extending by subclassing", 1)[1].split("\n## ", 1)[0]
    hooks = []
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        methods, classes = row.split(" | ")[:2]
        named = re.findall(r"`(\w+)`", classes.split(" (")[0])
        for name, parameters in METHOD.findall(methods):
            hooks.append((name, parameters.split(", "), named))
    return hooks


def test_every_documented_hook_is_defined_where_the_page_says_with_its_parameters():
    hooks = documented_hooks()
    assert {"estimate_advantages", "shape_rewards", "extend_experience", "prepare_update", "loss", "micro_step",
            "step_normalisers", "evaluate_extra"} <= {name for name, _, _ in hooks}
    for name, parameters, classes in hooks:
        assert classes, name
        for owner in classes:
            cls = CLASSES[owner]
            assert name in vars(cls), f"docs/ppo.md: {owner} does not define {name}"
            assert list(inspect.signature(vars(cls)[name]).parameters) == parameters, (owner, name)


def test_the_loops_steps_are_the_modules_or_its_parts():
    source = inspect.getsource(OnlineRL.training_step)
    for step in ("self.collect_experience(", "self.collector.early_first_pass(", "self.shape_rewards(",
                 "self.prepare_update(", "self.updater.run(", "self.end_iteration("):
        assert step in source, step
    assert "self.micro_step(" not in source and "module.micro_step(" in inspect.getsource(PolicyUpdate.run)
    assert "module.extend_experience(" not in inspect.getsource(Collector)  # the module calls its own hook
