"""The completions table reaches the W&B run and the run folder with the rollout's text and numbers, the final
policy's too, and the progress bar shows the PPO iteration, reward, KL and gold while training."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from rlhf_lightning.callbacks import CompletionsTable
from rlhf_lightning.cli.loggers import WandbLogger
from rlhf_lightning.runs.wandb_offline import find_run_file, read_history
from tests.helpers.online import make_ppo, prompts

ITERATIONS = 3


class SamplesKeeper(L.Callback):
    """Keeps a copy of every rollout's samples, to compare with what the table holds."""

    def __init__(self) -> None:
        self.samples = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples.append(pl_module.last_samples)


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, reward_dir, tmp_path_factory):
    """Three PPO iterations with an offline W&B logger, a table every 2 iterations and the progress bar on."""
    directory = tmp_path_factory.mktemp("completions")
    module = make_ppo(tiny_model_dir, reward_dir)
    keeper = SamplesKeeper()
    logger = WandbLogger(save_dir=str(directory), offline=True, name="completions-test")
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=ITERATIONS, limit_val_batches=0, logger=logger,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
        callbacks=[CompletionsTable(every_n_iterations=2, max_rows=3), keeper], default_root_dir=directory,
    )
    trainer.fit(module, datamodule=prompts(module, n=32))
    return directory, trainer, keeper.samples


def _table_files(directory: Path, expected: int, timeout: float = 30.0) -> list[Path]:
    """The logged tables' files; W&B's writer is another process, so give it a moment on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(directory.rglob("*.table.json"), key=lambda path: path.stat().st_mtime)
        if len(files) >= expected or time.monotonic() > deadline:
            return files
        time.sleep(0.5)


def test_the_table_is_logged_every_n_iterations_and_at_the_end_with_the_rollouts_rows(tiny_run):
    directory, trainer, samples = tiny_run
    files = _table_files(directory, expected=3)
    assert len(files) == 3  # rollouts drawn at iterations 0 and 2 of 0, 1, 2; the final policy after 3
    tables = [json.loads(path.read_text()) for path in files]
    for table, drawn in zip(tables, (samples[0], samples[2]), strict=False):
        assert table["columns"] == ["iteration", "prompt", "response", "score", "gold", "kl"]
        assert len(table["data"]) == 3
        for i, (iteration, prompt, response, score, gold, kl) in enumerate(table["data"]):
            assert iteration == drawn.iteration
            assert (prompt, response) == (drawn.prompts[i], drawn.responses[i])
            assert score == pytest.approx(drawn.scores[i], abs=1e-4)
            assert gold == pytest.approx(drawn.gold[i])
            assert kl == pytest.approx(drawn.kl[i], abs=1e-4)
    assert samples[0].kl == [0.0] * len(samples[0].kl)  # iteration 0 samples the SFT policy itself

    # The last table is the final policy's: the evaluation stream's responses to the first training batch
    # (no validation data here), the same when sampled again after the fit.
    module, datamodule = trainer.lightning_module, trainer.datamodule
    first = next(iter(datamodule.train_dataloader()["prompts"]))
    values, _, texts = module.held_out.sample_and_measure(first, 0)
    final = tables[2]["data"]
    assert [row[0] for row in final] == [ITERATIONS] * 3
    assert [(row[1], row[2]) for row in final] == list(zip(first["prompt"][:3], texts[:3], strict=True))
    assert [row[3] for row in final] == pytest.approx(values["score"][:3].tolist(), abs=1e-4)
    assert [row[5] for row in final] == pytest.approx(values["kl"][:3].tolist(), abs=1e-4)
    assert max(row[5] for row in final) > 0  # three updates away from the reference

    # The run's history points at those files (W&B stores the table reference as nested keys).
    logged = [row for row in read_history(find_run_file(directory)) if "ppo/completions/_type" in row]
    assert [row["ppo/completions/_type"] for row in logged] == ["table-file"] * 3
    assert all(row["ppo/completions/nrows"] == 3 and row["ppo/completions/ncols"] == 6 for row in logged)
    assert [Path(row["ppo/completions/path"]).name for row in logged] == [path.name for path in files]


def test_each_table_is_also_a_file_named_by_its_iteration(tiny_run):
    directory, _, _ = tiny_run
    written = sorted((directory / "completions").iterdir())
    assert [path.name for path in written] == ["iteration_0000.jsonl", "iteration_0002.jsonl", "iteration_0003.jsonl"]
    tables = [json.loads(path.read_text().splitlines()[0]) for path in _table_files(directory, expected=3)]
    for path, table in zip(written, tables, strict=True):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert {row["iteration"] for row in rows} == {int(path.stem.split("_")[1])}
        assert [list(row.values()) for row in rows] == table["data"]


def test_without_a_wandb_logger_only_the_file_is_written(tiny_run, tmp_path):
    _, _, samples = tiny_run
    module = SimpleNamespace(last_samples=samples[0])
    for loggers in ([], [CSVLogger(tmp_path)]):
        trainer = SimpleNamespace(loggers=loggers, is_global_zero=True, global_step=0, default_root_dir=tmp_path)
        CompletionsTable(every_n_iterations=1).on_train_batch_end(trainer, module, None, None, 0)
    assert not list(tmp_path.rglob("*.table.json")) and not list(tmp_path.rglob("*.wandb"))
    rows = [json.loads(line) for line in (tmp_path / "completions/iteration_0000.jsonl").read_text().splitlines()]
    assert [row["response"] for row in rows] == samples[0].responses[:16]


def test_the_progress_bar_shows_iteration_reward_kl_and_gold(tiny_run):
    _, trainer, samples = tiny_run
    shown = trainer.progress_bar_metrics
    assert {"iteration", "reward", "kl", "gold"} <= set(shown)
    assert shown["iteration"] == ITERATIONS
    last = samples[-1]
    assert shown["reward"] == pytest.approx(sum(last.scores) / len(last.scores), abs=1e-5)
    assert shown["gold"] == pytest.approx(sum(last.gold) / len(last.gold), abs=1e-5)
    assert shown["kl"] == pytest.approx(sum(last.kl) / len(last.kl), abs=1e-5)


def test_a_final_table_that_cannot_be_sampled_is_a_warning_not_a_lost_run(tiny_run, tmp_path):
    """The export comes after the final table: a failure to sample it (a reward service down, memory) warns."""
    _, trainer, _ = tiny_run
    module = trainer.lightning_module

    def unavailable(prompts, batch_idx):
        raise RuntimeError("the reward service returned 503")

    module.held_out.sample_and_measure, original = unavailable, module.held_out.sample_and_measure
    try:
        with pytest.warns(UserWarning, match=r"^CompletionsTable: the final policy's table was not written "
                                             r"\(RuntimeError: the reward service returned 503\)$"):
            CompletionsTable().on_train_end(trainer, module)
    finally:
        module.held_out.sample_and_measure = original
