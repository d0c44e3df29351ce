"""``benchmarks/compare_histories.py``, which the refactors' notes use to show that training did not change: it
compares every logged value but the wall-clock ones, and says which differ."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_histories", REPO / "benchmarks" / "compare_histories.py")
compare_histories = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_histories)


def test_wall_clock_values_are_left_out_and_every_other_difference_is_named():
    clock = ["ppo/time/rollout", "ppo/perf/mfu", "grpo/perf/share/update/backward", "ppo/throughput/tokens", "_runtime"]
    assert all(compare_histories.is_clock(key) for key in clock)
    assert not any(compare_histories.is_clock(key) for key in ("ppo/val/gold", "ppo/objective/kl", "ppo/performance"))
    before = [{"ppo/val/gold": 1.0, "ppo/perf/mfu": 0.1, "_step": 0}, {"ppo/objective/kl": 0.5, "_step": 1}]
    same = [{"ppo/val/gold": 1.0, "ppo/perf/mfu": 0.3, "_step": 0}, {"ppo/objective/kl": 0.5, "_step": 1}]
    assert compare_histories.compare(before, same, 0.0)["differing_rows"] == 0  # only the throughput moved
    moved = [{"ppo/val/gold": 1.0, "_step": 0}, {"ppo/objective/kl": 0.25, "_step": 1}]
    result = compare_histories.compare(before, moved, 0.0)
    assert result["differing_rows"] == 1 and result["differing_keys"] == ["ppo/objective/kl"]
    assert result["largest"] == 0.25
