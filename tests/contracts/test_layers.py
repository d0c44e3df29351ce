"""The package's layers point one way: every import of the package (at module level or inside a function) goes to
its own layer or one below, and no modules import each other in a circle. The layers, bottom up, are in
:data:`LAYERS`; the architecture page of the docs draws the same picture."""

from __future__ import annotations

import ast
import functools
import itertools
import re
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
    ("callbacks", "cli", "evaluation", "study", "serving", "__init__", "__main__"),  # around the modules
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
    """rollout/ draws tokens and runs episodes, and knows no reward source, no experience, no LightningModule."""
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


# ---- the tree is the layer table ----------------------------------------------------------------------------------

README = PACKAGE.parent / "README.md"
ENTRY_FILES = ("__init__", "__main__")


def layout_lines(readme: str) -> list[list[str]]:
    """The README's Layout block, one list of names per layer line: the folders (``core``) and entry files
    (``__init__``) that start each line under ``rlhf_lightning/``, up to its description; lines of description
    alone (deeper indent) are skipped."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    lines = []
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            names = list(itertools.takewhile(lambda word: re.fullmatch(r"\w+/|__\w+__\.py", word), line.split()))
            lines.append([name.rstrip("/").removesuffix(".py") for name in names])
    return [names for names in lines if names]


def test_the_package_root_holds_its_two_entry_files_and_one_folder_per_part_of_a_layer():
    entries = {path.name.removesuffix(".py") for path in PACKAGE.iterdir() if path.name != "__pycache__"}
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    layered = {name for names in LAYERS for name in names}
    assert entries == layered, f"in the package, not in LAYERS: {entries - layered}; in LAYERS only: {layered - entries}"
    assert entries - folders == set(ENTRY_FILES), "the package root holds folders and its two entry files only"
    assert all((PACKAGE / folder / "__init__.py").exists() for folder in folders)


def test_the_readme_layout_lists_the_layers_bottom_up_one_line_each():
    assert layout_lines(README.read_text()) == [list(names) for names in LAYERS]


def test_the_layout_reader_takes_the_names_before_a_lines_description():
    readme = "## Layout\n\n```\nrlhf_lightning/\n  utils/ runs/    words core/ in a description\n" \
             "                  more words\n  core/\nconfigs/  one YAML\n```\n"
    assert layout_lines(readme) == [["utils", "runs"], ["core"]]


def test_every_module_of_every_folder_is_named_in_its_folders_docstring():
    unnamed = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        unnamed += [f"{init.parent.name}/{module.name}" for module in sorted(init.parent.glob("*.py"))
                    if module.stem != "__init__" and not re.search(rf"\b{module.stem}\b", docstring)]
    assert not unnamed, f"modules their folder's __init__ docstring does not name: {unnamed}"
