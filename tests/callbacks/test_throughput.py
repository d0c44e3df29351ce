"""Throughput: a fit logs tokens per second, MFU and the phases' shares every iteration (PPO) and every step (SFT,
its FLOPs the formula's for its batches) without changing anything else it logs."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from rlhf_lightning import SFT, SFTDataModule
from rlhf_lightning.callbacks import Throughput
from rlhf_lightning.cli.loggers import WandbLogger
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.runs.wandb_offline import read_history
from rlhf_lightning.utils.flops import ModelShape
from tests.helpers.models import built, tiny_spec
from tests.helpers.online import make_ppo, prompts

D, LAYERS = 32, 2  # the tiny GPT-2's width and depth
PEAK = 1e12


def fit_rows(module, data, tmp_path, callbacks, **trainer_kwargs) -> list[dict]:
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    trainer = L.Trainer(logger=logger, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=0,
                        callbacks=callbacks, **trainer_kwargs)
    trainer.fit(module, datamodule=data)
    return read_history(tmp_path)


def without(row: dict, *parts: str) -> dict:
    """``row`` without the keys holding any of ``parts`` (wall-clock timings, W&B's own)."""
    return {key: value for key, value in row.items() if not any(part in key for part in parts)}


CLOCKS = ("/perf/", "/time/", "/throughput/", "_timestamp", "_runtime", "artifact")


@pytest.mark.slow
def test_a_ppo_fit_logs_its_throughput_every_iteration_and_nothing_else_changes(tiny_model_dir, reward_dir, tmp_path):
    rows = {}
    for name, callbacks in (("measured", [Throughput(peak_flops=PEAK)]), ("plain", [])):
        module = make_ppo(tiny_model_dir, reward_dir)
        rows[name] = fit_rows(module, prompts(module, n=12, batch_size=4), tmp_path / name, callbacks, max_epochs=1)
    training = [row for row in rows["measured"] if "ppo/loss/total" in row]
    assert len(training) == 3
    phases = {"rollout/generate", "rollout/logprobs", "rollout/values", "rollout/reward", "update/policy forward",
              "update/critic forward", "update/backward", "update/optimizer step", "update/engine sync", "other"}
    for row in training:
        perf = {key.removeprefix("ppo/perf/"): value for key, value in row.items() if key.startswith("ppo/perf/")}
        assert {"generate/prompt_tokens_per_s", "generate/response_tokens_per_s", "update/prompt_tokens_per_s",
                "update/response_tokens_per_s", "flops", "flops_per_s", "mfu"} <= perf.keys()
        assert {key.removeprefix("share/") for key in perf if key.startswith("share/")} <= phases
        shares = [value for key, value in perf.items() if key.startswith("share/")]
        assert all(0 <= share <= 1 for share in shares) and sum(shares) == pytest.approx(1, abs=1e-4)
        assert perf["mfu"] == pytest.approx(perf["flops_per_s"] / PEAK, rel=1e-5)
        assert all(perf[key] > 0 for key in ("flops", "generate/response_tokens_per_s", "update/response_tokens_per_s"))
    # Row for row, the same run: only the added keys (and the wall clock's own) differ.
    assert not any("/perf/" in key for row in rows["plain"] for key in row)
    assert [without(row, *CLOCKS) for row in rows["measured"]] == [without(row, *CLOCKS) for row in rows["plain"]]


class ExpectedSFTFlops(L.Callback):
    """The analytic FLOPs of each SFT batch, from the batch itself: forward and backward through the decoder with the
    ``sft`` adapter, the LM head at every position but the last."""

    def __init__(self) -> None:
        self.expected: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        counter = next(c for c in trainer.callbacks if isinstance(c, Throughput)).counter
        mask = batch["attention_mask"]
        shape = ModelShape(LAYERS, D, counter.shape.vocab, LAYERS * 12 * D * D, counter.adapters["sft"])
        positions = mask.shape[0] * (mask.shape[1] - 1)
        rows = [mask[row, mask[row].bool()] for row in range(mask.shape[0])]  # right-padded: real tokens first
        attended = sum(n * (n + 1) / 2 for n in (len(row) for row in rows))
        self.expected.append(2 * (shape.forward(int(mask.sum()), attended) + shape.head(positions)))


def test_an_sft_fit_logs_its_steps_throughput_and_the_flops_of_its_batches(tmp_path):
    torch.manual_seed(0)
    module = built(SFT(base=tiny_spec(), lora=LoraSpec(r=4, alpha=8), optimizer={"lr": 1e-2}))
    data = SFTDataModule(dataset="synthetic", synthetic_rows=40, batch_size=8, val_fraction=0.0, max_length=64)
    expected = ExpectedSFTFlops()
    # A second Throughput (the command line's beside a config's) stays silent: the first one logs.
    callbacks = [Throughput(peak_flops=PEAK), Throughput(peak_flops=2 * PEAK), expected]
    rows = fit_rows(module, data, tmp_path, callbacks, max_steps=3)
    training = [row for row in rows if "sft/loss" in row]
    assert [row["sft/perf/flops"] for row in training] == pytest.approx(expected.expected, rel=1e-6)
    assert [row["sft/perf/mfu"] for row in training] == pytest.approx(
        [row["sft/perf/flops_per_s"] / PEAK for row in training], rel=1e-5)
    for row in training:
        assert not any(key.startswith("sft/perf/generate/") for key in row)  # nothing generated
        assert row["sft/perf/update/response_tokens_per_s"] > 0 and row["sft/perf/update/prompt_tokens_per_s"] > 0
        assert row["sft/perf/share/update/backward"] + row["sft/perf/share/other"] == pytest.approx(1, abs=1e-4)
