"""What a run tells its user while it works and when it ends: plain progress lines when the output is not a
terminal, a summary led by the held-out metrics, one warning when validation would never run, and a reward
function's signature and example in ``--help``."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from rlhf_lightning import GRPO, FunctionReward
from rlhf_lightning.callbacks import LearningCheck, NotLearningError, ProgressLines, RunReport
from rlhf_lightning.callbacks.learning_check import Stall
from rlhf_lightning.callbacks.progress_lines import duration, metric_text
from rlhf_lightning.cli import RLHFCLI, main
from tests.helpers.models import built
from tests.helpers.online import Recorder, make_online, prompts

REPO = Path(__file__).resolve().parents[2]
TINY = "{model_type: gpt2, n_layer: 1, n_embd: 16, n_head: 2, n_positions: 64}"


def sft_args(*overrides: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "sft.yaml"), f"--model.init_args.base.architecture={TINY}",
            "--data.init_args.synthetic_rows=200", "--trainer.logger=false", "--trainer.enable_model_summary=false",
            *overrides]


def numbers(line: str) -> dict[str, float]:
    """``name value`` pairs of a progress or summary line."""
    return {name: float(value) for name, value in re.findall(r"([\w/]+) (-?[\d.]+(?:e[-+]?\d+)?)(?= ·|$)", line)}


def test_without_a_terminal_the_cli_prints_lines_not_a_bar():
    cli = RLHFCLI(args=sft_args()[1:], run=False)  # pytest's captured stdout is not a terminal
    assert cli.trainer.progress_bar_callback is None
    assert [type(c) for c in cli.trainer.callbacks if isinstance(c, ProgressLines | RunReport)] == [ProgressLines,
                                                                                                   RunReport]
    quiet = RLHFCLI(args=[*sft_args()[1:], "--trainer.enable_progress_bar=false"], run=False)
    assert not any(isinstance(c, ProgressLines) for c in quiet.trainer.callbacks)  # asked for silence: none


@pytest.mark.slow
def test_a_cli_fit_prints_progress_lines_and_a_summary_led_by_held_out_metrics(capsys):
    main(sft_args("--trainer.max_steps=6", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2"))
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("[sft] batch ")]
    # every_seconds 60: the first and the last batch (this run takes a few seconds)
    assert [line.split(" · ")[0] for line in progress] == ["[sft] batch 1", "[sft] batch 6"]
    assert re.search(r" · step 6/6 · \d+s · \d\d:\d\d:\d\d · [\d.]+ s/batch · 0s left · sft/loss [\d.]+$",
                     progress[-1]), progress[-1]
    assert re.search(r" · step 1/6 · \d+s · \d\d:\d\d:\d\d · first batch \d+s \(warm-up\) · sft/loss", progress[0])
    validations = [line for line in lines if line.startswith("[sft] validation after batch ")]
    # the starting policy's validation first (ValidateAtStart), then every 3 batches
    assert [line.split(":")[0] for line in validations] == ["[sft] validation after batch 0",
                                                           "[sft] validation after batch 3",
                                                           "[sft] validation after batch 6"]
    start = lines.index(next(line for line in lines if line.startswith("[sft] fit ended: 6 batches, 6 optimizer")))
    held_out, change, training, places = lines[start + 1 : start + 5]
    assert held_out.startswith("  held-out (validation after batch 6): sft/val/loss ")
    assert numbers(held_out) == numbers(validations[-1].split(": ", 1)[1])  # the last validation's values
    first, last = numbers(validations[0].split(": ", 1)[1]), numbers(held_out)
    assert change == "  change (batch 0 → 6): " + " · ".join(
        f"{name} {first[name]:.4g} → {last[name]:.4g}" for name in sorted(last))
    assert last["sft/val/loss"] < first["sft/val/loss"]  # six steps of SFT lower the held-out loss
    assert set(numbers(held_out)) == {"sft/val/loss", "sft/val/perplexity"}
    assert training.startswith("  training (last batch): sft/loss ")
    assert re.fullmatch(r"  run folder: outputs/sft · checkpoints: \S*outputs/sft/checkpoints · exports: outputs/sft/model",
                        places), places


@pytest.mark.slow
def test_a_run_too_short_to_validate_says_so_once_at_the_start_and_in_the_summary(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(sft_args("--trainer.max_steps=4", "--trainer.val_check_interval=200"))
    said = [str(w.message) for w in caught if "is longer than the run" in str(w.message)]
    assert said == ["trainer.val_check_interval=200 is longer than the run's 4 training batches (max_steps x "
                    "accumulate_grad_batches): no validation will run; lower it (e.g. to 1) or set "
                    "trainer.limit_val_batches=0 to run without validation"]
    out = capsys.readouterr().out
    assert "  held-out: no validation ran (trainer.val_check_interval=200 is longer" in out
    assert "[sft] validation after" not in out


@pytest.mark.parametrize("settings, warned", [
    (dict(max_steps=4, val_check_interval=4), None),
    (dict(max_steps=4, val_check_interval=200, limit_val_batches=0), None),  # no validation asked for
    (dict(max_steps=4, val_check_interval=200), "trainer.val_check_interval=200 is longer than the run's 4 "
                                                 "training batches (max_steps x accumulate_grad_batches)"),
    (dict(max_epochs=2, limit_train_batches=3, val_check_interval=7), "trainer.val_check_interval=7 is longer "
                                                                       "than the run's 6 training batches:"),
    (dict(max_epochs=2, limit_train_batches=3, val_check_interval=6), None),
    (dict(max_epochs=2, limit_train_batches=3, check_val_every_n_epoch=3, val_check_interval=1.0),
     "trainer.check_val_every_n_epoch=3 is more than the run's max_epochs=2"),
])
def test_the_validation_warning_knows_the_run_length(settings, warned, tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    settings = {"check_val_every_n_epoch": None, "limit_val_batches": 1, **settings}
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[RunReport()], **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    said = [str(w.message) for w in caught if "no validation will run" in str(w.message)]
    assert len(said) == (warned is not None) and (warned is None or said[0].startswith(warned)), said


@pytest.mark.slow
def test_an_online_fit_counts_iterations_and_reports_gold_and_kl(tiny_model_dir, reward_dir, tmp_path, capsys):
    module = make_online(GRPO, tiny_model_dir, reward_dir, update={"epochs": 1, "num_minibatches": 1}, kl={"coef": 0.05})
    recorder = Recorder("grpo/")
    data = prompts(module, n=24, batch_size=4, val_fraction=0.25)
    trainer = L.Trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=1, val_check_interval=2,
                        check_val_every_n_epoch=None, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path, callbacks=[ProgressLines(every_seconds=0), RunReport(), recorder])
    trainer.fit(module, datamodule=data)
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("[grpo] iteration ")]
    assert [line.split(" · ")[:3] for line in progress] == [  # every_seconds 0: every iteration
        [f"[grpo] iteration {i}/6", f"epoch {1 + (i - 1) // 3}/2", f"step {i}"] for i in range(1, 7)]
    last = numbers(progress[-1])
    assert set(last) >= {"reward", "kl", "gold"}
    assert last["gold"] == pytest.approx(recorder.rows[-1]["grpo/objective/gold"], rel=1e-3, abs=1e-4)
    assert [line.split(":")[0] for line in lines if line.startswith("[grpo] validation")] == [
        f"[grpo] validation after iteration {i}" for i in (2, 4, 6)]
    ended = next(i for i, line in enumerate(lines) if line.startswith("[grpo] fit ended: 6 iterations, 6 optimizer"))
    summary = lines[ended + 1]
    assert summary.startswith("  held-out (validation after iteration 6): grpo/val/eos_frac ")
    held_out = numbers(summary)
    assert held_out["grpo/val/gold"] == pytest.approx(float(trainer.callback_metrics["grpo/val/gold"]), rel=1e-3)
    names = ("eos_frac", "gold", "gold_count", "gold_std", "kl", "length", "score")
    assert set(held_out) == {f"grpo/val/{name}" for name in names}
    assert any(line.startswith("  gold scale: ") for line in lines[ended:]), lines[ended:]


def test_durations_and_metrics_read_as_text():
    assert [duration(s) for s in (0.4, 59.6, 185, 7380)] == ["0s", "1m00s", "3m05s", "2h03m"]
    assert metric_text({"reward": 1.23456, "kl": float("nan")}) == "reward 1.235 · kl nan"
    with pytest.raises(ValueError, match="every_seconds must be >= 0 and window >= 1, got -1, 20"):
        ProgressLines(every_seconds=-1)


class SlowLater(L.Callback):
    """Batches after the fifth take 0.2 s more."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= 5:
            time.sleep(0.2)


