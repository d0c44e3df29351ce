"""The pipeline studies: samples of the pipeline as a user runs it (a subprocess per stage, its thread count, its run
folder shared where the stages are the same), the spread study's rows and counts, and the ensemble study's
best-of-n rules and PPO runs, end to end on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_lightning import EnsembleReward
from rlhf_lightning.study import ensembles, spread
from rlhf_lightning.study.best_of_n import best_of_n_curve
from rlhf_lightning.study.ensemble_summary import best_of_n_table
from rlhf_lightning.study.pipeline_runs import Pipeline, Sample, Stage
from rlhf_lightning.study.runs import build_cli

REPO = Path(__file__).resolve().parents[2]


def test_a_stages_folder_is_named_by_its_overrides_and_its_command_ends_with_them(tmp_path):
    runs = Pipeline(tmp_path, {
        "sft": Stage("sft", "configs/sft.yaml"),
        "reward-x": Stage("reward", "configs/reward.yaml", ("sft",), ("--model.init_args.members=3",), tag="three",
                          kind="reward"),
        "ppo": Stage("ppo", "configs/ppo.yaml", ("sft", "reward-x"), ("--model.init_args.reward.init_args.path={reward}",
                                                                      "--model.init_args.kl.coef=0.01"))})
    sample = Sample(seed=3, threads=1)
    assert runs.folder("sft", sample) == tmp_path / "sft" / "seed3-threads1"
    assert runs.folder("reward-x", sample) == tmp_path / "reward-three" / "seed3-threads1"
    ppo_folder = runs.folder("ppo", sample).parent.name  # its own overrides' hash, then the varied reward stage
    assert re.fullmatch(r"ppo-[0-9a-f]{8}@reward-three", ppo_folder)
    plain = Pipeline(tmp_path, {**runs.stages, "ppo": Stage("ppo", "configs/ppo.yaml", ("sft", "reward-x"))})
    assert plain.folder("ppo", sample) == tmp_path / "ppo@reward-three" / "seed3-threads1"  # never the shipped one's
    command = runs.command("ppo", sample)
    reward = tmp_path / "reward-three" / "seed3-threads1" / "adapters" / "reward"
    assert command[4:] == [
        "--config", "configs/ppo.yaml", "--seed_everything=3", "--data.init_args.seed=3",
        f"--trainer.default_root_dir={runs.folder('ppo', sample)}",
        f"--model.init_args.base.name_or_path={tmp_path / 'sft' / 'seed3-threads1' / 'model'}",
        f"--model.init_args.reward.init_args.path={reward}",
        f"--model.init_args.reward.init_args.path={reward}", "--model.init_args.kl.coef=0.01"]
    with pytest.raises(SystemExit, match="expected STAGE=VALUE"):
        spread.stage_settings(["reward"], "--override")
    with pytest.raises(SystemExit, match=r"name stage\(s\) \['rm'\]; this study's stages: \['ppo', 'reward', 'sft'\]"):
        spread.pipeline(spread.parse_args(["--override", "rm=--x=1"]))


def _row(seed, threads, gold_end, kl=4.0):
    return spread.Row("ppo", seed, threads, 0.75, 0.85, -0.25, gold_end, 0.5, kl, 10.0, 8.0, 0.5, 0.9, 100.0)


def test_the_table_counts_the_samples_that_gain_one_sd_of_the_starting_gold():
    rows = [_row(0, 1, 0.75), _row(1, 1, 0.25), _row(0, 2, -0.125)]  # gains (in SD 0.5): 2, 1, 0.25
    assert [row.learns for row in rows] == [True, True, False]
    assert [row.gain_sd for row in rows] == [2.0, 1.0, 0.25]
    text = spread.table(rows)
    assert "| ppo | 1 | 1 | 0.750 | 0.850 | -0.250 → +0.250 | +1.00 | 4.00 | 10.0 → 8.0 | +0.50 → +0.90 | 100 |" in text
    assert "| +0.25 ✗ |" in text
    assert text.splitlines()[-1] == ("ppo: 2 of 3 samples learn (gain >= 1 SD); gain +1.08 ± 0.88 SD, KL 4.00 ± 0.00, "
                                     "gold at the end +0.29 ± 0.44")


def test_best_of_n_by_the_worst_case_passes_over_a_response_one_member_loves():
    # one prompt, two responses: member 0 loves the first (a hack the gold punishes), member 1 does not
    scores = np.array([[[5.0, -1.0], [1.0, 1.0]]])  # [P, N, K]
    gold = np.array([[-1.0, 1.0]])
    curves = ensembles.best_of_n_curves(scores, gold, 2, uwo_coef=0.5)
    at_two = {rule: curve[-1]["gold"] for rule, curve in curves.items()}
    assert at_two == {"mean": -1.0, "min": 1.0, "uwo": 1.0, "single": 0.0}  # the members alone: -1 and +1
    assert all(curve[0]["gold"] == 0.0 for curve in curves.values())  # n = 1: a random response
    rng = np.random.default_rng(0)
    scores, gold = rng.normal(size=(6, 8, 3)), rng.normal(size=(6, 8))
    curves = ensembles.best_of_n_curves(scores, gold, 8, uwo_coef=0.5)
    mine = best_of_n_curve(torch.as_tensor(scores).min(-1).values.numpy(), gold, [1, 2, 4, 8])
    assert [p["gold"] for p in curves["min"]] == pytest.approx([p.gold for p in mine])
    single = np.mean([[p.gold for p in best_of_n_curve(scores[..., k], gold, [1, 2, 4, 8])] for k in range(3)], 0)
    assert [p["gold"] for p in curves["single"]] == pytest.approx(list(single))


@pytest.mark.parametrize("rule", ["single", "min", "uwo"])
def test_each_ppo_run_of_the_ensemble_study_is_scored_as_its_rule_says(rule, tiny_model_dir, ensemble_dir):
    argument = ensembles.reward_source(rule, str(ensemble_dir), 0.3, 3)
    cli = build_cli(["--config", str(REPO / "configs" / "ppo.yaml"), f"--model.init_args.base.name_or_path={tiny_model_dir}",
                     argument, "--trainer.logger=false", "--trainer.callbacks=[]"])
    source = cli.model.rewards.sources[0]
    assert isinstance(source, EnsembleReward)
    assert (source.combine, source.uncertainty_coef if rule == "uwo" else None) == \
        {"single": ("mean", None), "min": ("min", None), "uwo": ("uwo", 0.3)}[rule]
    assert source.path == ([f"{ensemble_dir}/reward_0"] if rule == "single" else str(ensemble_dir))


def test_each_member_data_of_the_ensemble_study_trains_its_own_ensemble_and_ppo_scores_with_the_first(tmp_path):
    args = ensembles.parse_args(["--out", str(tmp_path), "--label-noise", "0.25", "--member-data", "bootstrap",
                                 "shared", "partition", "--ppo-runs", "uwo:0.01"])
    runs, sample = ensembles.pipeline(args), Sample(1, 1)
    assert [stage for stage in runs.stages if stage.startswith("reward")] == [
        "reward-bootstrap-noise0.25", "reward-noise0.25", "reward-partition-noise0.25"]
    for member_data in ("bootstrap", "shared", "partition"):
        stage = f"reward-{ensembles.ensemble_name(0.25, member_data)}"
        command = runs.command(stage, sample)
        assert f"--model.init_args.member_data={member_data}" in command and "--model.init_args.members=4" in command
        assert "--data.init_args.label_noise=0.25" in command
    # shared keeps the study's first folder names; the others name their data
    assert runs.folder("reward-noise0.25", sample).parent.name == "reward-ensemble4-noise0.25"
    assert runs.folder("reward-bootstrap-noise0.25", sample).parent.name == "reward-ensemble4-bootstrap-noise0.25"
    ppo = " ".join(runs.command("ppo-uwo:0.01", sample))
    assert str(runs.output("reward-bootstrap-noise0.25", sample)) in ppo
    assert str(runs.output("reward-noise0.25", sample)) not in ppo
    with pytest.raises(SystemExit):
        ensembles.parse_args(["--member-data", "halves"])


def test_the_best_of_n_table_of_one_ensemble_reads_only_its_own_runs():
    scores = np.random.default_rng(0).normal(size=(4, 8, 2))
    gold = scores.mean(-1)
    curves = ensembles.best_of_n_curves(scores, gold, 8, uwo_coef=0.5)
    bon = [{"noise": 0.25, "member_data": "shared", "curves": curves},
           {"noise": 0.25, "member_data": "bootstrap", "curves": ensembles.best_of_n_curves(-scores, gold, 8, 0.5)}]
    shared, gains = best_of_n_table(bon, 0.25, "shared")
    assert gains["mean"].shape == (1, 4) and gains["mean"][0, -1] > 0  # the shared runs alone: picks follow the gold
    flipped_rows, flipped = best_of_n_table(bon, 0.25, "bootstrap")
    assert flipped["mean"][0, -1] < 0 and shared != flipped_rows


TINY = ["--model.init_args.base.architecture={model_type: gpt2, n_layer: 1, n_embd: 32, n_head: 2, n_positions: 64}",
        "--data.init_args.synthetic_rows=256", "--trainer.max_steps=8", "--trainer.val_check_interval=4"]
TINY_REWARD = ["--model.init_args.lora={r: 4, alpha: 8}", "--data.init_args.synthetic_rows=160",
               "--data.init_args.batch_size=16", "--trainer.max_steps=4", "--trainer.val_check_interval=4"]
TINY_PPO = ["--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.critic.lora={r: 4, alpha: 8}",
            "--data.init_args.synthetic_rows=40", "--data.init_args.batch_size=8", "--data.init_args.val_fraction=0.2",
            "--data.init_args.val_batch_size=8", "--trainer.limit_train_batches=2", "--trainer.max_epochs=1",
            "--model.init_args.sampling.max_new_tokens=6"]


@pytest.mark.slow
def test_the_studies_run_the_pipeline_as_a_user_does_and_share_its_stages(tmp_path, capsys):
    out = tmp_path / "study"
    arguments = ["--seeds", "1", "--threads", "1", "--out", str(out), "--configs", str(REPO / "configs"),
                 *[f"--override=sft={a}" for a in TINY], *[f"--override=reward={a}" for a in TINY_REWARD]]
    rows = spread.main([*arguments, *[f"--override=ppo={a}" for a in [*TINY_PPO, "--trainer.val_check_interval=2"]]])
    assert len(rows) == 1 and (rows[0].seed, rows[0].threads) == (1, 1)
    row = rows[0]
    assert 0 <= row.rm_accuracy <= 1 and 0 <= row.rm_gold_accuracy <= 1 and row.gold_sd >= 0 and row.kl > 0
    assert "ppo: " in capsys.readouterr().out
    sft = next((out).glob("sft-*/seed1-threads1"))
    done = json.loads((sft / "done.json").read_text())
    assert done["threads"] == 1 and "--seed_everything=1" in done["command"]
    stamp = (sft / "done.json").stat().st_mtime
    # the ensemble study on the same folder: the SFT stage is the spread study's, reused
    result = ensembles.main([*arguments, "--members", "2", "--label-noise", "0.25", "--best-of-n", "4",
                             "--best-of-n-prompts", "8", "--ppo-runs", "min:0.01", "--ppo-epochs", "1",
                             "--eval-every", "2", *[f"--override=ppo={a}" for a in TINY_PPO]])
    assert (sft / "done.json").stat().st_mtime == stamp
    ensemble = next(out.glob("reward-ensemble2-noise0.25-*/seed1-threads1"))  # its tag names the overrides' hash
    assert json.loads((ensemble / "adapters" / "reward" / "ensemble.json").read_text())["member_data"] == "shared"
    curves = result["best_of_n"][0]["curves"]
    assert set(curves) == {"single", "mean", "min", "uwo"} and [p["n"] for p in curves["min"]] == [1, 2, 4]
    (trajectory,) = result["ppo"]["ppo-min:0.01"]
    assert trajectory["iteration"] == [0, 2] and len(trajectory["gold"]) == 2
    assert (out / "ensembles.png").stat().st_size > 0 and "worst case (WCO), 0.01" in (out / "ensembles.md").read_text()
