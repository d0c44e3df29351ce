"""The family study: matched-KL numbers checked by hand, every method's command line through the real CLI, and a
tiny study end to end (two seeds, GRPO, DPO and best-of-n on the tiny model) through the real Trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlhf_lightning.runs.wandb_offline import read_history
from rlhf_lightning.study.best_of_n import BestOfNPoint
from rlhf_lightning.study.evaluation import EvalPoint, MethodRun
from rlhf_lightning.study.family import main as family_main
from rlhf_lightning.study.family import parse_args, result_path, run_unit, units
from rlhf_lightning.study.frontier import (
    compute_table,
    format_cell,
    frontier,
    gao_fits,
    markdown_compute_table,
    markdown_table,
    matched_kl_table,
    seed_fits,
    value_at,
)
from rlhf_lightning.study.gao import gao_curve
from rlhf_lightning.study.methods import METHODS, run_arguments
from rlhf_lightning.study.runs import build_cli

REPO = Path(__file__).resolve().parents[2]


def setting(arguments, key: str):
    """The value of a dotted key (``kl.coef``, ``optimizer.lr``, ``advantages.scale_rewards``) in nested init args
    (hparams, a config's; a class given by ``class_path`` holds its fields in ``init_args``)."""
    for part in key.split("."):
        if isinstance(arguments, dict) and part not in arguments and "init_args" in arguments:
            arguments = arguments["init_args"]
        arguments = arguments[part]
    return arguments


def _run(method: str, strength: float, seed: int, trajectory: list[tuple[float, float]], gold0: float = 0.0,
         seconds: float = 10.0) -> MethodRun:
    """A run whose evaluations are (KL, gold) after the SFT point (0, gold0), one CPU-second apart."""
    points = [EvalPoint(0, 0.0, gold0, 0.0, 0.0)]
    points += [EvalPoint(i + 1, kl, gold, gold + 1.0, seconds * (i + 1)) for i, (kl, gold) in enumerate(trajectory)]
    return MethodRun(method, strength, seed, points)


def test_gold_at_a_kl_is_read_where_the_trajectory_first_reaches_it():
    points = _run("grpo", 0.1, 0, [(1.0, 0.5), (3.0, 1.5), (2.0, 0.0), (6.0, 2.0)]).points
    assert value_at(points, 0.0) == 0.0  # the SFT policy itself
    assert value_at(points, 0.5) == pytest.approx(0.25)
    assert value_at(points, 2.0) == pytest.approx(1.0)  # first crossing, between KL 1 and 3, not the later 2.0
    assert value_at(points, 5.0) == pytest.approx(1.5)  # between KL 2 (0.0) and 6 (2.0)
    assert value_at(points, 6.5) is None  # never reached
    assert value_at(points, 2.0, value="proxy") == pytest.approx(2.0)
    assert value_at(points, 15.0, along="cpu_seconds") == pytest.approx(1.0)  # halfway from 0.5 to 1.5


def test_the_frontier_is_the_best_strength_that_reaches_the_kl_interpolated_in_sqrt_kl():
    weak = _run("rloo", 0.02, 0, [(4.0, 1.0), (16.0, 0.5)])
    strong = _run("rloo", 0.15, 0, [(1.0, 0.8), (4.0, 1.4)])
    # at KL 2.25 (d 1.5): strong is halfway from d 1 to 2 (1.1), weak 3/4 of the way from d 0 to 2 (0.75)
    assert frontier([weak, strong], 2.25) == pytest.approx(1.1)
    assert frontier([weak, strong], 9.0) == pytest.approx(0.75)  # only the weak run gets there: d 3 of 2..4
    assert frontier([weak, strong], 20.0) is None


def test_matched_kl_table_gains_over_each_seeds_sft_policy_with_spread_over_seeds():
    runs = [
        _run("ppo", 0.07, 0, [(4.0, 1.0), (16.0, 2.0)], gold0=-0.1),
        _run("ppo", 0.07, 1, [(4.0, 0.5), (6.0, 1.0)], gold0=0.1),
        _run("ppo", 0.07, 2, [(4.0, 1.1), (16.0, 1.2)], gold0=0.0),
        _run("dpo", 0.1, 0, [(1.0, 0.2)], gold0=-0.1),
    ]
    curve = {0: [BestOfNPoint(1, 0.0, -0.2, 0.0), BestOfNPoint(4, 1.0, 0.4, 1.0), BestOfNPoint(16, 4.0, 0.8, 2.0)]}
    rows = matched_kl_table(runs, curve, [4.0, 9.0], {"ppo": "PPO", "dpo": "DPO"})
    ppo, dpo, bon = rows
    gains = [1.0 + 0.1, 0.5 - 0.1, 1.1]  # at KL 4, each seed's first evaluation
    assert ppo["kl_4"]["values"] == pytest.approx(gains)
    assert ppo["kl_4"]["mean"] == pytest.approx(np.mean(gains))
    assert ppo["kl_4"]["spread"] == pytest.approx(np.std(gains, ddof=1))
    assert ppo["kl_9"]["values"] == pytest.approx([1.5 + 0.1, 1.15])  # d 3 of 2..4; seed 1 never gets there
    assert ppo["kl_9"]["seeds"] == 2 and ppo["seeds"] == 3
    assert ppo["peak"]["values"] == pytest.approx([2.1, 0.9, 1.2]) and ppo["peak_kl"]["values"] == [16.0, 6.0, 16.0]
    assert dpo["kl_4"] is None and dpo["peak"]["values"] == pytest.approx([0.3])
    assert bon["kl_4"]["values"] == pytest.approx([1.0])  # from its own n = 1 (-0.2), not the evaluation's
    assert bon["kl_9"] is None
    table = markdown_table(rows, [4.0, 9.0], {})
    assert "| PPO | +0.87 ± 0.40 | +1.38 ± 0.32 (2/3) | +1.40 ± 0.62 (12.7) | – | 20 |" in table, table
    assert format_cell(None, 3) == "–"


def test_compute_table_reads_gold_after_each_budget_at_the_shipped_strength():
    runs = [_run("grpo", 0.1, 0, [(2.0, 1.0), (4.0, 2.0)], gold0=-0.5),  # evaluations at 10 and 20 CPU-s
            _run("grpo", 0.1, 1, [(2.0, 0.6)], gold0=0.0),
            _run("grpo", 0.3, 0, [(1.0, 9.0)], gold0=-0.5)]  # not the shipped strength: left out
    curve = {0: [BestOfNPoint(1, 0.0, 0.1, 0.0), BestOfNPoint(4, 1.0, 0.9, 1.0)]}
    rows = compute_table(runs, curve, {0: 8.0}, [5.0, 15.0], {"grpo": "GRPO"}, {"grpo": 0.1})
    grpo, bon = rows
    assert grpo["label"] == "GRPO (0.1)"
    assert grpo["cpu_5"]["values"] == pytest.approx([0.25 + 0.5, 0.3])  # halfway from the SFT point to 10 s
    assert grpo["cpu_15"]["values"] == pytest.approx([1.5 + 0.5])  # seed 1's run ended at 10 s
    assert bon["cpu_5"]["values"] == pytest.approx([0.4])  # n = 1 costs 2 s, n = 4 all 8 s: halfway at 5 s
    assert bon["cpu_15"] is None
    assert "| GRPO (0.1) | +0.53 ± 0.32 | +2.00 ± 0.00 (1/2) |" in markdown_compute_table(rows, [5.0, 15.0])


def test_seed_fits_recover_gao_parameters_and_gao_fits_pool_every_strength():
    d = np.linspace(0.3, 3.0, 12)
    gain = gao_curve(d, 1.2, 0.4)
    runs = [MethodRun("grpo", strength, 0, [EvalPoint(0, 0.0, 0.5, 0.0, 0.0)] + [
        EvalPoint(i + 1, x * x, 0.5 + g, 0.0, float(i)) for i, (x, g) in enumerate(zip(d[k::2], gain[k::2], strict=True))])
        for k, strength in enumerate((0.03, 0.3))]
    (fit, reach), = seed_fits(runs).values()
    assert (fit.alpha, fit.beta) == pytest.approx((1.2, 0.4), abs=1e-9) and reach == pytest.approx(3.0)
    pooled = gao_fits(runs, {}, ["grpo"], min_d=1.0)["grpo"]
    assert pooled["alpha"] == pytest.approx(1.2) and pooled["points"] == int((d >= 1.0).sum())


@pytest.mark.slow  # an end-to-end run per method
def test_every_method_runs_through_the_real_cli_with_its_strength_and_overrides(tiny_model_dir, reward_dir,
                                                                               tmp_path):
    for method in METHODS.values():
        strength = method.strengths[0]
        # the tiny reward adapter has rank 4: PPO's critic starts from it
        critic = ["--model.init_args.critic.lora={r: 4, alpha: 8}"] if method.name == "ppo" else []
        arguments = run_arguments(method, strength, 1, REPO / "configs", tiny_model_dir, reward_dir,
                                  tmp_path / method.name, "group", steps=7, overrides=critic)
        assert arguments[0] == "fit" and "--seed_everything=1" in arguments
        cli = build_cli(arguments[1:])
        hparams = cli.model.hparams
        assert setting(hparams, method.strength) == strength, method.name
        assert cli.datamodule.seed == 1
        assert cli.trainer.limit_val_batches == 0 and cli.trainer.callbacks is not None
        # an offline method's steps are optimizer steps: they bound the run, so its schedule spans them
        assert cli.trainer.max_steps == (7 if method.offline else -1), method.name
        for override in method.overrides:
            key, value = override.removeprefix("--model.init_args.").split("=")
            if key in ("policy_loss", "preference_loss"):  # a registered loss by its class's name (or class_path)
                assert type(getattr(cli.model, key)).__name__ in value, method.name
                continue
            assert str(setting(hparams, key)) in (value, "None" if value == "null" else value), (method.name, key)
        assert hasattr(cli.model, "rewards") == method.uses_reward_model, method.name
    # the shipped config's strength is one of those studied
    import yaml

    for method in METHODS.values():
        shipped = yaml.safe_load((REPO / "configs" / method.config).read_text())["model"]["init_args"]
        if method.name not in ("simpo", "dpo_norm"):
            assert setting(shipped, method.strength) == method.shipped, method.name
    # their settings are the README's overrides of dpo.yaml: beta 3, and lr 1e-4 for SimPO
    assert METHODS["dpo_norm"].shipped == 3.0 and METHODS["simpo"].shipped == 1e-4


def test_quick_and_full_modes_pick_their_defaults():
    full, quick = parse_args([]), parse_args(["--quick"])
    assert full.seeds == [0, 1, 2] and full.kls == [2.0, 5.0, 10.0] and full.fraction == 1.0
    assert quick.seeds == [0, 1] and quick.fraction == 0.25 and quick.out == "outputs/family_quick"
    assert len(units(full)) == 3 * (1 + 3 * len(METHODS)) and len(units(quick)) == 2 * (1 + 2 * len(METHODS))
    assert quick.sft_model == str(Path("outputs/family_quick/seed{seed}/sft/model"))
    with pytest.raises(SystemExit):
        parse_args(["--fraction", "1.5"])
    assert "best_of_n" not in parse_args(["--best-of-n", "0"]).methods


TINY = [
    "--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.sampling.max_new_tokens=8",
    "--data.init_args.synthetic_rows=60", "--data.init_args.batch_size=8", "--data.init_args.val_batch_size=8",
    "--data.init_args.val_fraction=0.2", "--data.init_args.max_length=32", "--trainer.enable_model_summary=false",
]


@pytest.mark.slow
def test_tiny_family_study_end_to_end_resumes_and_measures_every_method_alike(tiny_model_dir, reward_dir,
                                                                             tmp_path, capsys):
    arguments = [
        "--methods", "grpo", "dpo", "best_of_n", "--seeds", "0", "1", "--fraction", "0.03", "--evaluations", "2",
        "--eval-prompts", "8", "--best-of-n", "4", "--kls", "0", "1000", "--configs", str(REPO / "configs"),
        "--sft-model", str(tiny_model_dir), "--reward-adapter", str(reward_dir), "--out", str(tmp_path / "fam"),
        "--png-dir", str(tmp_path / "docs"), "--fit-min-d", "0", *[f"--override={a}" for a in TINY],
        # large steps, so that 4 updates move the tiny policy measurably on 8 prompts
        "--method-override", "grpo=--model.init_args.optimizer.lr=0.05",
        "--method-override", "dpo=--model.init_args.optimizer.lr=0.05",
    ]
    summary = family_main(arguments)
    out = tmp_path / "fam"
    for name in ("kl.png", "compute.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "docs" / f"family_full_{name}").read_bytes() == (out / name).read_bytes()
    assert json.loads((out / "family.json").read_text())["table"] == json.loads(json.dumps(summary["table"]))
    printed = capsys.readouterr().out
    assert summary["table_markdown"] in printed and (out / "table.md").read_text().strip() == summary["table_markdown"]

    runs = {(row["method"], row["strength"], row["seed"]): row
            for row in (json.loads(p.read_text()) for p in (out / "runs").glob("*.json")) if "method" in row}
    assert set(runs) == {(m, s, seed) for m in ("grpo", "dpo") for s in METHODS[m].strengths for seed in (0, 1)}
    for (method, _, seed), row in runs.items():
        steps = [p["step"] for p in row["points"]]
        expected = max(1, round(METHODS[method].steps * 0.03))
        assert steps == sorted(set([0, *range(math.ceil(expected / 2), expected, math.ceil(expected / 2)),
                                    expected])), (method, steps)
        first = row["points"][0]
        assert first["kl"] == 0.0 and first["cpu_seconds"] == pytest.approx(0.0, abs=0.5)
        assert all(b["cpu_seconds"] > a["cpu_seconds"] for a, b in zip(row["points"], row["points"][1:], strict=False))
        # Before any update every method is the SFT policy, sampled with the same seeds and scored by the same
        # reward model (DPO through the adapter the study loads onto its base): identical numbers.
        reference = runs[("grpo", 0.03, seed)]["points"][0]
        assert (first["gold"], first["proxy"]) == pytest.approx((reference["gold"], reference["proxy"]), abs=1e-5)
        assert abs(row["points"][-1]["kl"]) > 1e-3, (method, row["points"])  # the policy moved
    assert runs[("grpo", 0.03, 0)]["points"][0]["gold"] != runs[("grpo", 0.03, 1)]["points"][0]["gold"] or \
        runs[("grpo", 0.03, 0)]["points"][0]["proxy"] != runs[("grpo", 0.03, 1)]["points"][0]["proxy"]

    rows = {row["method"]: row for row in summary["table"]}
    assert set(rows) == {"grpo", "dpo", "best_of_n"}
    assert rows["grpo"]["kl_0"]["seeds"] == 2 and rows["grpo"]["kl_0"]["values"] == [0.0, 0.0]  # the SFT policy
    assert rows["grpo"]["kl_1000"] is None
    assert summary["gao_fits"].keys() == {"grpo", "best_of_n"}  # Gao's forms: RL and best-of-n, not DPO

    # Each run logged study/* to its own W&B run in the group; the summary run holds both figures and the table.
    history = [row for row in read_history(out / "runs" / "seed0-grpo-0.03" / "wandb") if "study/gold" in row]
    logged = runs[("grpo", 0.03, 0)]["points"]
    assert [row["study/gold"] for row in history] == pytest.approx([p["gold"] for p in logged])
    assert [row["study/cpu_seconds"] for row in history] == pytest.approx([p["cpu_seconds"] for p in logged])
    assert not list((out / "runs").glob("*.claim"))
    images = [p.name for p in (out / "wandb").rglob("*.png")]  # W&B names them <key>_<step>_<hash>.png
    assert {"family_kl", "family_compute"} <= {name.split("_0_")[0] for name in images}, images
    assert list((out / "wandb").rglob("family_table_*.table.json"))

    # A second call reuses every finished run: nothing is trained again.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    again = family_main(arguments)
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")} == stamps
    assert again["table"] == summary["table"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cispo", "online_dpo", "kto", "distill"])
def test_the_newer_methods_run_a_quick_study_unit(method, tiny_model_dir, reward_dir, tmp_path):
    """CISPO, online DPO, KTO and distillation each run one unit of the study's quick mode through the real CLI,
    measured by the study's evaluation (the end-to-end test above covers the rest of the machinery on GRPO and DPO);
    distillation runs its teacher, the seed's GRPO at its shipped strength, first."""
    args = parse_args([
        "--quick", "--methods", method, "--seeds", "0", "--fraction", "0.03", "--evaluations", "2", "--eval-prompts",
        "8", "--configs", str(REPO / "configs"), "--sft-model", str(tiny_model_dir), "--reward-adapter",
        str(reward_dir), "--out", str(tmp_path / "fam"), *[f"--override={a}" for a in TINY],
        "--method-override", f"{method}=--model.init_args.optimizer.lr=0.05"])
    [first, second] = units(args)  # the quick mode's two strengths
    assert (first.strength, second.strength) == METHODS[method].strengths[:2]
    run_unit(args, first)
    row = json.loads(result_path(args, first).read_text())
    steps = max(1, round(METHODS[method].steps * 0.03))
    assert [p["step"] for p in row["points"]][-1] == steps and row["points"][0]["kl"] == 0.0
    assert abs(row["points"][-1]["kl"]) > 1e-3, row["points"]  # the policy moved
    if method == "distill":
        teacher = tmp_path / "fam" / "runs" / f"seed0-grpo-{METHODS['grpo'].shipped:g}"
        assert (teacher / "adapters" / "policy" / "adapter_config.json").exists()
        config = (tmp_path / "fam" / "runs" / first.name / "config.yaml").read_text()
        assert str(teacher / "adapters" / "policy") in config
