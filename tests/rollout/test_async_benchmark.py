"""The asynchronous-overlap benchmark (``benchmarks/async_overlap.py``) runs: its dry run times GRPO at S = 0 and 1
on a server the fit starts (vLLM's CPU build, the tests marked ``vllm``), each S in fresh processes, and reports
the iterations per hour, their ratio to S = 0, the wait for the producer and the rollouts' age."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import REPO


@pytest.mark.vllm
@pytest.mark.slow
def test_the_async_overlap_benchmark_times_grpo_at_each_staleness(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "async_overlap.py"), "--dry-run", "--workdir",
                           str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(result["workloads"]) == ["balanced"]
    sides = result["workloads"]["balanced"]["sides"]
    assert set(sides) == {"S0", "S1"}
    assert all(figures["iterations_per_hour"] > 0 and figures["update"] > 0 for figures in sides.values())
    assert sides["S0"]["ratio"] == 1.0 and sides["S1"]["ratio"] > 0
    assert sides["S0"]["rollout_wait"] is None and sides["S1"]["rollout_wait"] >= 0  # S = 0 draws itself
    assert (sides["S0"]["staleness"], sides["S1"]["staleness"]) == (0.0, 1.0)  # the overlap was on, one iteration old
    assert result["workloads"]["balanced"]["ceiling"] > 1
    assert "workload     S  iter/h  ratio  s/iter  wait s generate s update s staleness" in done.stdout
    assert "  balanced: at S = 0, generation " in done.stdout and "; slower than S = 0: " in done.stdout
    assert "target: S = 1 at >= 1.3x the iterations per hour of S = 0 on the balanced workload: " in done.stdout
    assert (tmp_path / "runs" / "balanced_S1" / "engine-adapters" / "server-rank0.log").is_file()  # under the workdir
