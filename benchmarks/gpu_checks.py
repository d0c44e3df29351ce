"""One command for a lent GPU: the GPU checks in priority order, within a time budget, into one results file.

    python benchmarks/gpu_checks.py --out $OUT/gpu_checks.md      # on the GPU machine (one call, at most 9 minutes)
    python benchmarks/gpu_checks.py --dry-run                     # anywhere: every command parses; the plan

The steps, in this order (``--steps`` picks some, e.g. the ones a first call had no time left for):

1. ``cuda-tests``: ``pytest -m cuda tests/contracts/test_cuda.py``: one iteration of every algorithm in ``bf16-mixed`` and
   ``bf16-true``, the compiled decode step against eager, FSDP2 with NCCL on one GPU, the fused ops against their
   plain twins;
2. ``decoding-gpt2``, ``decoding-qwen2-0.5b``: ``benchmarks/decoding.py`` in bf16 on CUDA (``generate``, our eager
   loop and our compiled step) at the GPT-2 and Qwen2-0.5B shapes;
3. ``grpo-gpt2``, ``ppo-gpt2``: ``benchmarks/grpo_vs_trl.py`` and ``benchmarks/ppo_vs_trl.py``, ours against the
   floor in ``bf16-mixed`` on CUDA at the ``gpt2`` preset, and against TRL where the version each measures imports
   (1.16 for GRPO, 1.12 for PPO: carry its wheels to get that side). Those two scripts know GPT-2 presets only.

A step starts only while the budget left (``--budget``, 540 s by default) is at least its estimate, and is stopped
(with every process it started) when the budget runs out. After each step the results file is written again: the
GPU's name, the versions of torch and the libraries the steps need, the git commit (``--commit`` where the copy has
no ``.git``), and per step its command, exit status, wall seconds and the tail of its output. The exit status is 1
when a step failed, else 0.

``--dry-run`` needs no GPU and runs nothing: the CUDA tests are collected (``pytest --collect-only``; without CUDA
their module is one skip), each benchmark's command line goes through that script's own parser (and its side
names through its list of sides), and the plan is printed. ``tests/contracts/test_benchmarks.py`` runs it, so no command
here can rot.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import importlib.util
import io
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TAIL_LINES = 60
# What the steps import beside torch; the device image may lack some (carry their wheels).
LIBRARIES = ("transformers", "peft", "lightning", "jsonargparse", "wandb", "datasets", "trl")


@dataclass
class Step:
    """One check: ``arguments`` after ``python``, run from the repository's root; ``estimate``: seconds it is
    expected to take on one H100 or H200 (the first three as measured on an H200, 2026-11-27; the GRPO and PPO steps
    still guesses: the results file records the real ones)."""

    name: str
    arguments: list[str]
    estimate: float
    status: str = "not run"
    exit_code: int | None = None
    seconds: float | None = None
    tail: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return " ".join(["python", *self.arguments])


def trl_version() -> str | None:
    """The installed TRL's version, None when it does not import."""
    if importlib.util.find_spec("trl") is None:
        return None
    return importlib.metadata.version("trl")


def plan(trl: str | None) -> list[Step]:
    """Every step, in priority order; the TRL side of a comparison only where the version it measures is here."""
    decoding = ["benchmarks/decoding.py", "--device", "cuda", "--dtype", "bfloat16", "--prompts", "16", "--group", "8",
                "--prompt-length", "256", "--response-length", "128", "--repeats", "3"]
    online = ["--device", "cuda", "--precision", "bf16-mixed", "--preset", "gpt2", "--iterations", "2", "--repeats", "1"]
    grpo_sides = "ours,trl_lora,floor" if (trl or "").startswith("1.16.") else "ours,floor"
    ppo_sides = "ours,trl,trl_lora,floor" if (trl or "").startswith("1.12.") else "ours,floor"
    return [
        Step("cuda-tests", ["-m", "pytest", "-m", "cuda", "tests/contracts/test_cuda.py", "-q", "-p", "no:cacheprovider"], 200),
        Step("decoding-gpt2", [*decoding, "--shape", "gpt2"], 90),
        Step("decoding-qwen2-0.5b", [*decoding, "--shape", "qwen2-0.5b"], 180),
        Step("grpo-gpt2", ["benchmarks/grpo_vs_trl.py", *online, "--prompts", "16", "--group-size", "8",
                           "--sides", grpo_sides], 90),
        Step("ppo-gpt2", ["benchmarks/ppo_vs_trl.py", *online, "--prompts", "16", "--sides", ppo_sides], 100),
    ]


