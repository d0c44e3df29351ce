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
