"""What the command line answers before the training stack is imported: the package itself imports none of it, the
command line's help, a config file that is missing or not YAML is one line, and ``plot`` draws (or refuses) without
torch, Lightning, transformers or peft."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.environment import with_repo_on_path

STACK = ("torch", "lightning", "transformers", "peft")
# Runs ``python -m rlhf_lightning`` as the command line does, then says its exit status and the stack it imported.
PROBE = f"""
import json, runpy, sys
sys.argv = ["rlhf_lightning", *json.loads(sys.argv[1])]
try:
    runpy.run_module("rlhf_lightning", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exit:
    code = exit.code
print(json.dumps([code, [name for name in {STACK!r} if name in sys.modules]]))
"""


def probe(tmp_path, *arguments: str) -> tuple[int, list[str], str]:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(arguments)], cwd=tmp_path, env=with_repo_on_path(),
                          capture_output=True, text=True, timeout=120)
    code, imported = json.loads(done.stdout.strip().splitlines()[-1])
    return code, imported, done.stderr


@pytest.mark.slow  # a subprocess importing the training stack
def test_importing_the_package_imports_no_training_stack_until_a_name_is_used(tmp_path):
    code = (f"import sys, rlhf_lightning; before = [m for m in {STACK!r} if m in sys.modules]; rlhf_lightning.SFT; "
            "print(before, 'lightning' in sys.modules, 'SFT' in dir(rlhf_lightning))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=with_repo_on_path(), capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == ["[]", "True", "True"], done.stderr[-2000:]


def test_the_command_lines_help_needs_no_stack(tmp_path):
    from rlhf_lightning.cli.early import HELP

    for arguments in ([], ["--help"], ["-h"]):
        done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(arguments)], cwd=tmp_path,
                              env=with_repo_on_path(), capture_output=True, text=True, timeout=120)
        *printed, last = done.stdout.strip().splitlines()
        assert json.loads(last) == [0, []] and "\n".join(printed) == HELP


def test_a_config_file_that_is_not_yaml_is_one_line_without_the_stack(tmp_path):
    (tmp_path / "bad.yaml").write_text("model:\n  class_path: rlhf_lightning.SFT\n   init_args: {}\n")
    code, imported, stderr = probe(tmp_path, "fit", "--config", "bad.yaml")
    assert (code, imported) == (2, [])
    assert stderr == ("error: config file bad.yaml line 3, column 13: YAML syntax error: mapping values are not "
                      "allowed here\n")
    code, imported, stderr = probe(tmp_path, "fit", "--config", "missing.yaml")
    assert (code, imported, stderr) == (2, [], "error: config file missing.yaml: it does not exist\n")


def test_plot_needs_no_stack(tmp_path):
    code, imported, stderr = probe(tmp_path, "plot", "nowhere")
    assert (code, imported) == (1, [])
    assert stderr == "error: plot: nowhere is not a run folder (no such directory)\n"
    (tmp_path / "empty").mkdir()
    code, imported, stderr = probe(tmp_path, "plot", "empty")
    assert (code, imported, stderr) == (1, [], "error: empty: no W&B run with logged metrics to plot (was W&B "
                                               "disabled?)\n")


@pytest.mark.slow  # a subprocess importing the training stack
def test_a_command_that_needs_the_stack_still_gets_it(tmp_path):
    code, imported, stderr = probe(tmp_path, "fit", "--trainer.max_stepz=1")
    assert code == 2 and "lightning" in imported
    assert "error: unrecognized arguments: --trainer.max_stepz=1 (did you mean --trainer.max_steps" in stderr


@pytest.mark.slow  # subprocesses importing the training stack
def test_help_and_print_config_are_kept_and_answered_again_without_the_stack(tmp_path):
    """The first ``fit --help`` builds the parser (the stack); the same question again is answered from the kept
    copy, word for word; a changed config file is a new question."""
    cache = tmp_path / "cache"
    (tmp_path / "my.yaml").write_text("trainer:\n  max_steps: 3\n")

    def ask(*arguments: str) -> tuple[int, list[str], str]:
        done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(arguments)], cwd=tmp_path, timeout=300,
                              env=with_repo_on_path(RLHF_LIGHTNING_CACHE=str(cache), COLUMNS="100"),
                              capture_output=True, text=True)
        *printed, last = done.stdout.strip().splitlines()
        code, imported = json.loads(last)
        return code, imported, "\n".join(printed)

    code, imported, first = ask("fit", "--config", "my.yaml", "--print_config")
    assert code == 0 and "lightning" in imported and "max_steps: 3" in first
    assert ask("fit", "--config", "my.yaml", "--print_config") == (0, [], first)
    code, imported, help_text = ask("fit", "--help")
    assert code == 0 and "lightning" in imported and "--trainer.max_steps" in help_text
    assert ask("fit", "--help") == (0, [], help_text)
    assert len(list((cache / "answers").glob("*.txt"))) == 2


def test_a_changed_config_file_or_package_source_is_a_new_question(tmp_path, monkeypatch):
    from rlhf_lightning.cli import answers

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("trainer:\n  max_steps: 3\n")
    question = ["fit", "--config", "my.yaml", "--print_config"]
    key = answers.answer_key(question)
    assert answers.answer_key(question) == key and answers.answer_key(["fit", "--help"]) != key
    (tmp_path / "my.yaml").write_text("trainer:\n  max_steps: 4\n")
    changed = answers.answer_key(question)
    assert changed != key
    monkeypatch.setattr(answers, "package_fingerprint", lambda: [("core/stage.py", 1, 2)])  # an edited source file
    assert answers.answer_key(question) not in (key, changed)
    assert not answers.asks_to_print(["fit", "--config", "my.yaml"])  # a fit is never kept
    assert answers.asks_to_print(["fit", "--model.help", "rlhf_lightning.PPO"])


def test_an_answer_that_names_a_users_class_is_never_kept(tmp_path, monkeypatch):
    from rlhf_lightning.cli.answers import answer_key

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_algorithms.py").write_text("from rlhf_lightning import PPO\nclass MyPPO(PPO):\n    pass\n")
    assert answer_key(["fit", "--model", "rlhf_lightning.PPO", "--help"]) is not None
    assert answer_key(["fit", "--model", "my_algorithms.MyPPO", "--help"]) is None
    (tmp_path / "mine.yaml").write_text("model:\n  class_path: my_algorithms.MyPPO\n")
    assert answer_key(["fit", "--config", "mine.yaml", "--print_config"]) is None
    (tmp_path / "ours.yaml").write_text("model:\n  class_path: rlhf_lightning.PPO\n")
    assert answer_key(["fit", "--config", "ours.yaml", "--print_config"]) is not None
