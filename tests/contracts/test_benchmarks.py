"""Every benchmark script runs, so that none rots: each at a tiny shape (``--dry-run``), every side in its own
process as in a real run, printing its tables and its last JSON line.

Ours and the floor always run; TRL's sides only where the TRL version they measure is installed (CI installs
none: ``ppo_vs_trl.py`` measures trl 1.12, ``grpo_vs_trl.py`` and ``dpo_vs_trl.py`` trl 1.16). The models are
built locally from configs (a word-level tokenizer, random weights): nothing comes from a hub, and W&B is off.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRL = importlib.metadata.version("trl") if importlib.util.find_spec("trl") else None
# What each script is run with (a --workdir is added): the sides that need no TRL, at the smallest shapes.
RUNS = {
    "ppo_vs_trl": ["--dry-run", "--sides", "ours,floor"],
    "grpo_vs_trl": ["--dry-run", "--sides", "ours,ours_beta0,floor"],
    # responses that stop: the same planned lengths on every side (a chat-like shape, a long tail of lengths) ...
    "grpo_vs_trl long-tail": ["--dry-run", "--sides", "ours,floor", "--lengths", "long-tail", "--workload", "chat256"],
    # ... and the arithmetic task's lengths, scaled to 16 tokens (the dry run's 4 would leave them 1 to 3)
    "ppo_vs_trl task": ["--dry-run", "--sides", "ours,floor", "--lengths", "task", "--response-length", "16"],
    "dpo_vs_trl": ["--dry-run", "--sides", "ours,ours_precomputed,floor"],
    "scale": ["--dry-run", "--shape", "2x64", "--vocab", "256", "--fit-layers", "1,2", "--sides", "ours_ppo",
              "--no-target"],
    "decoding": ["--dry-run"],
    "reward_server_load": ["--dry-run"],
    "shared_prompt": ["--dry-run"],
    "reward_ensemble": ["--dry-run"],
    "throughput_check": ["--dry-run"],
    "shared_prompt ppo": ["--dry-run", "--algorithm", "ppo"],
    "sharding": ["--ranks", "1", "--algorithms", "grpo", "--layers", "1", "--width", "64", "--prompts", "4",
                 "--group-size", "2", "--response-length", "4", "--iterations", "1", "--threads", "1"],
}
# The runs with TRL's sides, made only where their TRL version is installed.
TRL_RUNS = {
    "ppo_vs_trl trl": ("1.12.", ["--dry-run", "--sides", "ours,trl,trl_lora"]),
    "grpo_vs_trl trl": ("1.16.", ["--dry-run", "--sides", "ours,trl_lora,trl"]),
    "dpo_vs_trl trl": ("1.16.", ["--dry-run", "--sides", "ours,trl_lora,trl_lora_precomputed"]),
    "ppo_vs_trl trl task": ("1.12.", ["--dry-run", "--sides", "ours,trl_lora", "--lengths", "task",
                                      "--response-length", "16"]),
    "grpo_vs_trl trl task": ("1.16.", ["--dry-run", "--sides", "ours,trl_lora", "--lengths", "task",
                                       "--response-length", "16"]),
}
PPO_PHASES = ("rollout/generate", "rollout/logprobs (reference; old unless reused)", "rollout/values (critic)",
              "rollout/reward", "update/policy forward", "update/critic forward", "update/backward",
              "update/optimizer step")

pytestmark = pytest.mark.slow


def needs_trl(run: str) -> pytest.MarkDecorator:
    """Skip a test of TRL run ``run`` unless the TRL version its sides measure is installed."""
    version = TRL_RUNS[run][0]
    return pytest.mark.skipif(not (TRL or "").startswith(version),
                              reason=f"the TRL sides measure trl {version}x; installed: {TRL or 'none'}")


def run_script(name: str, workdir: Path) -> subprocess.CompletedProcess:
    """``python benchmarks/<script>.py`` with the arguments of run ``name``, from the repository's root."""
    script = name.split()[0]
    arguments = RUNS[name] if name in RUNS else TRL_RUNS[name][1]
    if script != "sharding":  # it writes its models in a temporary folder of its own
        arguments = [*arguments, "--workdir", str(workdir)]
    return subprocess.run([sys.executable, f"benchmarks/{script}.py", *arguments], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every run, two at a time: each is mostly fresh Python processes importing torch and Lightning on one core,
    so on CI's two cores the file takes half as long as one run after another."""
    names = [*RUNS, *(name for name, (version, _) in TRL_RUNS.items() if (TRL or "").startswith(version))]
    workdirs = {name: tmp_path_factory.mktemp(name.replace(" ", "_")) for name in names}
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda name: run_script(name, workdirs[name]), names)
        return dict(zip(names, done, strict=True))


