"""The guides: the site builds with ``mkdocs build --strict`` (a broken link or anchor fails it), and every config,
sweep, benchmark script, file, module and class that a command or code in README.md and docs/*.md names exists."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

# Files named relative to the repository root, under these folders.
PATH = re.compile(r"(?<![\w./$-])((?:configs|sweeps|benchmarks|tests|docs|rlhf_lightning)/[\w./{},<>$*-]*[\w}])")
# Dotted names of the package (rlhf_lightning.GRPO, rlhf_lightning.tasks.arithmetic.exact_match) and of Lightning.
DOTTED = re.compile(r"(?<![\w./-])((?:rlhf_lightning|lightning\.pytorch)(?:\.\w+)+)")
# python -m MODULE (and torchrun's -m MODULE).
MODULE = re.compile(r"(?:^|\s)-m\s+(rlhf_lightning[\w.]*)")
# Classes and functions given by import path: --model.class_path=X, class_path: X, fn: X, --model.help X.
IMPORT_PATH = re.compile(r"(?:class_path[=:]\s*|\bfn[=:]\s*|\.help[=\s]+)([A-Za-z_][\w.]*)")


def code_of(markdown: str) -> list[str]:
    """The fenced code blocks and inline code spans of a markdown text."""
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    blocks = fence.findall(markdown)
    spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", fence.sub("", markdown))
    return blocks + [span.replace("\n", " ") for span in spans]


def yours(name: str) -> bool:
    """A placeholder for the reader's own file or module (``my_module.LengthPenalizedPPO``, ``configs/my.yaml``),
    or a pattern (``configs/<stage>.yaml``, ``configs/$ALGO.yaml``)."""
    last = re.split(r"[/.]", name.split("/")[-1] if "/" in name else name)[0]
    return last.startswith("my") or any(mark in name for mark in "<>$*")


def expand(path: str) -> list[str]:
    """Brace expansion as the shell does it: ``configs/arithmetic_{sft,grpo}.yaml`` -> both files."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", path)
    choices = [[part] if index % 2 == 0 else part.split(",") for index, part in enumerate(parts)]
    return ["".join(pieces) for pieces in itertools.product(*choices)]


def resolves(name: str) -> bool:
    """Whether ``name`` is an importable module, or an attribute reached from the longest importable prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def missing_names(markdown: str, root: Path = REPO) -> list[str]:
    """Every file, module, class or function that the code of ``markdown`` names and that does not exist."""
    problems = []
    for code in code_of(markdown):
        for path in PATH.findall(code):
            if not yours(path):
                problems += [f"file {one}" for one in expand(path) if not (root / one).exists()]
        modules = set(MODULE.findall(code))
        problems += [f"module {module} (python -m)" for module in modules
                     if importlib.util.find_spec(module) is None]
        named = {name for name in IMPORT_PATH.findall(code) if not yours(name)}
        names = (set(DOTTED.findall(code)) | named) - modules
        problems += [f"name {name}" for name in sorted(names) if not resolves(name)]
    return sorted(set(problems))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_name_in_commands_and_code_exists(page):
    assert missing_names(page.read_text()) == [], f"{page.relative_to(REPO)} names what does not exist"


def test_the_checker_finds_wrong_names():
    """A checker that cannot fail proves nothing: each kind of wrong name is reported, right ones are not."""
    wrong = """
```bash
python -m rlhf_lightning fit --config configs/nope.yaml --model.class_path=rlhf_lightning.NoSuchModule
python -m rlhf_lightning.no_such_study --png docs/overoptimisation.png
python benchmarks/no_such_bench.py && wandb sweep sweeps/nope.yaml
```

Resume with `rlhf_lightning.callbacks.NoSuchCallback`, rewards from `fn: rlhf_lightning.tasks.arithmetic.nope`,
help from `--model.help torch.nn.NoSuchLayer`, options from `configs/arithmetic_{sft,nope}.yaml`.
"""
    assert missing_names(wrong) == [
        "file benchmarks/no_such_bench.py",
        "file configs/arithmetic_nope.yaml",
        "file configs/nope.yaml",
        "file sweeps/nope.yaml",
        "module rlhf_lightning.no_such_study (python -m)",
        "name rlhf_lightning.NoSuchModule",
        "name rlhf_lightning.callbacks.NoSuchCallback",
        "name rlhf_lightning.tasks.arithmetic.nope",
        "name torch.nn.NoSuchLayer",
    ]
    right = """
```bash
python -m rlhf_lightning fit --config configs/ppo.yaml --model.class_path=my_module.LengthPenalizedPPO
python -m rlhf_lightning.study.family --png-dir docs && python benchmarks/ppo_vs_trl.py
python -m rlhf_lightning fit --config configs/<stage>.yaml --model.help rlhf_lightning.GRPO
```

`rlhf_lightning.callbacks.Preemption`, `fn: my_rewards.brevity`, `configs/arithmetic_{sft,grpo}.yaml`,
`--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy`, `rlhf_lightning/ops/lora.py`.
"""
    assert missing_names(right) == []


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` with link and anchor validation (mkdocs.yml), and the README's links into the
    guides land on pages and headings that exist."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: it is in the dev extra (pip install -e '.[dev]')")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(site)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page, anchor in re.findall(r"\]\(docs/([\w-]+)\.md(?:#([\w-]+))?\)", README.read_text()):
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.exists(), f"README links docs/{page}.md, which the site lacks"
        if anchor:
            assert f'id="{anchor}"' in html.read_text(), f"README links docs/{page}.md#{anchor}: no such title"


def test_readme_stays_short_and_names_no_machine_path():
    """The README is the way in (at most 300 lines); the guides carry the rest. Commands are relative to the
    repository root: no absolute path of a development machine anywhere."""
    assert len(README.read_text().splitlines()) <= 300
    machine_path = re.compile(r"(?<![\w.~/:])/(?:home|Users|work|root|mnt|scratch|tmp|data|opt)/")
    for page in PAGES:
        found = machine_path.findall(page.read_text())
        assert not found, f"{page.relative_to(REPO)} names an absolute path of a machine"


def test_the_guides_extension_example_is_the_readmes():
    """The PPO guide shows the README's tested example (tests/contracts/test_readme_example.py runs it) unchanged."""
    example = re.compile(r"```python\n(.*?class LengthPenalizedPPO.*?)```", re.S)
    readme = example.search(README.read_text()).group(1)
    guide = example.search((REPO / "docs" / "ppo.md").read_text()).group(1)
    assert guide == readme


def test_the_reward_function_examples_work():
    """The reward functions of docs/rewards.md take TRL's keywords, score as documented, and their signatures pass
    the check FunctionReward makes at setup (a missing column is refused)."""
    from rlhf_lightning import FunctionReward

    code = re.search(r"```python\n(.*?)```", (REPO / "docs" / "rewards.md").read_text(), re.S).group(1)
    functions: dict = {}
    exec(compile(code, "docs/rewards.md", "exec"), functions)
    keywords = {"prompts": ["add 1 + 2", "add 2 + 2", "name a colour"], "completions": ["answer 3", "answer 5", "red"],
                "completion_ids": [[1], [2], [3]]}
    assert functions["brevity"](**keywords) == [-0.08, -0.08, -0.03]
    assert functions["contains_answer"](**keywords, answer=[3, 4, None]) == [1.0, 0.0, None]
    FunctionReward(functions["brevity"]).check_columns([])
    FunctionReward(functions["contains_answer"]).check_columns(["answer"])
    with pytest.raises(ValueError, match="needs column 'answer'"):
        FunctionReward(functions["contains_answer"]).check_columns([])
