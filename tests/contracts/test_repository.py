"""Repository hygiene that CI relies on."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv .+)\n```", (REPO / "README.md").read_text())


def test_ci_runs_the_readme_test_command_verbatim():
    commands = _readme_commands()
    assert len(commands) == 2, "the README has exactly two set-up commands: main job, tests"
    main_job, tests = commands
    assert "pytest" in tests and "pytest" not in main_job
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_setup_commands_pin_the_cpu_torch_before_installing_the_package():
    for command in _readme_commands():
        assert command.index("pip install torch==2.13.0") < command.index("pip install -e")
    assert '"torch>=2.4"' in (REPO / "pyproject.toml").read_text()  # open range for GPU users


def test_changelog_has_an_unreleased_section():
    assert "## [Unreleased]" in (REPO / "CHANGELOG.md").read_text()
