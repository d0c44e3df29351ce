"""LMEvaluation: lm-eval tasks on the policy during a PPO fit, on the module's own base with the policy adapter on,
logged as ``eval/<task>/<metric>`` every N iterations and after the last; the last figures are the exported
adapter's, evaluated by the command; the fit draws and logs what it would have without the callback."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

import lightning as L  # noqa: E402

from rlhf_lightning.callbacks import LMEvaluation, RunReport  # noqa: E402
from rlhf_lightning.callbacks.lm_evaluation import evaluated_role  # noqa: E402
from rlhf_lightning.cli.evaluate_command import evaluate  # noqa: E402
from rlhf_lightning.cli.loggers import WandbLogger  # noqa: E402
from rlhf_lightning.evaluation.harness import HarnessSettings, metric_values  # noqa: E402
from rlhf_lightning.runs.wandb_offline import read_history  # noqa: E402
from tests.helpers.harness import write_tasks  # noqa: E402
from tests.helpers.models import LORA, with_random_adapter  # noqa: E402
from tests.helpers.online import make_ppo, prompts  # noqa: E402

KEYS = {"eval/tiny_nouns_gen/exact_match/first-word", "eval/tiny_nouns_mc/acc", "eval/tiny_nouns_mc/acc_norm"}


def fit_rows(tiny_model_dir, reward_dir, folder, callbacks) -> list[dict]:
    module = make_ppo(tiny_model_dir, reward_dir, export_dir=str(folder / "adapters"))
    trainer = L.Trainer(logger=WandbLogger(save_dir=str(folder), offline=True), log_every_n_steps=1, max_epochs=1,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=folder, callbacks=callbacks)
    trainer.fit(module, datamodule=prompts(module, n=12, batch_size=4))
    return read_history(folder)


@pytest.mark.slow
def test_a_fit_logs_the_tasks_every_n_iterations_and_after_the_last(tiny_model_dir, reward_dir, tmp_path, capsys):
    generate, choice, _ = write_tasks(tmp_path / "tasks")
    harness = HarnessSettings(bootstrap_iters=0)
    callback = LMEvaluation([str(generate), str(choice)], every_n_iterations=2, harness=harness)
    report = RunReport()
    rows = fit_rows(tiny_model_dir, reward_dir, tmp_path / "evaluated", [callback, report])
    training = [row for row in rows if "ppo/loss/total" in row]
    assert [row["ppo/iteration"] for row in training] == [1, 2, 3]
    assert [row.keys() >= KEYS for row in training] == [False, True, True]  # iteration 2, then the last (3)
    assert not any(key.startswith("eval/") for key in training[0])
    # The last figures are the exported policy's, as the evaluate command scores it on its base.
    exported = evaluate(str(tmp_path / "evaluated" / "adapters" / "policy"), f"{generate},{choice}",
                        bootstrap_iters=0, output=str(tmp_path / "exported.json"))
    assert {f"eval/{name}": value for name, value in metric_values(exported).items()} == pytest.approx(
        {key: training[-1][key] for key in KEYS}, abs=1e-6)
    assert callback.last_iteration == 3 and "  lm-eval (after iteration 3): tiny_nouns_gen/exact_match/first-word " \
        in capsys.readouterr().out
    # Row for row the same run without it: an evaluation leaves the random streams as they were.
    plain = fit_rows(tiny_model_dir, reward_dir, tmp_path / "plain", [])
    clocks = ("/time/", "/throughput/", "_timestamp", "_runtime", "artifact", "eval/")
    assert [{k: v for k, v in row.items() if not any(c in k for c in clocks)} for row in rows] == \
        [{k: v for k, v in row.items() if not any(c in k for c in clocks)} for row in plain]


def test_auto_evaluates_the_policy_else_the_only_trainable_adapter_else_the_base(tiny_model_dir):
    model, _ = with_random_adapter(tiny_model_dir, role="sft")
    assert evaluated_role(model, "auto") == "sft" and evaluated_role(model, None) is None
    model.trainable_adapters.clear()
    assert evaluated_role(model, "auto") is None
    model.add_adapter("policy", LORA)
    assert evaluated_role(model, "auto") == "policy" and evaluated_role(model, "sft") == "sft"


def test_a_missing_task_file_is_refused_when_the_callback_is_made(tmp_path):
    with pytest.raises(FileNotFoundError, match="task file nouns.yaml not found"):
        LMEvaluation(["nouns.yaml"])
    with pytest.raises(ValueError, match="every_n_iterations"):
        LMEvaluation([str(write_tasks(tmp_path)[0])], every_n_iterations=0)
