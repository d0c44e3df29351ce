"""The over-optimisation study: Gao's fit recovers known curves, best-of-n is estimated without bias, and a
tiny study runs end to end through the CLI, writing its figure and JSON summary."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlhf_lightning.study import (
    best_of_n_curve,
    best_of_n_expectation,
    best_of_n_kl,
    best_of_n_weights,
    fit_gao,
    gao_curve,
)
from rlhf_lightning.study.analysis import analyse
from rlhf_lightning.study.best_of_n import powers_of_two
from rlhf_lightning.study.overoptimisation import main as study_main
from rlhf_lightning.study.runs import Point, RunResult

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("form", "alpha", "beta"), [("rl", 1.8, 0.9), ("bon", 1.2, 0.35)])
def test_gao_fit_recovers_alpha_and_beta_from_noisy_curves(form, alpha, beta):
    rng = np.random.default_rng(0)
    d = np.linspace(0.0, 5.0, 80)
    gain = gao_curve(d, alpha, beta, form) + rng.normal(0.0, 0.02, d.shape)
    fit = fit_gao(d, gain, form)
    assert fit.alpha == pytest.approx(alpha, abs=0.03)
    assert fit.beta == pytest.approx(beta, abs=0.03)
    assert fit.r2 > 0.99 and fit.points == 80
    assert fit_gao(d, gao_curve(d, alpha, beta, form), form).r2 == pytest.approx(1.0)


def test_gao_rl_form_starts_at_zero_and_peaks_where_its_derivative_vanishes():
    fit = fit_gao([0.5, 1.0, 2.0, 4.0], gao_curve([0.5, 1.0, 2.0, 4.0], 2.0, 1.0))
    assert gao_curve([0.0], 2.0, 1.0)[0] == 0.0
    assert fit.peak_d == pytest.approx(math.e)  # alpha - beta (ln d + 1) = 0 at ln d = 1
    assert fit.peak_kl == pytest.approx(math.e**2)
    grid = np.linspace(0.1, 8, 2000)
    assert grid[np.argmax(fit(grid))] == pytest.approx(math.e, abs=0.01)
    with pytest.raises(ValueError, match="at least two points"):
        fit_gao([0.0, 1.0], [0.0, 1.0])


def test_best_of_n_kl_bound():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(64) == pytest.approx(math.log(64) - 63 / 64)
    np.testing.assert_allclose(best_of_n_kl(np.array([1, 2])), [0.0, math.log(2) - 0.5])
    assert powers_of_two(64) == [1, 2, 4, 8, 16, 32, 64] and powers_of_two(6) == [1, 2, 4, 6]


def test_unbiased_best_of_n_equals_the_average_over_every_subset():
    rng = np.random.default_rng(1)
    proxy, gold = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    for n in range(1, 8):
        brute_gold, brute_proxy = [], []
        for row in range(3):
            subsets = itertools.combinations(range(7), n)
            picks = [max(subset, key=lambda i: proxy[row, i]) for subset in subsets]
            brute_gold.append(np.mean(gold[row, picks]))
            brute_proxy.append(np.mean(proxy[row, picks]))
        expected_gold, expected_proxy = best_of_n_expectation(proxy, gold, n)
        assert expected_gold == pytest.approx(np.mean(brute_gold))
        assert expected_proxy == pytest.approx(np.mean(brute_proxy))
    assert best_of_n_weights(7, 3).sum() == pytest.approx(1.0)
    assert best_of_n_expectation(proxy, gold, 1)[0] == pytest.approx(gold.mean())  # n = 1: the plain mean
    best = gold[np.arange(3), proxy.argmax(1)].mean()
    assert best_of_n_expectation(proxy, gold, 7)[0] == pytest.approx(best)
    curve = best_of_n_curve(proxy, gold, [1, 2, 4])
    assert [p.n for p in curve] == [1, 2, 4] and curve[1].kl == pytest.approx(math.log(2) - 0.5)
    assert curve[0].proxy < curve[1].proxy < curve[2].proxy  # best-of-n raises the proxy by construction


def test_analysis_fits_the_unpenalised_run_beyond_min_d_and_summarises_every_run():
    gold0, proxy0 = -0.1, -4.0
    d = np.linspace(0.5, 6.0, 12)
    over = RunResult(0.0, eval=[Point(i, float(x * x), float(gold0 + g), proxy0 + float(x))
                                for i, (x, g) in enumerate(zip(d, gao_curve(d, 2.0, 1.0), strict=True))])
    over.eval[0].gold = gold0 - 1.0  # an outlier near the origin, where the form does not hold
    steady = RunResult(0.1, eval=[Point(i, float(x), gold0 + 0.5 * float(x), proxy0)
                                  for i, x in enumerate(d)])
    summary, points, fits, bon_fit = analyse([over, steady], [], (gold0, proxy0), "eval", fit_min_d=1.0)
    assert summary["fit_kl_coef"] == 0.0 and points[0.0] is over.eval and bon_fit is None
    assert summary["alpha"] == pytest.approx(2.0) and summary["beta"] == pytest.approx(1.0)
    assert summary["r2"] == pytest.approx(1.0) and summary["fit_points"] == 11
    assert summary["r2_all_points"] < 0.99  # the outlier is in the all-points fit only
    assert summary["fit_peak_kl"] == pytest.approx(math.e**2)
    first, second = summary["runs"]
    assert first["peak_gold"] == pytest.approx(max(p.gold for p in over.eval))
    assert first["final_gold"] == over.eval[-1].gold and first["gold_drop_from_peak"] > 0
    assert second["gold_drop_from_peak"] == 0.0 and set(fits) == {0.0, 0.1}
    json.dumps(summary, allow_nan=False)  # strict JSON


@pytest.mark.slow
def test_tiny_study_end_to_end_writes_the_figure_and_the_summary(tiny_model_dir, reward_dir, tmp_path,
                                                                 capsys):
    tiny = [
        "--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.critic.lora={r: 4, alpha: 8}",
        "--model.init_args.sampling.max_new_tokens=12", "--model.init_args.update.epochs=1",
        # large steps and 4 evaluations: each fit needs two points with a positive KL, and the k1 estimate on 8
        # prompts is noisy (one evaluation can come out negative)
        "--model.init_args.optimizer.lr=0.05",
        "--data.init_args.synthetic_rows=40", "--data.init_args.batch_size=8",
        "--data.init_args.val_batch_size=8", "--data.init_args.val_fraction=0.2",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    ]
    summary = study_main([
        "--config", str(REPO / "configs" / "ppo.yaml"), "--sft-model", str(tiny_model_dir),
        "--reward-adapter", str(reward_dir), "--kl-coefs", "0", "0.1", "--iterations", "4",
        "--eval-every", "1", "--best-of-n", "4", "--fit-min-d", "0", "--out", str(tmp_path / "study"),
        "--png", str(tmp_path / "docs" / "study.png"),
        "--table-every", "2", *[f"--override={argument}" for argument in tiny],
    ])
    printed = json.loads(_last_json(capsys))
    written = json.loads((tmp_path / "study" / "study.json").read_text())
    assert printed == written == json.loads(json.dumps(summary))

    png = tmp_path / "study" / "overoptimisation.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "docs" / "study.png").read_bytes() == png.read_bytes()
    assert {"alpha", "beta", "r2", "peak_kl", "peak_gold", "wall_seconds", "runs"} <= summary.keys()
    assert summary["fit_kl_coef"] == 0.0 and summary["alpha"] is not None
    assert [run["kl_coef"] for run in summary["runs"]] == [0.0, 0.1]
    assert all(run["final_iteration"] == 4 for run in summary["runs"])  # evaluated after each of 4 iterations
    assert [point["n"] for point in summary["best_of_n"]] == [1, 2, 4]
    assert summary["best_of_n"][0]["kl"] == 0.0
    assert summary["best_of_n"][0]["gold"] == pytest.approx(summary["sft_gold"])

    runs = json.loads((tmp_path / "study" / "runs.json").read_text())
    assert [len(run["train"]) for run in runs] == [4, 4] and [len(run["eval"]) for run in runs] == [4, 4]
    assert runs[0]["train"][0]["kl"] == 0.0  # the first rollout is the SFT policy's
    # Each run logged to its own W&B run, with a completions table; the summary run holds the figure.
    for kl_coef in ("0", "0.1"):
        run_dir = tmp_path / "study" / "runs" / f"kl_coef={kl_coef}"
        assert list(run_dir.rglob("run-*.wandb")) and list(run_dir.rglob("completions_*.table.json"))
    assert list((tmp_path / "study" / "wandb").rglob("overoptimisation_*.png"))


def _last_json(capsys) -> str:
    """The JSON object the command printed last (log lines may come before it)."""
    out = capsys.readouterr().out
    return out[out.rindex("\n{") + 1 if "\n{" in out else out.index("{"):]
