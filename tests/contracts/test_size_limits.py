"""Small files with one job each, held by a test, not by intentions: no class of the package is longer than
:data:`MAX_CLASS_LINES` lines and no module longer than :data:`MAX_MODULE_LINES`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlhf_lightning"
MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 400


def oversized(source: str, name: str) -> list[str]:
    """What in ``source`` (the text of module ``name``) exceeds the limits, one line each."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (module limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
            if size > MAX_CLASS_LINES:
                found.append(f"{name}: class {node.name} {size} lines (class limit {MAX_CLASS_LINES})")
    return found


def test_no_class_over_300_lines_and_no_module_over_400():
    found = [problem for path in sorted(PACKAGE.rglob("*.py"))
             for problem in oversized(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "\n".join(found)


def test_the_size_check_sees_a_long_class_and_a_long_module():
    long_class = "class Long:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert oversized(long_class, "m") == [f"m: class Long {MAX_CLASS_LINES + 1} lines (class limit 300)"]
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "m") == ["m: 401 lines (module limit 400)"]
    assert oversized("class Short:\n    x = 1\n", "m") == []