def output_of(outputs: dict[str, subprocess.CompletedProcess], name: str) -> tuple[str, dict]:
    """``(stdout, its last line as JSON)`` of run ``name``, which must have succeeded."""
    result = outputs[name]
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-4000:]}"
    return result.stdout, json.loads(result.stdout.strip().splitlines()[-1])


def phase_seconds(stdout: str, heading: str) -> dict[str, float]:
    """The rows of the table ``where our ... goes`` under ``heading``: phase name -> seconds."""
    lines = stdout.split(heading, 1)[1].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("  "):
            break
        name, _, seconds = line.strip().rpartition(" ")
        rows[name.strip()] = float(seconds)
    return rows


def finite_positive(value: object) -> bool:
    """A finite number above zero (a ratio or figure that was measured, not None or NaN)."""
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_ppo_vs_trl_runs_ours_and_the_floor(outputs):
    stdout, result = output_of(outputs, "ppo_vs_trl")
    assert "side               s/iter  rollout   update    tok/s  peak GiB x weights" in stdout
    assert stdout.count("round 1: ") == 5  # ours and the floor's four pieces, each its own process
    phases = phase_seconds(stdout, "where our iteration goes (median seconds per piece):")
    assert set(PPO_PHASES) <= set(phases), phases  # every phase our PPO marks was timed
    assert finite_positive(result["floor_time_ratio"]) and finite_positive(result["floor_memory_ratio"])
    assert result["time_ratio"] is None  # no TRL side asked for
    assert finite_positive(result["flops_per_iteration"]) and finite_positive(result["matmul_flops_per_second"])
    assert result["settings"]["preset"] == "tiny"


