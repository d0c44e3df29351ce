"""SharedBaseLM answers lm-eval's requests as lm-eval's own Hugging Face model does on the merged model, request by
request, and a trained adapter scores differently from its base: real lm-eval, local tasks, a tiny model."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval.models.huggingface import HFLM  # noqa: E402

from rlhf_lightning.cli.merge_command import merge_adapter  # noqa: E402
from rlhf_lightning.evaluation.evaluated_model import load_model, model_to_evaluate  # noqa: E402
from rlhf_lightning.evaluation.harness import HarnessSettings, metric_values, run_tasks  # noqa: E402
from rlhf_lightning.evaluation.harness_lm import SharedBaseLM, context_length, cut_at_stops  # noqa: E402
from rlhf_lightning.evaluation.tasks import load_tasks, select_tasks, task_manager  # noqa: E402
from tests.helpers.harness import evaluation_models  # noqa: E402

TASKS = ("tiny_nouns_gen", "tiny_nouns_mc", "tiny_nouns_ppl")
# Every example's answers kept; no bootstrap (its draws would only cost time); windows of 8 tokens, so that the
# perplexity task's texts need several and the longest contexts are cut.
SETTINGS = HarnessSettings(log_samples=True, bootstrap_iters=0)
MAX_LENGTH, BATCH_SIZE = 8, 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(base folder, adapter folder, task YAMLs)``: the sharp tiny base, the noun adapter trained on it."""
    return evaluation_models(tmp_path_factory.mktemp("harness"))


def evaluate_ours(path, task_files, role_expected):
    selection = select_tasks([str(path) for path in task_files])
    manager = task_manager(selection)
    shared, tokenizer, role = load_model(model_to_evaluate(str(path)), "cpu")
    assert role == role_expected
    lm = SharedBaseLM(shared, tokenizer, role, batch_size=BATCH_SIZE, max_length=MAX_LENGTH)
    return run_tasks(lm, load_tasks(manager, selection), SETTINGS, manager)


def test_our_answers_equal_lm_evals_hf_model_on_the_merged_model(trained, tmp_path):
    base, adapter, task_files = trained
    ours = evaluate_ours(adapter, task_files, "policy")
    merged = merge_adapter(adapter, tmp_path / "merged")
    selection = select_tasks([str(path) for path in task_files])
    manager = task_manager(selection)
    hf = HFLM(pretrained=str(merged), device="cpu", batch_size=BATCH_SIZE, max_length=MAX_LENGTH)
    theirs = run_tasks(hf, load_tasks(manager, selection), SETTINGS, manager)
    for task in TASKS:
        for mine, reference in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert mine["doc_id"] == reference["doc_id"] and mine["arguments"] == reference["arguments"]
            if task == "tiny_nouns_gen":  # the same text generated
                assert mine["resps"] == reference["resps"]
            elif task == "tiny_nouns_mc":  # per choice: the continuation's log-likelihood, whether greedy
                for [(logprob, greedy)], [(expected, expected_greedy)] in zip(mine["resps"], reference["resps"],
                                                                              strict=True):
                    assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
            else:  # the whole text's log-likelihood, over several windows
                assert mine["resps"][0][0] == pytest.approx(reference["resps"][0][0], abs=1e-4)
    values, expected = metric_values(ours), metric_values(theirs)
    assert values.keys() == expected.keys()
    assert {"tiny_nouns_gen/exact_match/first-word", "tiny_nouns_mc/acc", "tiny_nouns_mc/acc_norm",
            "tiny_nouns_ppl/word_perplexity"} <= values.keys()
    for name, value in expected.items():
        assert values[name] == pytest.approx(value, rel=1e-5), name


def test_a_trained_adapter_scores_differently_from_its_base(trained):
    base, adapter, task_files = trained
    before = metric_values(evaluate_ours(base, task_files, None))
    after = metric_values(evaluate_ours(adapter, task_files, "policy"))
    # Trained to end each sentence with its noun: it names it, and prefers it among the choices.
    assert before["tiny_nouns_gen/exact_match/first-word"] <= 0.2 < 0.8 <= after["tiny_nouns_gen/exact_match/first-word"]
    assert before["tiny_nouns_mc/acc"] < 0.5 < 0.9 <= after["tiny_nouns_mc/acc"]
    assert after["tiny_nouns_ppl/word_perplexity"] < before["tiny_nouns_ppl/word_perplexity"]


def test_the_context_length_and_the_stops_are_lm_evals():
    class Config:
        n_positions = None
        max_position_embeddings = 512

    class Tokenizer:
        model_max_length = 10**30  # transformers' "no limit"

    assert context_length(Config(), Tokenizer()) == 512
    Config.max_position_embeddings = None
    assert context_length(Config(), Tokenizer()) == 2048
    assert cut_at_stops("dog . the cat\n\nQ:", [".", "\n\n"]) == "dog "
    assert cut_at_stops("dog", ["", "."]) == "dog"
