"""``python -m rlhf_lightning evaluate``: lm-eval's table printed and the results written, for an adapter on its base,
a run folder and a merged model; one line for every mistake (a missing adapter, a folder without a model, an adapter
whose base was retrained, a task that is not there, a task whose data is on the hub while offline)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("lm_eval")

from rlhf_lightning.cli import main  # noqa: E402
from rlhf_lightning.cli.merge_command import merge_adapter  # noqa: E402
from tests.helpers.cli import one_line  # noqa: E402
from tests.helpers.harness import evaluation_models  # noqa: E402
from tests.helpers.models import retrain_in_place  # noqa: E402

QUICK = ["--batch_size", "4", "--bootstrap_iters", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(base folder, adapter folder, (generation task, multiple-choice task, perplexity task))``."""
    return evaluation_models(tmp_path_factory.mktemp("evaluate"))


def test_an_adapter_on_its_base_prints_the_table_and_writes_the_results(trained, capsys, tmp_path):
    base, adapter, (generate, choice, _) = trained
    main(["evaluate", "--model", str(adapter), "--tasks", f"{generate},{choice}", *QUICK, "--limit", "6",
          "--gen_kwargs", "max_gen_toks=2", "--log_samples", "true", "--output", "eval/nouns.json"])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "Tasks" and len(table) == 5  # header, rule, exact match, acc, acc_norm
    assert "tiny_nouns_gen" in table[2] and "exact_match" in table[2] and "tiny_nouns_mc" in table[3]
    assert out.rstrip().endswith("results: eval/nouns.json")
    results = json.loads((tmp_path / "eval" / "nouns.json").read_text())
    assert results["model"] == {"base": str(base), "adapter": str(adapter), "role": "policy"}
    assert results["settings"]["limit"] == 6 and results["settings"]["gen_kwargs"] == {"max_gen_toks": 2}
    assert results["results"]["tiny_nouns_mc"]["acc,none"] >= 0.8
    assert len(results["samples"]["tiny_nouns_gen"]) == 6
    assert all(sample["arguments"][0][1]["max_gen_toks"] == 2 for sample in results["samples"]["tiny_nouns_gen"])


def test_a_run_folder_and_a_merged_model_score_as_the_adapter(trained, capsys, tmp_path):
    base, adapter, (generate, choice, perplexity) = trained
    tasks = f"{generate},{choice},{perplexity}"
    shutil.copytree(adapter, tmp_path / "run" / "adapters" / "policy")
    merge_adapter(adapter, tmp_path / "sft-run" / "model")
    scores = {}
    for name, model in (("adapter", str(adapter)), ("run", "run"), ("merged", "sft-run")):
        main(["evaluate", "--model", model, "--tasks", tasks, *QUICK, "--output", f"{name}.json"])
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
    capsys.readouterr()
    assert scores["run"]["model"]["adapter"] == "run/adapters/policy"
    assert scores["merged"]["model"] == {"base": "sft-run/model", "adapter": None, "role": None}
    for name in ("run", "merged"):
        for task, values in scores["adapter"]["results"].items():
            for key, value in values.items():
                expected = pytest.approx(value, rel=1e-5) if isinstance(value, float) else value
                assert scores[name]["results"][task][key] == expected, (name, task, key)


def test_the_chat_template_and_the_few_shot_examples_reach_the_prompts(trained, capsys, tmp_path):
    base, adapter, (generate, _, _) = trained
    main(["evaluate", "--model", str(adapter), "--tasks", str(generate), *QUICK, "--limit", "2", "--num_fewshot", "2",
          "--apply_chat_template", "true", "--log_samples", "true", "--output", "chat.json"])
    capsys.readouterr()
    results = json.loads((tmp_path / "chat.json").read_text())
    assert results["n-shot"] == {"tiny_nouns_gen": 2}
    for sample in results["samples"]["tiny_nouns_gen"]:  # the synthetic tokenizer's template: two turns, then ours
        prompt = sample["arguments"][0][0]
        assert prompt.startswith("<user> ") and prompt.count("<assistant>") == 3 and prompt.endswith("<assistant>")


def test_the_help_lists_lm_evals_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m rlhf_lightning evaluate")
    for option in ("--model", "--tasks", "--base", "--include_path", "--batch_size", "--limit", "--num_fewshot",
                   "--apply_chat_template", "--gen_kwargs", "--output"):
        assert option in out, option


def test_a_missing_adapter_a_folder_without_a_model_and_a_missing_task_file_are_one_line(trained, capsys, tmp_path):
    base, adapter, (generate, _, _) = trained
    assert one_line(capsys, "evaluate", "--model", "outputs/ppo/adapters/policy", "--tasks", str(generate)) == (
        "error: outputs/ppo/adapters/policy does not exist: give a model folder, an adapter folder (e.g. "
        "outputs/ppo/adapters/policy) or a run folder (e.g. outputs/ppo)")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert one_line(capsys, "evaluate", "--model", "run", "--tasks", str(generate)) == (
        "error: run holds no model to evaluate: not a model folder (config.json), not an adapter folder "
        "(adapter_config.json), and not a run folder with an export (adapters/policy or model)")
    assert one_line(capsys, "evaluate", "--model", str(adapter), "--tasks", "nouns.yaml") == (
        "error: task file nouns.yaml not found (a task is an lm-eval task name or a task YAML file)")
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    assert one_line(capsys, "evaluate", "--model", str(adapter), "--tasks", "nameless.yaml") == (
        "error: task file nameless.yaml names no task: it needs a `task: NAME` (or `group: NAME`) key")


def test_an_adapter_whose_base_was_retrained_is_one_line(trained, capsys, tmp_path):
    base, adapter, (generate, _, _) = trained
    moved = shutil.copytree(base, tmp_path / "base")
    copied = shutil.copytree(adapter, tmp_path / "policy")
    retrain_in_place(moved)
    line = one_line(capsys, "evaluate", "--model", str(copied), "--base", str(moved), "--tasks", str(generate))
    assert line.startswith(f"error: the policy adapter {copied} was trained on other weights than base {moved} holds "
                           "now (its base_fingerprint.json says ")
    assert "train the policy adapter again on this base, or load the base it was trained on" in line


@pytest.mark.slow
def test_a_task_of_the_hub_offline_and_an_unknown_task_are_one_line(trained, capsys):
    """lm-eval's own task list is indexed (seconds); hellaswag's data would come from the hub, which the tests'
    environment forbids (HF_DATASETS_OFFLINE)."""
    base, adapter, _ = trained
    assert one_line(capsys, "evaluate", "--model", str(adapter), "--tasks", "hellaswag") == (
        "error: task hellaswag: its data cannot be loaded (Couldn't reach 'Rowan/hellaswag' on the Hub "
        "(OfflineModeIsEnabled)); a task of lm-eval reads its dataset from the Hugging Face hub, which needs a "
        "network (and HF_DATASETS_OFFLINE unset) or the dataset in the local cache: offline, give a task YAML on "
        "local files (dataset_path: json, dataset_kwargs: {data_files: ...})")
    line = one_line(capsys, "evaluate", "--model", str(adapter), "--tasks", "hellaswagg")
    assert line.startswith("error: no lm-eval task 'hellaswagg' (closest: hellaswag, ")  # then lm-eval's translations
    assert line.endswith("): give one of lm-eval's tasks (`lm-eval ls tasks` lists them), a task YAML file, or a "
                         "folder of task YAMLs (include_path)")
