"""Nothing non-finite is trained on or written: a NaN or infinite reward, loss or gradient stops the run with a
message naming where it came from, or (``optimizer.nonfinite: skip``) skips the optimizer step and counts it;
checkpoints and exports refuse non-finite weights."""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf_lightning import GRPO, PPO, SFT, AdapterReward, FunctionReward, SFTDataModule
from rlhf_lightning.algorithms.advantage_estimators import GAE
from rlhf_lightning.callbacks import IterationCheckpoint
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.models.spec import LoraSpec
from rlhf_lightning.rewards import RewardInputs, RewardSource
from rlhf_lightning.utils.nonfinite import NonFiniteError
from tests.helpers.models import tiny_spec
from tests.helpers.modules import make
from tests.helpers.online import Recorder, prompts


class BrokenReward(RewardSource):
    """Scores 1.0, except ``value`` at ``rows`` on the calls (iterations, from 1) listed in ``broken_calls``."""

    def __init__(self, value: float, rows: list[int], broken_calls: set[int]) -> None:
        self.value, self.rows, self.broken_calls, self.calls = value, rows, broken_calls, 0

    @property
    def name(self) -> str:
        return "broken"

    def score(self, inputs: RewardInputs) -> torch.Tensor:
        self.calls += 1
        scores = torch.ones(inputs.input_ids.shape[0])
        if self.calls in self.broken_calls:
            scores[self.rows] = self.value
        return scores


# One epoch of two minibatches, 2 responses per prompt (PPO: one).
make_small = functools.partial(make, defaults=dict(sampling={"max_new_tokens": 4}, update={"epochs": 1, "num_minibatches": 2},
                                                   samples_per_prompt=2))


def fit(module, tmp_path: Path, iterations: int, prefix: str):
    recorder = Recorder(prefix)
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=iterations, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        callbacks=[recorder, IterationCheckpoint(dirpath=tmp_path / "checkpoints", every_n_iterations=1,
                                                 save_top_k=-1, enable_version_counter=False)],
    )
    data = prompts(module, n=16, batch_size=4)
    trainer.fit(module, datamodule=data)
    return trainer, recorder.rows


def assert_every_file_finite(folder: Path) -> int:
    """Every checkpoint and safetensors file under ``folder`` holds finite tensors; returns how many there are."""
    files = sorted(folder.rglob("*.ckpt")) + sorted(folder.rglob("*.safetensors"))
    for path in files:
        state = (torch.load(path, weights_only=False)["state_dict"] if path.suffix == ".ckpt" else load_file(path))
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()), path
    return len(files)


@pytest.mark.parametrize("cls", [PPO, GRPO], ids=lambda cls: cls.__name__)
def test_an_infinite_reward_stops_the_run_naming_the_source_rows_and_iteration(cls, tiny_model_dir, tmp_path):
    module = make_small(cls, tiny_model_dir, BrokenReward(math.inf, [1, 3], {2}), export_dir=str(tmp_path / "export"))
    with pytest.raises(NonFiniteError, match=r"^iteration 2: reward source 'broken' \(BrokenReward\) returned inf "
                                             r"for rows \[1, 3\] of \d+; set optimizer\.nonfinite: skip"):
        fit(module, tmp_path, iterations=3, prefix=f"{module.metric_prefix}/")
    assert assert_every_file_finite(tmp_path) == 1  # the checkpoint of iteration 1, nothing after
    assert not (tmp_path / "export").exists()


def test_a_nan_from_a_reward_model_is_not_read_as_not_applicable(tiny_model_dir, reward_dir, tmp_path):
    """A reward adapter whose head went NaN: the error names it and its folder (NaN is "not applicable" only
    for sources that may abstain, such as Python functions returning None)."""
    broken = tmp_path / "reward"
    shutil.copytree(reward_dir, broken)
    head = load_file(broken / "head.safetensors")
    save_file({name: torch.full_like(value, math.nan) for name, value in head.items()}, broken / "head.safetensors")
    run = tmp_path / "run"
    module = make_small(GRPO, tiny_model_dir, AdapterReward(str(broken)), export_dir=str(run / "export"))
    with pytest.raises(NonFiniteError, match=rf"^iteration 1: reward source 'reward_model' \(AdapterReward "
                                             rf"{broken}\) returned nan for rows \[0, 1, 2, 3, \.\.\. \(8 in all\)\]"):
        fit(module, run, iterations=2, prefix="grpo/")
    assert assert_every_file_finite(run) == 0 and not (run / "export").exists()


def nan_reward(prompts, completions, **kwargs):
    return [1.0] + [math.nan] * (len(completions) - 1)


def test_a_reward_function_returning_nan_is_named_with_the_iteration(tiny_model_dir, tmp_path):
    module = make_small(GRPO, tiny_model_dir, FunctionReward(nan_reward), export_dir=str(tmp_path / "export"))
    with pytest.raises(ValueError, match=r"^iteration 1: reward function (tests\.contracts\.)?test_nonfinite\.nan_reward returned "
                                         r"nan for row 1 \(completion .*\): expected a finite float, or None"):
        fit(module, tmp_path, iterations=1, prefix="grpo/")
    assert assert_every_file_finite(tmp_path) == 0 and not (tmp_path / "export").exists()


