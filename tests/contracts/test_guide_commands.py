"""Every command of the README and the guides runs as written: each ``python -m rlhf_lightning fit|validate ...``
of a code block or an inline command parses (config file, keys, values, class paths) from the repository root."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rlhf_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]
GUIDES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"python3? -m rlhf_lightning (fit|validate|test) ")
# Shapes of a command, not commands: placeholders, loops over shell variables, a guide's own example module.
PLACEHOLDERS = ("<", "{", "--key=value", "my_module.", "my_gpg.", "my_rewards.")
SEED = re.compile(r"=\$?\{?S\}?\b")  # --seed_everything=$S in a loop over seeds: one seed stands for all


def shell_lines(text: str) -> list[str]:
    """Lines of the guide's fenced blocks with backslash continuations joined, then its inline code spans."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return lines


def guide_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every fit/validate/test command in the README and docs/."""
    found = []
    for path in GUIDES:
        for line in shell_lines(path.read_text()):
            match = COMMAND.search(line)
            if not match or any(mark in line for mark in PLACEHOLDERS):
                continue
            command = SEED.sub("=0", line[match.start(1):].split(" #")[0].split(" && ")[0].split(";")[0])
            if "$" in command:
                continue
            argv = [word for word in shlex.split(command) if word != "..."]
            found.append((f"{path.name}: {command.strip()}", argv))
    return found


COMMANDS = guide_commands()


def test_the_guides_have_commands_to_check():
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_a_guide_command_parses_as_written(argv, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the guides' commands run from the repository root
    asks_help = any(word.endswith(".help") or word == "--help" or word == "--print_config" for word in argv)
    with pytest.raises(SystemExit) as exit_status:
        main(argv if asks_help else [*argv, "--print_config"])
    assert exit_status.value.code in (0, None), capsys.readouterr().err
