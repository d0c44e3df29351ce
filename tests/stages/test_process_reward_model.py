"""The process reward model stage: TRL's stepwise rows and their one-line errors, labels at the separators, the
arithmetic task's checked steps, the loss falling, gradients reaching exactly the prm adapter and head, and a fit
through the command line that logs its metrics and exports the adapter."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from rlhf_lightning.cli import main
from rlhf_lightning.data.collate import IGNORE_INDEX
from rlhf_lightning.data.modules import StepwiseDataModule
from rlhf_lightning.models.shared_base import adapter_of
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.stages.process_reward_model import ProcessRewardModel
from rlhf_lightning.tasks.arithmetic import (
    ArithmeticTask,
    final_answer,
    parse_prompt,
    step_labels,
    worked_answer,
)
from tests.helpers.cli import one_line
from tests.helpers.models import LORA, built

REPO = Path(__file__).resolve().parents[2]


def prm(tiny_arithmetic_dir, **kwargs) -> ProcessRewardModel:
    torch.manual_seed(0)
    return built(ProcessRewardModel(base=BaseModelSpec(name_or_path=str(tiny_arithmetic_dir)), lora=LORA,
                                    separator=",", **kwargs))


def stepwise(module: ProcessRewardModel, **kwargs) -> StepwiseDataModule:
    data = StepwiseDataModule(**{"dataset": "arithmetic", "synthetic_rows": 64, "batch_size": 16,
                                 "val_fraction": 0.25, **kwargs})
    data.tokenizer, data.separator = module.tokenizer, module.separator
    data.setup("fit")
    return data


def test_steps_are_labelled_by_checking_them_and_wrong_from_the_first_slip_on():
    right = worked_answer(47, 38)[0].split(" , ")
    assert step_labels(47, 38, right) == [True, True, True]
    slipped = worked_answer(47, 38, slip=(0, 1))[0].split(" , ")  # 7 + 8 written as 16: everything after is wrong
    assert slipped[1] == right[1] and step_labels(47, 38, slipped) == [False, False, False]
    late = worked_answer(47, 38, slip=(1, 1))[0].split(" , ")  # the tens slip: the first step stays right
    assert step_labels(47, 38, late) == [True, False, False]
    rows = ArithmeticTask(seed=0).stepwise_rows(400)
    for row in rows:  # a response's last label is the exact checker's verdict
        a, b = parse_prompt(row["prompt"])
        assert row["labels"][-1] == (final_answer(row["completions"][-1]) == a + b)
    share_wrong = sum(not row["labels"][-1] for row in rows) / len(rows)
    assert 0.4 < share_wrong < 0.55  # half with a slip, a few slips clipped back to the right sum


def test_labels_sit_at_the_separators_and_last_step_only_keeps_the_last(tiny_arithmetic_dir):
    module = prm(tiny_arithmetic_dir)
    comma = module.tokenizer.convert_tokens_to_ids(",")
    data = stepwise(module, train_on_last_step_only=True)
    for examples, last_only in ((data.train_set, True), (data.val_set, False)):
        for example in examples:
            ids, labels = torch.tensor(example.input_ids), torch.tensor(example.labels)
            assert ids[-1] == comma  # the last step is followed by the separator too (TRL's encoding)
            separators = (ids == comma).nonzero().flatten()
            labelled = (labels != IGNORE_INDEX).nonzero().flatten()
            assert labelled.tolist() == (separators[-1:] if last_only else separators).tolist()
    # One row by hand: "add 4 7 + 3 8" then "7 + 8 = 1 6 ," (wrong) ... with labels 0 at each separator.
    row = {"prompt": "add 4 7 + 3 8", "completions": ["7 + 8 = 1 5", "4 + 3 + 1 = 8", "answer 8 5"],
           "labels": [True, True, False]}
    from rlhf_lightning.data.sources import Record
    example = data.encode(Record("hand", row))
    tokens = module.tokenizer.convert_ids_to_tokens(example.input_ids)
    assert " ".join(tokens) == "add 4 7 + 3 8 7 + 8 = 1 5 , 4 + 3 + 1 = 8 , answer 8 5 ,"
    assert [(tokens[i], label) for i, label in enumerate(example.labels) if label != IGNORE_INDEX] == [
        (",", 1), (",", 1), (",", 0)]


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "add 1 + 2", "completions": ["1 + 2 = 3", "answer 3"], "labels": [True]},
     "line 2: 1 labels for 2 steps: expected one label per step (column 'labels' against column 'completions')"),
    ({"prompt": "add 1 + 2", "completions": ["1 + 2 = 3", "answer 3"], "labels": [True, 1]},
     "line 2: column 'labels' label 2: expected true (a right step) or false, found int 1"),
    ({"prompt": "add 1 + 2", "completions": ["1 + 2 = 3 , answer 3"], "labels": [True]},
     "line 2: column 'completions' step 1: holds the step separator ',', which marks where a step ends: "
     "'1 + 2 = 3 , answer 3'"),
    ({"prompt": "add 1 + 2", "completion": "1 + 2 = 3"},
     "line 2: missing columns: expected prompt+completions+labels (TRL's stepwise form"),
])
def test_a_bad_row_is_one_line_naming_the_file_and_row(tiny_arithmetic_dir, tmp_path, capsys, row, message):
    good = {"prompt": "add 1 + 2", "completions": ["1 + 2 = 3", "answer 3"], "labels": [True, True]}
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, row, good, good)) + "\n")
    line = one_line(capsys, *prm_cli(tiny_arithmetic_dir, f"--data.init_args.dataset={path}",
                                     "--trainer.logger=false"))
    assert line == f"error: {path} {message}" or line.startswith(f"error: {path} {message}"), line


def test_a_separator_of_several_tokens_is_one_line(tiny_arithmetic_dir, capsys):
    line = one_line(capsys, *prm_cli(tiny_arithmetic_dir, "--model.init_args.separator=answer 1",
                                     "--trainer.logger=false"))
    assert line.startswith("error: separator='answer 1' is 2 tokens [") and "a step's end must be one token" in line


def test_training_lowers_the_loss_and_reaches_only_the_prm_adapter_and_head(tiny_arithmetic_dir):
    module = prm(tiny_arithmetic_dir)
    batch = next(iter(stepwise(module).train_dataloader()))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(8):
        logits, labels, _ = module._labelled(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        if step == 1:  # once lora_B has moved off zero, every adapter weight gets a gradient
            with_grad = {name for name, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum()}
            expected = {name for name, _ in module.named_parameters()
                        if adapter_of(name) == "prm" or name.startswith("model.heads.prm")}
            assert with_grad == expected
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def prm_cli(tiny_arithmetic_dir, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs/arithmetic_prm.yaml"),
            f"--model.init_args.base.name_or_path={tiny_arithmetic_dir}", "--model.init_args.lora={r: 4, alpha: 8}",
            "--data.init_args.synthetic_rows=48", "--data.init_args.batch_size=8", "--trainer.max_steps=3",
            "--trainer.val_check_interval=3", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1", *extra]


@pytest.mark.slow
def test_the_prm_stage_fits_from_the_cli_logs_its_metrics_and_exports(tiny_arithmetic_dir, tmp_path):
    main(prm_cli(tiny_arithmetic_dir, "--data.init_args.val_fraction=0.25",
                 "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={tmp_path}"))
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = list(csv.DictReader(file))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"prm/loss", "prm/step_accuracy", "prm/lr", "prm/val/loss", "prm/val/step_accuracy",
            "prm/val/solution_accuracy", "prm/val/wrong_step_auroc", "prm/val/wrong_step_f1"} <= logged
    accuracy = [float(row["prm/val/step_accuracy"]) for row in rows if row.get("prm/val/step_accuracy")]
    assert len(accuracy) == 2 and all(0 <= value <= 1 for value in accuracy)  # before the first step, and after 3
    export = tmp_path / "outputs/arithmetic/prm/adapters/prm"
    assert {"adapter_config.json", "adapter_model.safetensors", "head.safetensors", "base_fingerprint.json",
            "prm_config.json"} <= {path.name for path in export.iterdir()}
    comma = ProcessRewardModel(base=BaseModelSpec(name_or_path=str(tiny_arithmetic_dir))).tokenizer.convert_tokens_to_ids(",")
    assert json.loads((export / "prm_config.json").read_text()) == {"separator": ",", "separator_id": comma}