def test_progress_lines_time_the_recent_batches_and_say_the_time_left(tmp_path, capsys):
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(max_steps=8, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[SlowLater(), ProgressLines(every_seconds=0, window=2)])
    trainer.fit(BoringModel())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[BoringModel] batch ")]
    assert "(warm-up)" in lines[0] and " left" not in lines[0]  # the first batch: no rate yet
    lines = lines[1:]
    rates = [float(re.search(r" ([\d.e-]+) s/batch", line).group(1)) for line in lines]
    assert max(rates[:4]) < 0.1 and min(rates[-2:]) >= 0.2  # the slowdown shows at once, not diluted by the start
    left = [re.search(r" · (\w+) left", line).group(1) for line in lines]
    assert left[-1] == "0s" and left[-3] in ("0s", "1s")  # batch 6: two batches left at ~0.2 s each


def test_the_reward_function_help_shows_its_signature_and_a_working_example(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        main(["fit", "--model", "rlhf_lightning.GRPO", "--model.reward.help", "rlhf_lightning.FunctionReward"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fn(prompts, completions, completion_ids, **columns)" in text
    assert "-> list[float | None]" in text
    example = re.search(r"``(def brevity\(.*?)``", text).group(1)
    config = re.search(r"``(reward: \{class_path: rlhf_lightning.FunctionReward.*?)``", text).group(1)
    (tmp_path / "my_rewards.py").write_text(example.replace(": return", ":\n    return") + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = RLHFCLI(args=["--config", str(REPO / "configs" / "grpo.yaml"), f"--model.init_args.{config.replace(': ', '=', 1)}",
                        "--trainer.logger=false"], run=False)
    source = cli.model.rewards.sources[0]
    assert isinstance(source, FunctionReward) and source.name == "brevity"
    source.check_columns(["topic"])  # takes TRL's keywords and the data's columns
    assert source.fn(prompts=["p", "q"], completions=["ab", "abcd"], completion_ids=[[1], [1, 2]]) == [-0.02, -0.04]


def constant_reward(prompts, completions, **columns):
    return [1.0] * len(completions)


class MovedPolicy(L.Callback):
    """Moves the policy's LoRA off zero before the first update: the policy differs from the reference, so a KL
    term in the loss has a gradient (a long run's policy does; a tiny one's starts equal to it to the last bit)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in pl_module.named_parameters():
                if "lora_B" in name and parameter.requires_grad:
                    parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def grpo_fit(tiny_model_dir, reward_dir, tmp_path, check, reward=None, callbacks=(), **kwargs):
    """A 3-iteration GRPO fit of the tiny model with ``check``, progress lines and the summary."""
    module = make_online(GRPO, tiny_model_dir, reward_dir, update={"epochs": 1, "num_minibatches": 1}, **kwargs)
    if reward is not None:  # the same module scored by ``reward`` instead of the reward adapter
        module = built(GRPO(**{**module.hparams, "reward": reward}))
    trainer = L.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path,
                        callbacks=[*callbacks, check, ProgressLines(every_seconds=0), RunReport()])
    trainer.fit(module, datamodule=prompts(module, n=12, batch_size=4))
    return trainer


@pytest.mark.slow
def test_a_run_whose_groups_all_score_alike_is_told_it_is_not_learning(tiny_model_dir, reward_dir, tmp_path, capsys):
    """Every advantage 0 (the cut-short calculator run): the warning names the cause and its metric, once, and the
    summary repeats it with the whole span; action raise stops the fit with that line."""
    flat = FunctionReward(constant_reward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_fit(tiny_model_dir, reward_dir, tmp_path, LearningCheck(patience=2), reward=flat, kl={"coef": 0.0})
    said = [str(w.message) for w in caught if "not learning" in str(w.message)]
    cause = ("every group's responses scored alike, so every advantage was 0 (raise samples_per_prompt or the "
             "reward's resolution, or start from a policy that solves some prompts) (grpo/objective/frac_zero_std 1)")
    assert said == [f"[grpo] not learning: no gradient reached the trainable weights in iterations 1-2: {cause}"]
    out = capsys.readouterr().out
    assert f"\n  [grpo] not learning: no gradient reached the trainable weights in iterations 1-3: {cause}\n" in out
    with pytest.raises(NotLearningError, match=r"^\[grpo\] not learning: .* in iterations 1-2: every group's .*"
                                               r"\(LearningCheck action: raise\)$"):
        grpo_fit(tiny_model_dir, reward_dir, tmp_path, LearningCheck(patience=2, action="raise"), reward=flat,
                 kl={"coef": 0.0})


@pytest.mark.slow
def test_tied_groups_with_a_kl_gradient_are_still_not_learning(tiny_model_dir, reward_dir, tmp_path, capsys):
    """The shipped GRPO's KL in the loss on a constant reward: a rounding-level gradient reaches the weights at
    every step (and Adam makes full-size steps of it), yet the reward says nothing: the check names the tie."""
    flat = FunctionReward(constant_reward)
    check = LearningCheck(patience=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = grpo_fit(tiny_model_dir, reward_dir, tmp_path, check, reward=flat, callbacks=[MovedPolicy()],
                           kl={"coef": 0.04, "added_to": "loss"})
    assert float(trainer.callback_metrics["grpo/grad_norm"]) > 0  # the KL term's gradient did reach the weights
    said = [str(w.message) for w in caught if "not learning" in str(w.message)]
    assert said == ["[grpo] not learning: the reward gave no signal in iterations 1-2: every group's responses scored "
                    "alike, so every advantage was 0 (raise samples_per_prompt or the reward's resolution, or start "
                    "from a policy that solves some prompts) (grpo/objective/frac_zero_std 1); the gradient that "
                    "still reached the weights came from other terms (a KL penalty), which move the policy without "
                    "learning from the reward"]
    assert [(stall.first, stall.last) for stall in check.stalls] == [(1, 3)]
    assert "[grpo] not learning: the reward gave no signal in iterations 1-3" in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_that_learns_is_not_warned(tiny_model_dir, reward_dir, tmp_path, capsys):
    check = LearningCheck(patience=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_fit(tiny_model_dir, reward_dir, tmp_path, check)
    assert check.stalls == [] and not [w for w in caught if "not learning" in str(w.message)]
    assert "not learning" not in capsys.readouterr().out


@pytest.mark.slow
def test_every_row_carries_the_iteration_and_the_optimizer_steps(tiny_model_dir, reward_dir, tmp_path):
    """The documented x-axes: ``grpo/iteration`` on training and validation rows, ``trainer/global_step`` the
    optimizer steps taken by then, in agreement on every row, from the starting policy's validation
    (ValidateAtStart) on."""
    from rlhf_lightning.callbacks import ValidateAtStart
    from rlhf_lightning.cli.loggers import WandbLogger
    from rlhf_lightning.runs.wandb_offline import read_history

    module = make_online(GRPO, tiny_model_dir, reward_dir, update={"epochs": 2, "num_minibatches": 1})  # 2 optimizer steps per iteration
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, val_check_interval=1,
                        check_val_every_n_epoch=None, logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[ValidateAtStart()])
    trainer.fit(module, datamodule=prompts(module, n=24, batch_size=4, val_fraction=0.25))
    rows = read_history(tmp_path)
    validation = [(row["grpo/iteration"], row["trainer/global_step"]) for row in rows if "grpo/val/gold" in row]
    training = [(row["grpo/iteration"], row["trainer/global_step"]) for row in rows if "grpo/loss/total" in row]
    assert validation == [(0, 0), (1, 2), (2, 4)]
    assert training == [(1, 2), (2, 4)]


class ZeroGradient(L.LightningModule):
    """A loss that does not depend on the weights: every gradient is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return (self.layer(batch) * 0.0).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_under_gradient_accumulation_the_stall_spans_the_batches_it_took(tmp_path):
    check = LearningCheck(patience=2)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        callbacks=[check])
    with pytest.warns(UserWarning, match=r"^\[ZeroGradient\] not learning: no gradient reached the trainable weights "
                                         r"in batches 1-4: every optimizer step's gradient was 0"):
        trainer.fit(ZeroGradient())
    assert [(stall.first, stall.last) for stall in check.stalls] == [(1, 6)]
    restored = LearningCheck()
    restored.load_state_dict(check.state_dict())  # what a checkpoint keeps
    assert restored.stalls == check.stalls


class Solver(L.LightningModule):
    """A module whose held-out batches are prompt batches, as the on-policy modules': its validation after the
    k-th training batch logs the gold ``GOLD[k]`` (with ``toy/val/gold_std`` when ``spread``), pass@1, pass@4 and
    maj@4; training batches are iterations (manual optimization)."""

    metric_prefix = "toy"
    GOLD = [0.2, 0.5, 0.8]

    def __init__(self, spread: bool = True, problems: int = 40) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(1, 1)
        self.spread, self.problems = spread, problems

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(self.layer(batch).sum())
        optimizer.step()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self) -> None:
        gold = self.GOLD[self.trainer.fit_loop.epoch_loop.batch_progress.total.processed]
        self.log_dict({"toy/val/gold": gold, "toy/val/pass@1": 0.5 * gold, "toy/val/pass@4": gold,
                       "toy/val/maj@4": 0.9 * gold, **({"toy/val/gold_std": 0.5} if self.spread else {})})

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=1)

    def val_dataloader(self):
        prompts = [f"problem {i}" for i in range(self.problems)]
        return torch.utils.data.DataLoader(prompts, batch_size=16, collate_fn=lambda rows: {"prompt": rows})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def solver_summary(module: L.LightningModule, tmp_path) -> list[str]:
    from rlhf_lightning.callbacks import ValidateAtStart

    report = RunReport(print_at_fit_end=False)
    trainer = L.Trainer(max_steps=2, val_check_interval=2, check_val_every_n_epoch=None, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, callbacks=[ValidateAtStart(), report])
    trainer.fit(module)
    assert report.held_out_prompts == module.problems and report.fit_seconds is not None
    return report.summary_text.splitlines()


def test_the_summary_gives_gold_its_scale_and_pass_at_k_its_standard_error(tmp_path):
    lines = solver_summary(Solver(), tmp_path)
    assert lines[0].startswith("[toy] fit ended: 2 iterations, 2 optimizer steps, ")
    assert lines[3] == ("  gold scale: SD 0.5 over the starting policy's 40 held-out responses (toy/val/gold_std); "
                        "the change +0.6 is +1.2 SD")
    # sqrt(p (1 - p) / 40): maj@4 0.72 -> 0.071, pass@1 0.4 -> 0.077, pass@4 0.8 -> 0.063
    assert lines[4] == ("  pass@k (± binomial standard error over 40 held-out problems): maj@4 0.72 ± 0.071 · "
                        "pass@1 0.4 ± 0.077 · pass@4 0.8 ± 0.063")


def test_without_the_gold_spread_the_summary_says_what_is_known(tmp_path):
    lines = solver_summary(Solver(spread=False, problems=1), tmp_path)
    assert lines[3] == ("  gold scale: the spread of the gold over 1 held-out response is not logged; the change "
                        "+0.6 is in the gold reward's own units")
    assert lines[4].startswith("  pass@k (± binomial standard error over 1 held-out problem): maj@4 0.72 ± 0.45 · ")


def test_a_subclass_is_named_by_its_own_prefix_or_else_its_class():
    from rlhf_lightning.callbacks.run_report import run_name

    class MyGRPO(GRPO):  # a researcher's variant that keeps GRPO's metric names
        pass

    class TheirGRPO(GRPO):
        metric_prefix = "their_grpo"

    class Deeper(TheirGRPO):
        pass

    make = object.__new__  # the name reads the class only: no model is built
    assert [run_name(make(cls)) for cls in (GRPO, MyGRPO, TheirGRPO, Deeper, ZeroGradient)] == [
        "grpo", "MyGRPO", "their_grpo", "their_grpo", "ZeroGradient"]
    # The progress lines and the not-learning warning say the same name as the summary.
    mine = make(MyGRPO)
    mine.automatic_optimization = False
    assert ProgressLines.prefix(mine) == "MyGRPO"
    assert LearningCheck.message(mine, Stall(1, 3, "why")).startswith("[MyGRPO] not learning: ")


def test_no_response_stopping_is_the_cause_only_with_loss_mask_truncated_completions():
    """Responses that never stop leave no loss only when ``loss.mask_truncated_completions`` masks them: the cause
    reads the group's field from the hyper-parameters (``loss: {mask_truncated_completions: ...}``)."""
    from types import SimpleNamespace

    from tests.helpers.modules import unbuilt

    trainer = SimpleNamespace(callback_metrics={"grpo/response/eos_frac": torch.tensor(0.0)})
    masked = unbuilt(GRPO, loss={"mask_truncated_completions": True})
    assert masked.hparams["loss"]["mask_truncated_completions"] is True
    assert LearningCheck.cause(trainer, masked) == (
        "no response stopped: with loss.mask_truncated_completions every response is masked (raise "
        "sampling.max_new_tokens) (grpo/response/eos_frac 0)")
    assert LearningCheck.cause(trainer, unbuilt(GRPO)).startswith("every optimizer step's gradient was 0")


def test_the_summary_repeats_the_kl_spikes(tmp_path):
    from rlhf_lightning.callbacks import SpikeCheck
    from tests.callbacks.test_spikes import APPROX_KL, KL, Iterations

    check, report = SpikeCheck(), RunReport(print_at_fit_end=False)
    trainer = L.Trainer(max_steps=len(KL), logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[check, report])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Iterations(KL, APPROX_KL))
    assert "  [toy] KL spikes: iteration 15: toy/objective/kl 24 against 1.9 ± 0.75 · toy/policy/approx_kl 0.48 " \
           "against 0.02 ± 0.001\n" in report.summary_text
