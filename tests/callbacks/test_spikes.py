"""A KL spike is said at once, in one line, by a real Trainer's fit; a smooth series is not; and a resumed fit
judges its first iterations against the ones before the kill."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lightning.callbacks import SpikeCheck

# The quick start's PPO around its iteration 15: KL to the reference rising slowly, then 24 in one iteration, while
# the update's approximate KL went from about 0.02 to 0.48.
KL = [0.0, 0.4, 0.7, 1.1, 1.3, 1.6, 1.8, 2.0, 2.3, 2.4, 2.6, 2.9, 3.0, 3.2, 24.0, 5.1, 4.6, 4.4]
APPROX_KL = [0.018, 0.021, 0.019, 0.022, 0.020, 0.023, 0.019, 0.021, 0.020, 0.022, 0.018, 0.021, 0.020, 0.019,
             0.48, 0.05, 0.03, 0.02]
SPIKE = ("[toy] KL spike at iteration 15: toy/objective/kl 24 against 1.9 ± 0.75 · toy/policy/approx_kl 0.48 against "
         "0.02 ± 0.001 (median ± median absolute deviation of iterations 1-14): one update moved the policy far: "
         "lower optimizer.lr or the clip range, or set target_kl to stop an iteration's epochs early")


class Iterations(L.LightningModule):
    """One logged iteration per training batch, as the on-policy loop's (manual optimization, a step each):
    ``toy/objective/kl`` and ``toy/policy/approx_kl`` from the given series."""

    metric_prefix = "toy"

    def __init__(self, kl: list[float], approx_kl: list[float]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(1, 1)
        self.kl, self.approx_kl = kl, approx_kl

    def training_step(self, batch, batch_idx):
        i = self.trainer.fit_loop.epoch_loop.batch_progress.total.processed  # 0-based: the batch being run
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.layer(batch).sum())
        optimizer.step()
        self.log_dict({"toy/objective/kl": self.kl[i], "toy/policy/approx_kl": self.approx_kl[i]})

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(len(self.kl), 1), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(module: L.LightningModule, check: SpikeCheck, tmp_path, max_steps: int, ckpt_path=None,
        callbacks=()) -> list[str]:
    """The warnings of a fit of ``module`` for ``max_steps`` iterations."""
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(callbacks), default_root_dir=tmp_path,
                        callbacks=[check, *callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt_path)
    return [str(w.message) for w in caught if "spike" in str(w.message)]


def test_a_kl_spike_is_said_in_one_line(tmp_path):
    check = SpikeCheck()
    assert fit(Iterations(KL, APPROX_KL), check, tmp_path, len(KL)) == [SPIKE]
    assert [(spike.name, spike.at) for spike in check.spikes] == [("toy/objective/kl", 15),
                                                                  ("toy/policy/approx_kl", 15)]


def test_a_smooth_series_is_not_warned(tmp_path):
    smooth = [0.0, *(0.3 * i ** 1.2 for i in range(1, len(KL)))]  # KL growing faster and faster, without a jump
    noisy = [0.02 + 0.004 * (-1) ** i for i in range(len(KL))]  # ±20 % from iteration to iteration
    check = SpikeCheck()
    assert fit(Iterations(smooth, noisy), check, tmp_path, len(KL)) == []
    assert check.spikes == [] and len(check.history["toy/objective/kl"]) == len(KL)


def test_threshold_zero_turns_it_off_and_bad_settings_are_refused(tmp_path):
    assert fit(Iterations(KL, APPROX_KL), SpikeCheck(threshold=0), tmp_path, len(KL)) == []
    with pytest.raises(ValueError, match=r"^SpikeCheck: threshold must be >= 0, window >= 2 and warmup in "
                                         r"2..window, got 10.0, 20, 30$"):
        SpikeCheck(warmup=30)


def test_a_resumed_fit_judges_against_the_iterations_before_the_kill(tmp_path):
    """Killed after iteration 12 and resumed: iteration 15 is only 3 iterations into the new process (fewer than
    ``warmup``), yet the spike is said, against the history the checkpoint kept."""
    saved = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, every_n_train_steps=1)
    assert fit(Iterations(KL, APPROX_KL), SpikeCheck(), tmp_path, 12, callbacks=[saved]) == []
    resumed = SpikeCheck()
    said = fit(Iterations(KL, APPROX_KL), resumed, tmp_path, len(KL), ckpt_path=tmp_path / "checkpoints/last.ckpt")
    assert said == [SPIKE]
    restored = SpikeCheck()
    restored.load_state_dict(resumed.state_dict())
    assert restored.spikes == resumed.spikes and restored.history == resumed.history


# ---- worth reading: quiet on healthy runs, one line for a real jump ----------------------------------------------

# The quick start's PPO as shipped (configs/ppo.yaml, seed 4), as logged: a healthy run (held-out gold up, no
# instability), on which the check without floors and cooldown warned 6 times (approx_kl 0.0124 against 0.00057 ...).
HEALTHY_KL = [
    0.0, 0.03251, 0.2113, 0.488, 0.8366, 3.689, 3.019, 3.232, 3.015, 2.655, 3.011, 2.916, 3.168, 3.47, 3.206, 2.623,
    4.207, 4.998, 3.781, 3.907, 3.29, 4.823, 4.355, 4.035, 4.614, 4.235, 4.172, 4.311, 5.711, 3.806, 4.335, 6.866,
    4.55, 3.968, 4.01, 4.161, 4.231, 4.27, 4.077, 4.203, 4.12, 4.703, 4.339, 4.021, 4.101, 3.862, 4.16, 4.746, 4.17,
    4.558, 4.233, 4.202, 4.2, 4.04, 4.743, 4.277, 4.236, 4.031, 4.535, 4.288, 4.172, 4.145, 4.018, 4.248, 4.409,
    4.187, 4.048, 4.448, 3.987, 4.525, 4.031, 4.112, 3.72, 4.203, 4.316, 4.149, 4.446, 4.161, 4.137, 3.982, 4.516,
    4.141, 3.68, 4.322, 4.13, 4.087, 4.144, 4.425, 4.092, 4.007, 4.487, 4.253, 3.867, 6.96, 4.195, 4.279]
HEALTHY_APPROX_KL = [
    0.00201, 0.00461, 0.00547, 0.00764, 0.019, 0.139, 0.0365, 0.0162, 0.0116, 0.00414, 0.045, 0.00672, 0.00871,
    0.0127, 0.00242, 0.0203, 0.0264, 0.0315, 0.0436, 0.0791, 0.0257, 0.0511, 0.00731, 0.00388, 0.00737, 0.00652,
    0.00663, 0.00865, 0.0344, 0.00249, 0.00379, 0.198, 0.0067, 0.0025, 0.00249, 0.00236, 0.0028, 0.00427, 0.00477,
    0.000639, 0.000444, 0.0162, 0.00375, 0.00121, 0.000489, 0.0106, 0.00121, 0.00395, 0.000858, 0.011, 0.00101,
    0.0229, 0.00293, 0.00568, 0.00323, 0.00391, 0.00164, 0.000584, 0.00116, 0.00495, 0.000705, 0.00185, 0.000354,
    0.000289, 0.0014, 0.000923, 0.000252, 0.00251, 0.000247, 0.00372, 0.000311, 0.00171, 0.00166, 0.00028, 0.000561,
    0.000238, 0.00347, 0.000813, 0.000574, 0.000261, 0.00213, 0.000201, 0.000277, 0.000568, 0.000361, 0.00257,
    0.000235, 0.00102, 0.000751, 0.000359, 0.00323, 0.0124, 0.018, 0.211, 0.000756, 0.000167]
WITHOUT_FLOORS = {"floors": {"objective/kl": 0.0, "policy/approx_kl": 0.0}, "cooldown": 0}  # the check before


def history(kl: list[float], approx_kl: list[float]) -> list[dict[str, float]]:
    """Rows as a W&B history holds them: one per iteration, and a validation row every 16 (not judged)."""
    rows: list[dict[str, float]] = []
    for i, (value, approx) in enumerate(zip(kl, approx_kl, strict=True), 1):
        rows.append({"ppo/iteration": i, "ppo/objective/kl": value, "ppo/policy/approx_kl": approx})
        if i % 16 == 0:
            rows.append({"ppo/iteration": i, "ppo/val/kl": value})
    return rows


def injected(series: list[float], at: int, value: float) -> list[float]:
    return [value if i == at else v for i, v in enumerate(series, 1)]


def test_a_healthy_quick_start_history_is_quiet_and_a_real_jump_in_it_is_one_line():
    from rlhf_lightning.callbacks.spike_replay import replay

    healthy = history(HEALTHY_KL, HEALTHY_APPROX_KL)
    assert len(replay(healthy, SpikeCheck(**WITHOUT_FLOORS))) == 6
    assert replay(healthy) == []
    # the quick start's one real instability (KL 24, approx_kl 0.48) put into its 48th iteration
    jump = history(injected(HEALTHY_KL, 48, 24.0), injected(HEALTHY_APPROX_KL, 48, 0.48))
    assert replay(jump) == [
        "warning: [ppo] KL spike at iteration 48: ppo/objective/kl 24 against 4.182 ± 0.15 · ppo/policy/approx_kl 0.48 "
        "against 0.003275 ± 0.0021 (median ± median absolute deviation of iterations 28-47): one update moved the "
        "policy far: lower optimizer.lr or the clip range, or set target_kl to stop an iteration's epochs early"]
    # a jump of the KL alone to 16 (a rise of 12 nats) is one too
    assert len(replay(history(injected(HEALTHY_KL, 48, 16.0), HEALTHY_APPROX_KL))) == 1
    # approx_kl at 0.2, 60 times its recent median yet within its floor (0.3): noise; at 0.35 a line
    assert replay(history(HEALTHY_KL, injected(HEALTHY_APPROX_KL, 48, 0.2))) == []
    assert len(replay(history(HEALTHY_KL, injected(HEALTHY_APPROX_KL, 48, 0.35)))) == 1


def test_at_most_one_line_per_metric_per_cooldown():
    from rlhf_lightning.callbacks.spike_replay import replay

    approx = injected(injected(injected(HEALTHY_APPROX_KL, 48, 0.5), 52, 0.6), 75, 0.55)
    lines = replay(history(HEALTHY_KL, approx))
    assert [line.split(":")[1] for line in lines] == [" [ppo] KL spike at iteration 48", " [ppo] KL spike at iteration 75"]
    assert len(replay(history(HEALTHY_KL, approx), SpikeCheck(cooldown=0))) == 3
    # the KL's own cooldown is its own: an approx_kl line does not silence a KL jump after it
    both = replay(history(injected(HEALTHY_KL, 52, 20.0), approx))
    assert [line.split(": ")[1].split(" against")[0] for line in both] == [
        "[ppo] KL spike at iteration 48", "[ppo] KL spike at iteration 52", "[ppo] KL spike at iteration 75"]
    assert "ppo/policy/approx_kl" not in both[1]


def test_floors_are_settings_merged_into_the_defaults_and_checked():
    check = SpikeCheck(floors={"policy/approx_kl": 0.01, "policy/entropy": 1.0})
    assert check.floors == {"objective/kl": 5.0, "policy/approx_kl": 0.01, "policy/entropy": 1.0}
    from rlhf_lightning.callbacks.spike_replay import replay

    assert len(replay(history(HEALTHY_KL, HEALTHY_APPROX_KL), check)) == 3  # approx_kl's floor lowered: eager
    with pytest.raises(ValueError, match=r"^SpikeCheck: floors must be finite numbers >= 0, got "
                                         r"\{'objective/kl': -1\.0\}$"):
        SpikeCheck(floors={"objective/kl": -1.0})
    with pytest.raises(ValueError, match=r"^SpikeCheck: cooldown must be >= 0 iterations, got -2$"):
        SpikeCheck(cooldown=-2)


def test_the_replay_command_reads_a_run_folder(tmp_path, capsys):
    from rlhf_lightning.callbacks.spike_replay import main
    from rlhf_lightning.cli.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path / "run"), offline=True)
    for row in history(injected(HEALTHY_KL, 48, 24.0), injected(HEALTHY_APPROX_KL, 48, 0.48)):
        logger.experiment.log(row)
    logger.experiment.finish()
    from rlhf_lightning.runs.wandb_offline import find_run_file, wait_until_finished

    assert wait_until_finished(find_run_file(tmp_path / "run"))
    assert main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{tmp_path / 'run'}: 1 spike warning"
    assert out[1].startswith("  warning: [ppo] KL spike at iteration 48: ppo/objective/kl 24 against 4.182")
    assert out[-1] == "total: 1 spike warning in 1 runs"
    assert main([str(tmp_path / "run"), "--floors", '{"objective/kl": 0, "policy/approx_kl": 0}',
                 "--cooldown", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{tmp_path / 'run'}: 7 spike warnings"
