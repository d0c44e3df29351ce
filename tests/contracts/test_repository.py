"""Repository hygiene that CI relies on."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tests.helpers.workers import threads_per_worker

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
    # both suites in two pytest-xdist workers, a file to a worker: on CI's two cores about 11 + 6 minutes, not 19 + 11
    assert tests.count("pytest -n 2 --dist loadfile") == 1 and tests.count("pytest -m vllm -n 2 --dist loadfile") == 1


def test_each_xdist_worker_runs_torch_on_its_share_of_the_cores():
    assert threads_per_worker({}, 2) is None and threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "1"}, 2) is None
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "2"}, 2) == 1
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "2"}, 16) == 8
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "4"}, 2) == 1  # never none
    assert threads_per_worker({"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}, 2) is None  # the user's
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:  # this worker, as the conftest set it up
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_setup_commands_pin_the_cpu_torch_before_installing_the_package():
    for command in _readme_commands():
        assert command.index("pip install torch==2.13.0") < command.index("pip install -e")
    assert '"torch>=2.4"' in (REPO / "pyproject.toml").read_text()  # open range for GPU users


def test_changelog_has_an_unreleased_section():
    assert "## [Unreleased]" in (REPO / "CHANGELOG.md").read_text()