def parse_error(step: Step) -> str | None:
    """Why ``step``'s command would not start (its parser's message), None when it parses. The CUDA tests are
    collected; a benchmark's arguments go through its own ``parse_args`` and its ``--sides`` through its
    ``SIDES`` (and the floor)."""
    if step.arguments[:2] == ["-m", "pytest"]:
        collect = [sys.executable, "-m", "pytest", "--collect-only", *step.arguments[2:]]
        result = subprocess.run(collect, cwd=REPO, capture_output=True, text=True, timeout=300)
        # 5: nothing collected, which is right without CUDA (the module skips itself)
        if result.returncode not in (0, 5):
            return f"pytest --collect-only exited {result.returncode}: {last_line(result.stdout + result.stderr)}"
        return None
    script = REPO / step.arguments[0]
    specification = importlib.util.spec_from_file_location(f"gpu_checks_{script.stem}", script)
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            args = module.parse_args(step.arguments[1:])
    except SystemExit:
        return f"{step.arguments[0]} rejects its arguments: {last_line(messages.getvalue())}"
    known = {*getattr(module, "SIDES", ()), "floor"}
    if hasattr(module, "SIDES") and (unknown := set(args.sides.split(",")) - known):
        return f"{step.arguments[0]} has no sides {sorted(unknown)}; its sides: {','.join(sorted(known))}"
    return None


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_step(step: Step, seconds_left: float) -> None:
    """Run ``step`` from the repository's root, its output streamed and its tail kept; stopped, with every
    process it started, after ``seconds_left``."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, *step.arguments], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path()})
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its own session: pytest's and the benchmarks' children too

    timer = threading.Timer(seconds_left, stop)
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    for line in process.stdout:
        print(line, end="", flush=True)
        tail.append(line.rstrip("\n"))
    step.exit_code = process.wait()
    timer.cancel()
    step.seconds = time.perf_counter() - started
    step.tail = list(tail)
    if stopped.is_set():
        step.status = f"stopped: the budget ran out after {step.seconds:.0f} s"
    else:
        step.status = "passed" if step.exit_code == 0 else "failed"


def python_path() -> str:
    """The steps' ``PYTHONPATH``: the checkout first (a benchmark script imports the package from it where nothing
    is installed), then the caller's entries (carried wheels)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def environment(commit: str | None) -> dict[str, str]:
    """The GPU, the versions of torch and the steps' libraries, the commit and the time."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (torch sees no CUDA device)"
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return {"GPU": gpu, "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
            "python": sys.version.split()[0], "libraries": ", ".join(f"{k} {v}" for k, v in versions.items()),
            "commit": commit or git_commit(), "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def git_commit() -> str:
    """The checkout's commit, ``+ uncommitted changes`` where the tree differs; say so where there is no git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: pass --commit)"
    return f"{head} + uncommitted changes" if dirty else head


def write_results(path: Path, about: dict[str, str], steps: list[Step], budget: float) -> None:
    """The results file, markdown: the environment, a table of the steps, then each run step's output tail."""
    lines = ["# GPU checks", "", *(f"- {key}: {value}" for key, value in about.items()), f"- budget: {budget:.0f} s",
             "", "| step | status | exit | seconds | estimate | command |", "|---|---|---|---|---|---|"]
    for step in steps:
        seconds = "" if step.seconds is None else f"{step.seconds:.1f}"
        exit_code = "" if step.exit_code is None else str(step.exit_code)
        lines.append(f"| {step.name} | {step.status} | {exit_code} | {seconds} | {step.estimate:.0f} | "
                     f"`{step.command}` |")
    for step in steps:
        if step.seconds is not None:
            lines += ["", f"## {step.name}", "", f"`{step.command}`: {step.status}, exit {step.exit_code} after "
                      f"{step.seconds:.1f} s; the last {len(step.tail)} lines:", "", "```", *step.tail, "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [step.name for step in plan(None)]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"]) / "gpu_checks.md" if os.environ.get("OUT") else Path("gpu_checks.md")
    parser.add_argument("--out", type=Path, default=default_out,
                        help="the results file (markdown; default $OUT/gpu_checks.md where $OUT is set, else "
                             "./gpu_checks.md)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for every step together; a step starts only if its estimate fits in what is left")
    parser.add_argument("--steps", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--commit", default=None, help="the commit to record, where the copy has no .git")
    parser.add_argument("--dry-run", action="store_true",
                        help="check that every command parses and print the plan; runs nothing, needs no GPU")
    args = parser.parse_args(argv)
    if unknown := set(args.steps.split(",")) - set(names):
        parser.error(f"--steps: unknown {sorted(unknown)}; choose from {','.join(names)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = args.steps.split(",")
    steps = [step for step in plan(trl_version()) if step.name in chosen]
    sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts import their harness from there
    if args.dry_run:
        errors = [(step, parse_error(step)) for step in steps]
        for number, (step, error) in enumerate(errors, 1):
            print(f"{number}. {step.name} (about {step.estimate:.0f} s): {step.command}: "
                  f"{'parses' if error is None else 'DOES NOT PARSE'}")
        print(f"total about {sum(step.estimate for step in steps):.0f} s of a {args.budget:.0f} s budget; "
              f"results would go to {args.out}")
        for step, error in errors:
            if error is not None:
                print(f"error: step {step.name}: {error}", file=sys.stderr)
        return 1 if any(error for _, error in errors) else 0
    about = environment(args.commit)
    deadline = time.perf_counter() + args.budget
    for number, step in enumerate(steps, 1):
        left = deadline - time.perf_counter()
        if left < step.estimate:
            step.status = f"not started: {left:.0f} s of the budget left, it needs about {step.estimate:.0f} s"
        else:
            print(f"\n[{number}/{len(steps)}] {step.name}: {step.command} (about {step.estimate:.0f} s, "
                  f"{left:.0f} s left)", flush=True)
            run_step(step, left)
        write_results(args.out, about, steps, args.budget)
    for step in steps:
        print(f"{step.name}: {step.status}" + (f" ({step.seconds:.1f} s)" if step.seconds is not None else ""))
    print(f"results: {args.out}")
    return 1 if any(step.status == "failed" or step.status.startswith("stopped") for step in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
