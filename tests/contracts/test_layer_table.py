"""The layer table of docs/architecture.md is the package's own account of itself: every folder's docstring names each
of its modules (``module``), and the table holds those docstrings, one row per part of a layer in the order of
``LAYERS`` (tests/contracts/test_layers.py). ``python -m tests.helpers.layer_table`` writes it; a module added
without a word in its folder's docstring, a docstring changed without the table, or a page naming a module that
is gone fails here with the file and what to add."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.layer_table import (
    BEGIN,
    COMMAND,
    END,
    PACKAGE,
    PAGE,
    layers,
    parts_of,
    render,
    table_of,
    titles_of,
    written,
)


def modules_of(folder: Path) -> list[str]:
    """A folder's modules: its ``*.py`` but ``__init__``, and its subpackages."""
    files = [path.stem for path in folder.glob("*.py") if path.stem != "__init__"]
    packages = [path.name for path in folder.iterdir() if (path / "__init__.py").exists()]
    return sorted(files + packages)


def unnamed_modules(package: Path = PACKAGE) -> list[str]:
    """One line per module that its folder's docstring does not name as ``module``, saying where to add it."""
    problems = []
    for init in sorted(package.glob("*/__init__.py")):
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        named = set(re.findall(r"``(\w+)(?:\.py)?``", text))
        problems += [f"{init.relative_to(package.parent)}: its docstring does not name {init.parent.name}/{module}.py; "
                     f"add what it holds, followed by (``{module}``), then run {COMMAND}"
                     for module in modules_of(init.parent) if module not in named]
    return problems


def missing_module_paths(page: str, package: Path = PACKAGE) -> list[str]:
    """The modules ``page`` names that do not exist: a ``folder/module.py`` path whose folder is a part of the package
    (``core/overlap.py``, ``rlhf_lightning/rollout/producer.py``), or a bare ``module.py`` that no folder holds."""
    folders = {path.parent.name for path in package.glob("*/__init__.py")}
    paths = re.findall(r"(?<![\w./-])(?:rlhf_lightning/)?(\w+)/(\w+)\.py\b", page)
    missing = {f"{folder}/{module}.py" for folder, module in paths
               if folder in folders and not (package / folder / f"{module}.py").exists()}
    anywhere = {path.name for path in package.rglob("*.py")}
    missing |= {name for name in re.findall(r"(?<![\w./-])(\w+\.py)\b", page) if name not in anywhere}
    return sorted(missing)


def test_every_module_is_named_in_its_folders_docstring():
    problems = unnamed_modules()
    assert not problems, "\n".join(problems)


def test_the_table_has_one_row_per_part_of_each_layer_in_order():
    table = table_of(PAGE.read_text())
    expected = [list(names) for names in layers()]
    assert parts_of(table) == expected, (
        f"docs/architecture.md: the layer table's parts are {parts_of(table)}, LAYERS in "
        f"tests/contracts/test_layers.py says {expected}; run {COMMAND}")
    assert len(titles_of(table)) == len(expected), (
        f"docs/architecture.md: {len(titles_of(table))} layer titles for {len(expected)} layers; write the new "
        f"layer's title in the first cell of its first row")


def difference(old: str, new: str) -> str:
    """Where a row of the table and its docstring part: the part and a few words either side."""
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    part = (old.split("|") + ["", "", ""])[2].strip() or "the header"
    return f"  {part}, page:       ...{old[max(0, at - 60):at + 60]}...\n" \
           f"  {' ' * len(part)}  docstring:  ...{new[max(0, at - 60):at + 60]}..."


def test_the_table_is_the_docstrings():
    page = PAGE.read_text()
    table = table_of(page)
    expected = render(titles_of(table))
    stale = [difference(old, new) for old, new in zip(table.splitlines(), expected.splitlines(), strict=False)
             if old != new]
    assert table == expected, (
        f"docs/architecture.md: the layer table is not what the docstrings of the package say; run {COMMAND} "
        f"to rewrite it (edit a folder's docstring, not the table). Rows that differ:\n" + "\n".join(stale))


def test_the_page_names_no_module_that_does_not_exist():
    missing = missing_module_paths(PAGE.read_text())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}; name the module that " \
                        f"holds it now, or drop it"


# ---- the checks can fail ------------------------------------------------------------------------------------------


def small_package(root: Path) -> Path:
    package = root / "rlhf_lightning"
    for folder, doc in [("utils", "What every layer may use: checks (``checks``)."),
                        ("core", "What every stage shares: the loop (``online``).")]:
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text(f'"""{doc}"""\n')
    (package / "utils" / "checks.py").write_text("")
    (package / "core" / "online.py").write_text("")
    (package / "__init__.py").write_text('"""The package."""\n')
    return package


def test_a_module_its_folder_does_not_name_is_reported_with_where_to_add_it(tmp_path):
    package = small_package(tmp_path)
    assert unnamed_modules(package) == []
    (package / "core" / "overlap.py").write_text("")
    assert unnamed_modules(package) == [
        f"rlhf_lightning/core/__init__.py: its docstring does not name core/overlap.py; add what it holds, followed "
        f"by (``overlap``), then run {COMMAND}"]


def test_a_changed_docstring_or_a_new_part_changes_the_table(tmp_path):
    package = small_package(tmp_path)
    layer_names = [("utils",), ("core", "__init__")]
    table = render(["1. below", "2. above"], package, layer_names)
    assert parts_of(table) == [["utils"], ["core", "__init__"]] and titles_of(table) == ["1. below", "2. above"]
    assert "| 2. above | `core/` | What every stage shares: the loop (`online`). |" in table.splitlines()
    assert "|  | `__init__.py` | The package. |" in table.splitlines()
    (package / "core" / "__init__.py").write_text('"""What every stage shares: the loop (``online``), rollouts drawn '
                                                  'ahead (:mod:`~rlhf_lightning.core.overlap`)."""\n')
    assert render(["1. below", "2. above"], package, layer_names) != table
    page = f"# A\n\n{BEGIN}\n\n{table}\n\n{END}\n\nAfter.\n"
    rewritten = written(page, package, layer_names)
    assert "drawn ahead (`rlhf_lightning.core.overlap`)." in rewritten
    assert rewritten.startswith(f"# A\n\n{BEGIN}\n\n| layer |") and rewritten.endswith(f"|\n\n{END}\n\nAfter.\n")
    (package / "stages").mkdir()
    (package / "stages" / "__init__.py").write_text('"""One module per stage."""\n')
    grown = render(["1. below", "2. above"], package, [*layer_names, ("stages",)])
    assert "| 3. | `stages/` | One module per stage. |" in grown.splitlines()


def test_a_module_path_that_is_gone_is_reported(tmp_path):
    package = small_package(tmp_path)
    page = ("`core/online.py`, `rlhf_lightning/core/overlap.py`, `utils/checks.py`, `configs/ppo.yaml`, "
            "`benchmarks/core/bench.py`, (`checks.py`, `overlap.py`), `utils/gone.py`")
    assert missing_module_paths(page, package) == ["core/overlap.py", "overlap.py", "utils/gone.py"]
