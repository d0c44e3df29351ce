"""The package's layers point one way: every import of the package (at module level or inside a function) goes to
its own layer or one below, and no modules import each other in a circle. The layers, bottom up, are in
:data:`LAYERS`; the architecture page of the docs draws the same picture."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_lightning"

# bottom up: a module may import its own layer and the ones before it
LAYERS = [
    ("utils", "runs"),  # no model, no data: checks, metrics, optimizer, timing; run folders, resume, W&B reader, plots
    ("algorithms", "ops", "tasks"),  # pure math, speed code, the embedded tasks
    ("models", "data", "environments"),  # the shared base and its roles; datasets and batches; tools, environments
    ("rollout", "rewards"),  # drawing tokens (sampler, engines, the turn loop); reward sources and how they combine
    ("core",),  # the LightningModules every stage shares
    ("stages",),  # one module per algorithm or stage
    ("callbacks", "cli", "study", "serving", "__init__", "__main__"),  # around the modules
]


def part(module: str) -> str:
    """The first component under the package: ``rlhf_lightning.models.spec`` -> ``models``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(module: str) -> int:
    name = part(module)
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    raise AssertionError(f"{module} belongs to no layer: add {name!r} to LAYERS")


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache
def imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (relative imports resolved)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                if base.startswith("rlhf_lightning"):
                    targets.add(base)
            elif isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.startswith("rlhf_lightning")}
        found[name] = targets
    return found


def test_every_import_points_to_the_same_layer_or_below():
    back_arrows = [f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
                   for module, targets in imports().items() for target in targets
                   if target != "rlhf_lightning" and layer(target) > layer(module)]
    assert not back_arrows, "\n".join(back_arrows)


def test_the_low_layers_never_import_the_modules_above_them():
    """The issue's wording, checked directly: models, data, algorithms and ops know nothing of the loop."""
    above = [name for names in LAYERS[LAYERS.index(("rollout", "rewards")):] for name in names]
    for module, targets in imports().items():
        if part(module) in ("models", "data", "environments", "algorithms", "ops", "utils"):
            assert not [t for t in targets if part(t) in above], module


def test_rollout_draws_tokens_and_knows_no_reward_or_loop():
    """rollout/ does one job: no reward source, no experience, no LightningModule."""
    for module, targets in imports().items():
        if part(module) == "rollout":
            assert not [t for t in targets if part(t) in ("rewards", "core")], module


def test_no_modules_import_each_other_in_a_circle():
    graph = {module: {t for t in targets if t in imports()} for module, targets in imports().items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1  # on the current path
        for target in sorted(graph[module]):
            if target.startswith(module + ".") or module.startswith(target + "."):
                continue  # a package and its own submodules
            if state.get(target) == 1:
                raise AssertionError(" -> ".join([*path, module, target]))
            if target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_layer_test_can_fail():
    """A back-arrow is found: models importing core would be reported."""
    assert layer("rlhf_lightning.core.policy") > layer("rlhf_lightning.models.shared_base")
    assert part("rlhf_lightning.models.spec") == "models" and layer("rlhf_lightning") == len(LAYERS) - 1