def test_the_loops_throughput_figures_count_what_the_harness_counts(outputs):
    """The same iterations measured twice: the callback's generated tokens per second are the harness's (the same
    phase, the same tokens), and its FLOPs, counted from the passes the base ran, are the harness's analytic count
    within 5 %: the harness counts the policy's LoRA in the reference's pass, which runs without it, and not the
    EOS the reward model's input gets after a response cut at its length."""
    stdout, result = output_of(outputs, "throughput_check")
    assert "iteration  harness: s    gen tok/s  GFLOP/s | callback: gen tok/s" in stdout
    assert result["generated_tokens_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert 0.95 < result["flops_ratio"] < 1.05
    assert 0 < result["callback_mfu"] < 1 and result["settings"]["preset"] == "tiny"


def test_grpo_vs_trl_runs_ours_at_both_betas_and_the_floor(outputs):
    stdout, result = output_of(outputs, "grpo_vs_trl")
    assert "side               s/iter  rollout   update    tok/s  peak GiB x weights" in stdout
    for side in ("ours", "ours_beta0"):
        phases = phase_seconds(stdout, f"where our iteration goes ({side}, median seconds per piece):")
        assert {"rollout/generate", "update/policy forward", "update/backward", "update/optimizer step"} <= set(
            phases), phases
    for suffix in ("", "_beta0"):
        assert finite_positive(result[f"floor_time_ratio{suffix}"])
        assert finite_positive(result[f"floor_memory_ratio{suffix}"])
    assert set(result["ours_tokens_per_second"]) == {"ours", "ours_beta0"}


def test_dpo_vs_trl_runs_ours_per_step_and_precomputed_and_the_floor(outputs):
    stdout, result = output_of(outputs, "dpo_vs_trl")  # the script itself checks each first loss is ln 2
    assert "side                     s/step precompute amortised  pairs/s  peak GiB x weights" in stdout
    per_step = phase_seconds(stdout, "where our step goes (ours, median seconds per piece):")
    precomputed = phase_seconds(stdout, "where our step goes (ours_precomputed, median seconds per piece):")
    assert {"update/policy forward", "update/reference forward", "update/backward"} <= set(per_step), per_step
    assert "update/reference forward" not in precomputed  # the reference came from the table
    assert finite_positive(result["precompute_seconds"]["ours_precomputed"])
    for suffix in ("", "_precomputed"):
        assert finite_positive(result[f"floor_time_ratio{suffix}"])


def test_scale_fits_ours_over_two_shapes(outputs):
    stdout, result = output_of(outputs, "scale")
    assert "side           predicted  measured x weights   s/iter fits" in stdout
    fit = result["sides"]["ours_ppo"]["fit"]
    assert len(fit["points_parameters_gib_seconds"]) == 2  # one process at each of the two shapes
    assert result["sides"]["ours_ppo"]["not_run_because"] == "--no-target"


def test_sharding_runs_one_rank(outputs):
    stdout, result = output_of(outputs, "sharding")
    assert "algorithm ranks rollout   rank  base MiB  ratio peak RSS MiB" in stdout
    (run,) = result["results"]
    assert run["algorithm"] == "grpo" and run["ranks"] == 1
    assert run["records"][0]["base_bytes"] == 4 * result["parameters"]  # one rank holds the whole fp32 base


@pytest.mark.parametrize("run, response", [("grpo_vs_trl long-tail", 128), ("ppo_vs_trl task", 16)])
def test_responses_stop_at_the_same_planned_lengths_on_ours_and_the_floor(outputs, run, response):
    stdout, result = output_of(outputs, run)
    ours = result["response_lengths"]["ours"]
    assert result["response_lengths"] == {"ours": ours, "floor/generate": ours}
    assert 1 <= ours["mean"] < ours["max"] <= response  # responses that stop, at lengths that differ
    assert result["same_lengths"] is True  # each side's rows, one by one, are the ones the seeded plan drew
    assert f"  ours                   mean {ours['mean']:>7.2f} max {ours['max']:>4}\n" in stdout
    assert "  the same planned lengths on every side, row by row: True\n" in stdout
    assert finite_positive(result["floor_time_ratio"])


def test_the_chat_workload_sets_its_shape_under_the_dry_run(outputs):
    _, result = output_of(outputs, "grpo_vs_trl long-tail")
    settings = result["settings"]
    assert (settings["prompt_length"], settings["response_length"], settings["group_size"]) == (256, 128, 8)
    assert (settings["preset"], settings["prompts"], settings["lengths"]) == ("tiny", 2, "long-tail")


def test_equal_lengths_report_no_lengths(outputs):
    _, result = output_of(outputs, "grpo_vs_trl")  # the published tables' mode: the stop token off
    assert result["settings"]["lengths"] == "equal"
    assert result["response_lengths"] == {} and result["same_lengths"] is None


def test_realistic_lengths_on_cuda_are_refused_in_one_line():
    result = subprocess.run([sys.executable, "benchmarks/grpo_vs_trl.py", "--lengths", "task", "--device", "cuda"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "grpo_vs_trl.py: error: --lengths task: our side forces the planned stops in its eager decoder, and on CUDA "
        "it decodes with the compiled one; measure realistic lengths on CPU for now")


@pytest.mark.parametrize("run", [pytest.param(name, marks=needs_trl(name)) for name in TRL_RUNS])
def test_trl_sides_run(outputs, run):
    _, result = output_of(outputs, run)
    assert finite_positive(result["time_ratio_lora"]) and finite_positive(result["memory_ratio_lora"])
    if run.endswith(" task"):  # TRL's generate stopped each response where ours did
        assert set(result["response_lengths"]) == {"ours", "trl_lora"} and result["same_lengths"] is True


def test_decoding_runs_every_side_and_they_draw_the_same_tokens(outputs):
    stdout, result = output_of(outputs, "decoding")
    assert "side        s/rollout  ratio prefill s  ratio  decode s  ratio    tok/s compile s same tokens" in stdout
    sides = result["sides"]
    assert set(sides) == {"generate", "eager", "compiled"}
    assert all(side["same_tokens"] == 1.0 and finite_positive(side["seconds"]) for side in sides.values())
    assert sides["generate"]["ratio"] == 1.0 and sides["compiled"]["compile_seconds"] > 0


GPU_STEPS = ["cuda-tests", "decoding-gpt2", "decoding-qwen2-0.5b", "grpo-gpt2", "ppo-gpt2"]


def gpu_checks(*arguments: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_checks.py"), *arguments], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_gpu_checks_dry_run_parses_every_command_of_its_plan():
    """What CI can check of the lent GPU's one command: every step's command parses (the CUDA tests collected,
    each benchmark's arguments through its own parser), listed in priority order."""
    result = gpu_checks("--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert [line.split(" ")[1] for line in steps] == GPU_STEPS
    assert all(line.endswith(": parses") for line in steps), steps
    assert "python -m pytest -m cuda tests/contracts/test_cuda.py" in steps[0]
    assert "benchmarks/decoding.py --device cuda --dtype bfloat16" in steps[2] and "--shape qwen2-0.5b" in steps[2]
    assert "--precision bf16-mixed --preset gpt2" in steps[4] and "--sides ours," in steps[4]


def test_gpu_checks_starts_no_step_its_budget_cannot_hold_and_writes_the_results_file(tmp_path):
    result = gpu_checks("--steps", "decoding-gpt2,grpo-gpt2", "--budget", "1", "--out", str(tmp_path / "gpu.md"))
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "gpu.md").read_text()
    assert "- GPU: none (torch sees no CUDA device)\n" in text and "- torch: " in text and "- commit: " in text
    assert "| decoding-gpt2 | not started: 1 s of the budget left, it needs about 90 s |  |  | 90 | `python " in text
    assert "| grpo-gpt2 | not started: " in text and "## decoding-gpt2" not in text  # nothing ran: no output


def test_gpu_checks_steps_import_the_checkout_and_keep_the_callers_path(monkeypatch):
    specification = importlib.util.spec_from_file_location("gpu_checks_module", REPO / "benchmarks" / "gpu_checks.py")
    module = importlib.util.module_from_spec(specification)
    monkeypatch.setitem(sys.modules, "gpu_checks_module", module)  # its dataclasses look their module up
    specification.loader.exec_module(module)
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")  # wheels carried onto a GPU machine
    assert module.python_path().split(":") == [str(REPO), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert module.python_path() == str(REPO)


def test_gpu_checks_refuses_an_unknown_step_in_one_line():
    result = gpu_checks("--steps", "cuda-tests,benchmarks")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (f"gpu_checks.py: error: --steps: unknown ['benchmarks']; choose from "
                                              f"{','.join(GPU_STEPS)}")


def test_shared_prompt_alternates_sharing_in_one_fit_and_prints_the_ratio(outputs):
    stdout, result = output_of(outputs, "shared_prompt")
    assert "median seconds              shared   per row   on/off" in stdout
    assert result["iterations_each"] == 1 and finite_positive(result["ratio"])
    assert finite_positive(result["ratio_after_sampling"])
    assert {"rollout/generate", "rollout/logprobs", "update/policy forward"} <= result["shared"].keys()
    assert result["algorithm"] == "grpo"


def test_shared_prompt_times_ppo_with_its_critic_and_reward_adapter(outputs):
    _, result = output_of(outputs, "shared_prompt ppo")
    assert result["algorithm"] == "ppo" and finite_positive(result["ratio"])
    # the critic's and the reward adapter's passes are timed in both halves
    for half in ("shared", "per_row"):
        assert {"rollout/values", "rollout/reward", "update/critic forward"} <= result[half].keys()
        assert result[half]["rollout/values"] > 0


def test_reward_server_load_loses_nothing_and_refuses_the_oversized_request(outputs):
    stdout, result = output_of(outputs, "reward_server_load")  # the script itself fails on a lost or unequal answer
    assert "requests lost         0 of 12" in stdout
    assert (result["lost"], result["equal"], result["oversized_status"]) == (0, 12, 413)
    assert finite_positive(result["requests_per_second"]) and finite_positive(result["server_peak_mib"])
