"""The layer table of ``docs/architecture.md``, written from the package: one row per part of a layer, in the order of
``LAYERS`` (``tests/contracts/test_layers.py``), each holding its part's docstring (a folder's ``__init__.py``,
an entry file's own). The layers' titles are the one hand-kept column.

``python -m tests.helpers.layer_table`` rewrites the table in place; ``tests/contracts/test_layer_table.py`` fails
when the page and the docstrings differ."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rlhf_lightning"
PAGE = REPO / "docs" / "architecture.md"
LAYERS_FILE = REPO / "tests" / "contracts" / "test_layers.py"
COMMAND = "python -m tests.helpers.layer_table"
BEGIN = f"<!-- The layer table is written from the docstrings of the package by {COMMAND}: edit those, not it. -->"
END = "<!-- The end of the layer table. -->"
HEADER = ("| layer | part of `rlhf_lightning/` | what it holds (its docstring) |\n"
          "|---|---|---|")
# An entry file that has no docstring of its own, said in the docstrings' markup.
NO_DOCSTRING = {"__main__": "``python -m rlhf_lightning``: :func:`rlhf_lightning.cli.entry.run`, which answers what it "
                            "can before the training stack is imported and hands the rest to the command line "
                            "(``cli/command_line.py``)."}


def layers(source: Path = LAYERS_FILE) -> list[tuple[str, ...]]:
    """``LAYERS`` of the layer test, read from its source (a test module is not imported)."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAYERS" for t in node.targets):
            return [tuple(names) for names in ast.literal_eval(node.value)]
    raise AssertionError(f"{source.relative_to(REPO)} defines no LAYERS")


def part_file(name: str, package: Path = PACKAGE) -> Path:
    """The file whose docstring describes part ``name``: a folder's ``__init__.py``, or the entry file itself."""
    folder = package / name / "__init__.py"
    return folder if folder.exists() else package / f"{name}.py"


def docstring(name: str, package: Path = PACKAGE) -> str:
    path = part_file(name, package)
    text = ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None
    if text is None and name in NO_DOCSTRING:
        return NO_DOCSTRING[name]
    if text is None:
        raise AssertionError(f"{path.relative_to(package.parent)} has no docstring: write one that says what it holds "
                             f"and names each of its modules (``module``), then run {COMMAND}")
    return text


def markdown(text: str) -> str:
    """A docstring as one table cell: reST literals and roles as code spans, bullets and lines run together."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", text)
    text = re.sub(r"``(.+?)``", lambda m: "`" + m.group(1) + "`", text, flags=re.S)
    text = re.sub(r"^\s*\*\s+", "", text, flags=re.M)
    return " ".join(text.split()).replace("|", "\\|")


def shown(name: str, package: Path = PACKAGE) -> str:
    return f"`{name}.py`" if (package / f"{name}.py").exists() else f"`{name}/`"


def render(titles: list[str], package: Path = PACKAGE, layer_names: list[tuple[str, ...]] | None = None) -> str:
    """The table: the layers' titles (``titles``, one per layer, bottom up), each part's row under its layer."""
    layer_names = layers() if layer_names is None else layer_names
    titles = [*titles, *(f"{index + 1}." for index in range(len(titles), len(layer_names)))][: len(layer_names)]
    rows = [f"| {title if index == 0 else ''} | {shown(name, package)} | {markdown(docstring(name, package))} |"
            for title, names in zip(titles, layer_names, strict=True) for index, name in enumerate(names)]
    return "\n".join([HEADER, *rows])


def table_of(page: str) -> str:
    """The table between the markers of ``page`` (the page's text)."""
    if BEGIN not in page or END not in page:
        raise AssertionError(f"docs/architecture.md has lost the layer table's markers; put back the lines\n{BEGIN}\n"
                             f"{END}\naround it and run {COMMAND}")
    return page.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def titles_of(table: str) -> list[str]:
    """The hand-kept layer titles: the first cells that are not empty, below the header."""
    cells = [line.split("|")[1].strip() for line in table.splitlines()[2:] if line.startswith("|")]
    return [cell for cell in cells if cell]


def parts_of(table: str) -> list[list[str]]:
    """The parts named in each layer of ``table``, as the layer test spells them (``core``, ``__init__``)."""
    grouped: list[list[str]] = []
    for line in table.splitlines()[2:]:
        cells = line.split("|")
        if len(cells) < 3:
            continue
        if cells[1].strip() or not grouped:
            grouped.append([])
        grouped[-1].append(cells[2].strip().strip("`").rstrip("/").removesuffix(".py"))
    return grouped


def written(page: str, package: Path = PACKAGE, layer_names: list[tuple[str, ...]] | None = None) -> str:
    """``page`` with its layer table written afresh."""
    table = render(titles_of(table_of(page)), package, layer_names)
    before, rest = page.split(BEGIN, 1)
    return f"{before}{BEGIN}\n\n{table}\n\n{END}{rest.split(END, 1)[1]}"


def main() -> int:
    page = PAGE.read_text()
    new = written(page)
    if new != page:
        PAGE.write_text(new)
        print(f"rewrote the layer table of {PAGE.relative_to(REPO)}")
    else:
        print(f"the layer table of {PAGE.relative_to(REPO)} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