def test_skip_skips_the_iteration_counts_its_steps_and_training_goes_on(tiny_model_dir, tmp_path):
    module = make_small(GRPO, tiny_model_dir, BrokenReward(-math.inf, [0], {1}), optimizer={"nonfinite": "skip"},
                  export_dir=str(tmp_path / "export"))
    trainer, rows = fit(module, tmp_path, iterations=2, prefix="grpo/")
    assert trainer.global_step == 2  # iteration 2's two minibatches
    assert [row["grpo/skipped_steps"] for row in rows] == [2.0, 2.0]
    assert module.skipped_steps == 2
    assert (tmp_path / "export" / "policy" / "adapter_model.safetensors").exists()
    # The exported adapter and iteration 2's checkpoint (after the skipped iteration 1, at global step 0,
    # ModelCheckpoint writes none: nothing has changed).
    assert assert_every_file_finite(tmp_path) >= 2
    last = max((tmp_path / "checkpoints").glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    assert torch.load(last, weights_only=False)["skipped_steps"] == 2


def test_an_infinite_loss_term_is_named(tiny_model_dir, tmp_path):
    """A finite but huge score overflows PPO's value loss (returns squared): the error names that term."""
    module = make_small(PPO, tiny_model_dir, BrokenReward(3e38, [0, 1, 2, 3], {1}), samples_per_prompt=1, update={"num_minibatches": 1},
                  advantages=GAE(whiten_advantages=False), critic={"clip_range_value": None})
    with pytest.raises(NonFiniteError, match=r"^iteration 1, optimizer step 1 of 1, micro-batch 1 of 1: "
                                             r"non-finite loss loss/policy=-inf, loss/value=inf, loss/total=nan"):
        fit(module, tmp_path, iterations=1, prefix="ppo/")


def test_a_non_finite_gradient_is_named_and_skip_leaves_the_weights_untouched(tiny_model_dir):
    module = make_small(GRPO, tiny_model_dir, BrokenReward(0.0, [], set()))
    named = {name: p for name, p in module.named_parameters() if p.requires_grad}
    for parameter in named.values():
        parameter.grad = torch.zeros_like(parameter)
    first = next(name for name in named if "lora_A" in name)
    named[first].grad[0, 0] = math.nan
    with pytest.raises(NonFiniteError,
                       match=rf"non-finite gradients in 1 parameters \[{first}\]; set optimizer\.nonfinite"):
        module.guard_step("step 7")
    module.optimizer_settings = dataclasses.replace(module.optimizer_settings, nonfinite="skip")
    assert module.guard_step("step 7") is False
    assert module.skipped_steps == 1 and all(p.grad is None for p in named.values())


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_sft_with_a_diverging_learning_rate(nonfinite, tmp_path):
    """optimizer.lr=1e30: the first step makes the weights huge, the next forward pass overflows to NaN."""
    torch.manual_seed(0)
    module = SFT(base=tiny_spec(), lora=LoraSpec(r=2, alpha=4), optimizer={"lr": 1e30, "nonfinite": nonfinite},
                 export_dir=str(tmp_path / "model"))
    data = SFTDataModule(synthetic_rows=40, batch_size=4, val_fraction=0.0, max_length=64)
    sums = []

    class Weights(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            sums.append(sum(float(p.detach().double().abs().sum()) for n, p in pl_module.named_parameters()
                            if adapter_of(n) == "sft"))

    trainer = L.Trainer(max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Weights()])
    if nonfinite == "raise":
        with pytest.raises(NonFiniteError, match=r"^optimizer step 2 \(training batch 1\): non-finite loss "
                                                 r"sft/loss=nan; set optimizer\.nonfinite: skip"):
            trainer.fit(module, datamodule=data)
        assert not (tmp_path / "model").exists()
    else:
        trainer.fit(module, datamodule=data)
        assert module.skipped_steps == 3 and trainer.callback_metrics["sft/skipped_steps"] == 3.0
        assert len(set(sums)) == 1  # the weights of step 1, never changed by a skipped step


def test_checkpoints_and_exports_refuse_non_finite_weights(tiny_model_dir, tmp_path):
    module = make_small(GRPO, tiny_model_dir, BrokenReward(0.0, [], set()))
    name, parameter = next((n, p) for n, p in module.named_parameters() if adapter_of(n) == "policy")
    with torch.no_grad():
        parameter[0, 0] = math.inf
    with pytest.raises(NonFiniteError, match=rf"^refusing to write a checkpoint: non-finite "
                                             rf"values in 1 weights \[{name}\]"):
        module.on_save_checkpoint({"state_dict": module.state_dict()})
    with pytest.raises(NonFiniteError, match=r"^refusing to write adapter 'policy' to .*: non-finite values in 1"):
        module.export(tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_large_finite_gradients_are_not_taken_for_infinities():
    """A 2-norm of two entries of 1e20 overflows to inf in float32; the check must not call that non-finite."""
    from rlhf_lightning.utils.nonfinite import all_finite

    assert all_finite([torch.full((2,), 1e20), torch.tensor(3.0)])
    assert not all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([1.0, -float("inf")])])
