"""Figures in the docs agree with what runs because each lives in one place, dated: a results table (a cell
``mean ± spread``) sits in a section that says when it was measured, and the configs quote no result (a copy in a
comment rots when the next change moves the number: ``configs/ppo.yaml`` said KL ~8.5 nats where the README's run
printed 10.25)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATE = re.compile(r"20\d\d-\d\d-\d\d")
RESULT_CELL = re.compile(r"\d ± \d")
# A result quoted in a comment: a figure with its unit or metric.
QUOTED_RESULT = re.compile(r"#.*(\d(\.\d+)? ?(nats|SD)\b|gold [+-]?\d|accuracy \d|\d ± \d)")
# Tables a study command writes (``--png-dir docs``), shown in a dated section of docs/studies.md.
GENERATED = ("family_full_table.md",)


def results_tables_without_a_date(path: Path) -> list[int]:
    """The first lines of the tables of ``path`` that hold a result but whose section (heading to heading) holds
    no date."""
    lines = path.read_text().splitlines()
    headings = [index for index, line in enumerate(lines) if line.startswith("#")]
    undated, index = [], 0
    while index < len(lines):
        if not lines[index].startswith("|"):
            index += 1
            continue
        start = index
        while index < len(lines) and lines[index].startswith("|"):
            index += 1
        if any(RESULT_CELL.search(line) for line in lines[start:index]):
            top = max([heading for heading in headings if heading < start], default=0)
            bottom = min([heading for heading in headings if heading > start], default=len(lines))
            if not any(DATE.search(line) for line in lines[top:bottom]):
                undated.append(start + 1)
    return undated


def test_every_results_table_is_dated():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    undated = {str(page.relative_to(REPO)): lines for page in pages if page.name not in GENERATED
               for lines in [results_tables_without_a_date(page)] if lines}
    assert undated == {}, "results tables with no date in their section (measured when, on what?)"


def test_a_study_table_the_page_quotes_is_the_one_its_command_wrote():
    """``--png-dir docs`` copies the study's table beside its figures; docs/studies.md shows it in its dated
    section: the two are one table, so neither can drift from the other."""
    studies = (REPO / "docs" / "studies.md").read_text()
    for name in GENERATED:
        table = (REPO / "docs" / name).read_text().strip()
        assert table in studies, f"docs/{name} is not the table docs/studies.md shows"


def test_no_config_quotes_a_result():
    quoted = [f"{path.relative_to(REPO)}:{number}" for path in sorted([*(REPO / "configs").glob("*.yaml"),
                                                                      *(REPO / "sweeps").glob("*.yaml")])
              for number, line in enumerate(path.read_text().splitlines(), 1) if QUOTED_RESULT.search(line)]
    assert quoted == [], "a config comment quotes a result: point to the doc that holds it instead"


def test_the_checks_find_what_they_look_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n\n| x | y |\n|---|---|\n| a | 1.0 ± 0.1 |\n\n# B, 2026-11-27\n\n| a | 2 ± 1 |\n")
    assert results_tables_without_a_date(page) == [3]
    assert QUOTED_RESULT.search("      coef: 0.07   # gold +2 SD at KL ~8.5 nats")
    assert not QUOTED_RESULT.search("      coef: 0.07   # moderate")
