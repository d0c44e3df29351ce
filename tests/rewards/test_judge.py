"""JudgeReward: templates, parsers, the shared-base judge against the HF model by hand, an OpenAI-compatible endpoint
served from a real local model on the loopback address, its failures, and parse failures counted in a real fit."""

from __future__ import annotations

import csv
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_lightning import SFT, JudgeReward
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards.http import EndpointError
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.judge_parsers import expected_score, parse_label, parse_number
from rlhf_lightning.rewards.judge_template import JudgeTemplate
from tests.helpers.environment import with_repo_on_path
from tests.helpers.models import LORA, built

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the cat", "a robot", "my friend"]
RESPONSES = ["is good .", "sees the dog .", "is very sad ."]
TOPICS = ["cat", "robot", "friend"]
TEMPLATE = "{prompt} {response} the {topic} is"
LABELS = {"good": 1.0, "bad": 0.0}


def inputs() -> RewardInputs:
    ids = torch.zeros(len(PROMPTS), 2, dtype=torch.long)  # what token-reading sources read; a judge reads texts
    return RewardInputs(ids, torch.ones_like(ids), torch.ones(len(PROMPTS), dtype=torch.long), list(PROMPTS),
                        list(RESPONSES), [[0]] * len(PROMPTS), {"topic": list(TOPICS)})


@pytest.fixture(scope="module")
def policy_base(tiny_model_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    return SharedBase(load_causal_lm(spec, tokenizer)), tokenizer


# ---- templates and parsers ---------------------------------------------------------------------------------


def test_the_template_fills_prompt_response_and_a_column():
    text = JudgeTemplate("Q: {prompt}\nA: {response}\nReference: {answer}\nScore 0-10:")
    assert text.columns == ["answer"]
    assert text.render("add 2 + 2", "4", {"answer": 4}) == "Q: add 2 + 2\nA: 4\nReference: 4\nScore 0-10:"
    chat = JudgeTemplate([{"role": "system", "content": "Grade strictly; braces as {{this}}."},
                          {"role": "user", "content": "{prompt} -> {response} (rubric: {rubric})"}])
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.render(conversation, "hello", {"rubric": "polite"}) == [
        {"role": "system", "content": "Grade strictly; braces as {this}."},
        {"role": "user", "content": "hi -> hello (rubric: polite)"}]


@pytest.mark.parametrize(("template", "columns", "message"), [
    ("{prompt} {response} {reference}", ["answer"],
     "JudgeReward template: field {reference} is not a column of the prompt data (its columns: answer); a template "
     "may name {prompt}, {response} and the data's columns"),
    ("{prompt} {response", [], "JudgeReward template: expected '}' before end of string (write a literal brace as "
                               "{{ or }})"),
    ("{0} {response}", [], "JudgeReward template: field {0} is not a plain name; write {prompt}, {response} or "
                           "{column} (a literal brace as {{ or }})"),
    ([{"role": "user"}], [], "JudgeReward template message 0: expected {role: ..., content: ...} (two strings), got "
                             "{'role': 'user'}"),
    ("Is this answer to {prompt} correct?", [], "JudgeReward template: it never names {response}, so the judge would "
                                                "never see the responses it scores; put {response} where the response "
                                                "goes (got 'Is this answer to {prompt} correct?')"),
])
def test_a_template_that_cannot_be_filled_is_one_line(template, columns, message):
    with pytest.raises(ValueError) as error:
        JudgeReward(template, parser="number").check_columns(columns)
    assert str(error.value) == message


def test_the_parsers_read_real_answers():
    assert parse_number("Score: 7/10. The answer is right.", 0, 10) == pytest.approx(0.7)
    assert parse_number(" 3", 1, 5) == pytest.approx(0.5)
    assert parse_number("I would give it 11", 0, 10) is None  # out of range
    assert parse_number("hard to say", 0, 10) is None
    assert parse_label(" Yes, the final answer matches.", {"yes": 1.0, "no": 0.0}) == 1.0
    assert parse_label("NO", {"yes": 1.0, "no": 0.0}) == 0.0
    assert parse_label("not sure", {"yes": 1.0, "no": -1.0}) is None
    assert parse_label("very good", {"good": 0.5, "very good": 1.0}) == 1.0  # the longest label that matches
    assert expected_score([0.3, 0.1], [1.0, 0.0]) == pytest.approx(0.75)
    assert expected_score([0.0, 0.0], [1.0, 0.0]) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(parser="labels", labels={}), "JudgeReward parser labels: labels is empty; give a label -> score map, e.g. "
                                      "{yes: 1.0, no: 0.0}"),
    (dict(parser="number", low=10, high=1), "JudgeReward parser number: low (10) must be below high (1), both finite"),
    (dict(parser="logprob", labels={"yes": 1.0}), "JudgeReward parser logprob: labels has 1 entry; the probabilities "
                                                  "are normalised over the labels, so give at least two"),
    (dict(adapter="outputs/judge/adapters/sft"), "JudgeReward adapter outputs/judge/adapters/sft: no "
                                                 "adapter_config.json there; train one with the SFT stage (lora, "
                                                 "export_format: adapter) or fix the path"),
    (dict(base_url="http://127.0.0.1:8000/v1"), "JudgeReward base_url http://127.0.0.1:8000/v1: set model, the "
                                                "model name the endpoint serves"),
])
def test_settings_that_cannot_work_are_one_line(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        JudgeReward(TEMPLATE, **kwargs)
    assert str(error.value) == message


def test_a_missing_api_key_variable_is_one_line(policy_base, monkeypatch):
    monkeypatch.delenv("JUDGE_KEY_FOR_TEST", raising=False)
    judge = JudgeReward(TEMPLATE, base_url="http://127.0.0.1:9/v1", model="judge", api_key_env="JUDGE_KEY_FOR_TEST")
    with pytest.raises(ValueError) as error:
        judge.setup(*policy_base)
    assert str(error.value) == ("JudgeReward endpoint http://127.0.0.1:9/v1: the environment variable "
                                "JUDGE_KEY_FOR_TEST (api_key_env) is not set or empty; export the API key there")


# ---- the shared-base judge, by hand ------------------------------------------------------------------------


def by_hand(model_dir: Path, adapter: Path | None, prompts: list[str]) -> tuple[list[float], list[str]]:
    """P(good) over good/bad as the next token, and the greedy answers, straight from transformers and peft."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    good, bad = tokenizer.convert_tokens_to_ids(["good", "bad"])
    scores, answers = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            probabilities = model(input_ids=ids).logits[0, -1].softmax(-1)
            scores.append(float(probabilities[good] / (probabilities[good] + probabilities[bad])))
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return scores, answers


@pytest.mark.parametrize("with_adapter", [False, True], ids=["adapters-disabled", "judge-adapter"])
def test_the_shared_base_judge_scores_as_the_hf_model_by_hand(tiny_model_dir, reward_dir, with_adapter):
    spec = BaseModelSpec(name_or_path=str(tiny_model_dir))
    tokenizer = load_tokenizer(spec)
    base = SharedBase(load_causal_lm(spec, tokenizer))
    base.add_adapter("policy", LORA)  # the policy's, left alone
    adapter = reward_dir if with_adapter else None  # a peft adapter with a random non-zero update
    prompts = [TEMPLATE.format(prompt=p, response=r, topic=t)
               for p, r, t in zip(PROMPTS, RESPONSES, TOPICS, strict=True)]
    expected_scores, expected_answers = by_hand(tiny_model_dir, adapter, prompts)
    settings = dict(adapter=str(adapter)) if adapter else {}
    logprob = JudgeReward(TEMPLATE, parser="logprob", labels=LABELS, **settings)
    labels = JudgeReward(TEMPLATE, parser="labels", labels={"is": 1.0, "the": 0.5}, name="labels", **settings)
    for judge in (logprob, labels):
        judge.setup(base, tokenizer)
    training_stream = torch.get_rng_state()
    assert logprob.score(inputs()).tolist() == pytest.approx(expected_scores, abs=1e-5)
    assert labels.judge.answers(labels.prompts(inputs())) == expected_answers
    assert torch.equal(torch.get_rng_state(), training_stream)  # greedy: no training random number drawn
    # each judge adapter is a role of the one base: no second copy of the weights
    assert base.adapters == (["policy", "judge", "labels"] if with_adapter else ["policy"])


def test_a_judge_prompt_longer_than_the_model_is_cut_from_the_left(policy_base, tiny_model_dir):
    base, tokenizer = policy_base
    judge = JudgeReward("{prompt} {response} is", parser="logprob", labels=LABELS)
    judge.setup(base, tokenizer)
    long = inputs()
    long.completions = ["the dog is very good and " * 20] * 3  # 120 words: the model has 64 positions
    ids = tokenizer(judge.prompts(long)[0])["input_ids"][-64:]  # its end, where the question is
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        probabilities = model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
    good, bad = tokenizer.convert_tokens_to_ids(["good", "bad"])
    expected = float(probabilities[good] / (probabilities[good] + probabilities[bad]))
    assert judge.score(long).tolist() == pytest.approx([expected] * 3, abs=1e-5)


def test_the_sft_stage_exports_a_judge_adapter_for_the_same_base(tiny_model_dir, tmp_path, policy_base):
    sft = built(SFT(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), lora=LORA, export_format="adapter"))
    folder = sft.export(tmp_path / "adapters")
    assert folder == tmp_path / "adapters" / "sft" and (folder / "adapter_config.json").is_file()
    base, tokenizer = policy_base
    JudgeReward(TEMPLATE, parser="logprob", labels=LABELS, adapter=str(folder), name="exported").setup(base, tokenizer)
    assert "exported" in base.adapters
    with pytest.raises(ValueError) as error:
        SFT(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), export_format="adapter")
    assert str(error.value) == "export_format: adapter exports the LoRA adapter; set lora (or export_format: merged)"


def test_the_arithmetic_judge_config_reads_the_judge_rows_template():
    import yaml

    from rlhf_lightning.tasks.arithmetic_judge import JUDGE_TEMPLATE, VERDICTS, ArithmeticJudgeTask

    judge = yaml.safe_load((REPO / "configs/arithmetic_grpo_judge.yaml").read_text())["model"]["init_args"]["reward"]
    assert judge["init_args"]["template"] == JUDGE_TEMPLATE and judge["init_args"]["labels"] == VERDICTS
    row = ArithmeticJudgeTask(seed=0).prompt_rows(2)[1]
    assert row == {"prompt": "add 6 7 + 6 6 5", "answer": 732, "reference": "7 3 2"}


def test_the_arithmetic_judge_rows_carry_the_checkers_verdict_and_easy_negatives():
    from rlhf_lightning.tasks.arithmetic import final_answer, prompt_text
    from rlhf_lightning.tasks.arithmetic_judge import EASY_NEGATIVES, ArithmeticJudgeTask

    rows = ArithmeticJudgeTask(seed=3).sft_rows(4000)
    assert rows == ArithmeticJudgeTask(seed=3).sft_rows(4000) and rows != ArithmeticJudgeTask(seed=4).sft_rows(4000)
    far = 0
    for row in rows:
        # "add A + B <response> , answer <reference> =": B is the reference's sum less A.
        head, reference = row["prompt"].removesuffix(" =").rsplit(" , answer ", 1)
        total = int(reference.replace(" ", ""))
        a = int(head.removeprefix("add ").split(" + ", 1)[0].replace(" ", ""))
        problem = prompt_text(a, total - a)
        assert head.startswith(problem + " "), row
        response = head.removeprefix(problem + " ")
        answer = final_answer(response)
        assert row["completion"] == (" 1" if answer == total else " 0"), row
        # A slip moves one digit of the sum by at most 2; a random answer of the sum's length is mostly further.
        far += answer is not None and abs(answer - total) > 2 * 10 ** (len(str(total)) - 1)
    assert 0.5 * EASY_NEGATIVES < far / len(rows) < EASY_NEGATIVES
    # Half the policy-like responses are right and a tenth are cut short; the easy negatives take their share.
    right = sum(row["completion"] == " 1" for row in rows) / len(rows)
    assert abs(right - 0.5 * 0.9 * (1 - EASY_NEGATIVES)) < 0.03


# ---- an OpenAI-compatible endpoint on the loopback address ---------------------------------------------------


def completions_app(model_dir: Path):
    """A FastAPI app serving /v1/completions from the real model in ``model_dir`` (greedy, top log-probs of the
    first token), a /broken/v1 that answers HTTP 500 and a /legacy/v1 that answers another schema."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    app, app.state.broken_calls = FastAPI(), 0

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/completions")
    def completions(body: dict) -> dict:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = []
        for index, prompt in enumerate(prompts):
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=body["max_tokens"], eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id, output_scores=True,
                                     return_dict_in_generate=True)
            choice = {"index": index, "text": tokenizer.decode(out.sequences[0, ids.shape[1]:],
                                                               skip_special_tokens=True)}
            if body.get("logprobs"):
                first = out.scores[0][0].log_softmax(-1).topk(body["logprobs"])
                top = zip(first.values.tolist(), first.indices.tolist(), strict=True)
                choice["logprobs"] = {"top_logprobs": [{tokenizer.decode([i]): v for v, i in top}]}
            choices.append(choice)
        return {"object": "text_completion", "model": body["model"], "choices": choices}

    @app.post("/broken/v1/completions")
    def broken(body: dict) -> JSONResponse:
        app.state.broken_calls += 1
        return JSONResponse({"error": "out of memory"}, status_code=500)

    @app.post("/legacy/v1/completions")
    def legacy(body: dict) -> dict:
        return {"outputs": ["good"]}

    return app


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The app above run by uvicorn in a thread on a free loopback port; its base URL."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = completions_app(tiny_model_dir)
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url, app
    running.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_endpoint_judge_answers_as_the_model_it_serves(server, policy_base, tiny_model_dir, batch_size):
    url, _ = server
    local = JudgeReward(TEMPLATE, parser="labels", labels={"is": 1.0, "the": 0.5}, model=str(tiny_model_dir))
    remote = JudgeReward(TEMPLATE, parser="labels", labels={"is": 1.0, "the": 0.5}, model="tiny",
                         base_url=f"{url}/v1", batch_size=batch_size)
    for judge in (local, remote):
        judge.setup(*policy_base)
    prompts = local.prompts(inputs())
    assert remote.judge.answers(prompts) == local.judge.answers(prompts)
    assert remote.score(inputs()).tolist() == local.score(inputs()).tolist()
    # parser logprob reads the first token's top log-probs: P("is") renormalised over the labels found there
    logprob = JudgeReward(TEMPLATE, parser="logprob", labels={"is": 1.0, "the": 0.0}, model="tiny",
                          base_url=f"{url}/v1", batch_size=batch_size)
    logprob.setup(*policy_base)
    rows = logprob.judge.label_probabilities(prompts, ["is", "the"])
    assert logprob.score(inputs()).tolist() == pytest.approx([p_is / (p_is + p_the) for p_is, p_the in rows])
    assert all(p_is > 0 for p_is, _ in rows)


@pytest.mark.parametrize("case", ["down", "http-500", "wrong-schema"])
def test_endpoint_failures_are_one_line_naming_the_endpoint(server, policy_base, case):
    url, app = server
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    base_url = {"down": f"http://127.0.0.1:{closed}/v1", "http-500": f"{url}/broken/v1",
                "wrong-schema": f"{url}/legacy/v1"}[case]
    judge = JudgeReward(TEMPLATE, model="tiny", base_url=base_url, retries=2, backoff=0.01, timeout=5, retry_for=0)
    judge.setup(*policy_base)
    calls = app.state.broken_calls
    with pytest.raises(EndpointError) as error:
        judge.score(inputs())
    expected = {
        "down": f"judge tiny at {base_url}/completions: connection refused or host unreachable (is the server "
                "running?) (3 tries, timeout 5s each)",
        "http-500": f'judge tiny at {base_url}/completions: HTTP 500: out of memory (3 tries, timeout '
                    "5s each)",
        "wrong-schema": f"judge tiny at {base_url}/completions: the answer does not follow the OpenAI schema "
                        "{choices: [{index, text, logprobs: {top_logprobs: [{token: logprob}]}}]}: got "
                        '{"outputs": ["good"]}',
    }[case]
    assert str(error.value) == expected
    if case == "http-500":
        assert app.state.broken_calls - calls == 3  # the first try and two retries


# ---- parse failures in a real fit ----------------------------------------------------------------------------


@pytest.mark.slow
def test_parse_failures_are_counted_logged_and_warned_once_in_a_fit(tiny_model_dir, tmp_path):
    """GRPO through the command line with a judge on the shared base asked for a number it never writes (the tiny
    model speaks only the synthetic language): every response is a failure scored -1, logged each iteration."""
    env = with_repo_on_path()
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_lightning", "fit", "--config", str(REPO / "configs/grpo.yaml"),
         f"--model.init_args.base.name_or_path={tiny_model_dir}", "--model.init_args.reward=rlhf_lightning.JudgeReward",
         "--model.init_args.reward.template={prompt} {response} is", "--model.init_args.reward.parser=number",
         "--model.init_args.reward.failure_score=-1", "--model.init_args.reward.max_new_tokens=3",
         "--model.init_args.sampling.max_new_tokens=4", "--model.init_args.samples_per_prompt=2",
         "--model.init_args.policy_lora={r: 4, alpha: 8}", "--data.init_args.synthetic_rows=12",
         "--data.init_args.val_fraction=0", "--data.init_args.batch_size=4", "--trainer.max_steps=-1",
         "--trainer.limit_train_batches=2", "--trainer.max_epochs=1", "--trainer.callbacks=[]",
         "--trainer.enable_progress_bar=false", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
         f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.init_args.export_dir=null"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "could not parse the answer" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: JudgeReward judge (shared base (adapters "
                                                         "disabled)): could not parse the answer '"), warnings
    assert warnings[0].endswith("(expected a number in [0, 10]); such rows score -1 (failure_score), counted in "
                                "objective/judge/parse_failures (this warning is printed once)")
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = [row for row in csv.DictReader(file) if row.get("grpo/objective/judge/parse_failures")]
    assert [float(row["grpo/objective/judge/parse_failures"]) for row in rows] == [8.0, 8.0]
    assert [float(row["grpo/objective/judge/parse_failure_rate"]) for row in rows] == [1.0, 1.0]
    assert [float(row["grpo/objective/score"]) for row in rows] == [-1.0, -1.0]


def test_the_judge_agreement_script_scores_the_policys_own_responses(tiny_arithmetic_dir, tmp_path):
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("judge_agreement", REPO / "benchmarks/judge_agreement.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    sft = built(SFT(base=BaseModelSpec(name_or_path=str(tiny_arithmetic_dir)), lora=LORA, export_format="adapter"))
    with torch.no_grad():
        for name, parameter in sft.model.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)  # a judge that is not the base
    adapter = sft.export(tmp_path / "adapters")
    argv = [str(tiny_arithmetic_dir), str(adapter), "--responses", "24", "--max-new-tokens", "6"]
    line = script.main(argv)
    assert line == script.main(argv)  # seeded: the same responses and verdicts
    numbers = dict(re.findall(r"(responses|SFT policy|checker|says correct) ([0-9.]+)", line))
    accuracy, agreement, says = (float(numbers[key]) for key in ("SFT policy", "checker", "says correct"))
    assert numbers["responses"] == "24" and min(accuracy, agreement, says) >= 0 and max(accuracy, agreement, says) <= 1
    # P(verdict = gold) is bounded by the two marginals: |P(v=1) - P(g=1)| <= P(v != g) <= min(1, P(v=1) + P(g=1))
    assert abs(says - accuracy) - 1e-4 <= 1 - agreement <= min(1.0, says + accuracy) + 1e-4
    # the figures by hand: verdicts 1, 0, 1, 0 (P > 0.5) against gold 1, 1, 0, 0
    assert script.agreement_line(torch.tensor([0.9, 0.2, 0.6, 0.1]), torch.tensor([1.0, 1.0, 0.0, 0.0])) == (
        "responses 4 · checker accuracy of the SFT policy 0.5000 · judge agreement with the checker 0.5000 · judge "
        "says correct 0.5000 · P(1) on right 0.5500 · on wrong 0.3500")
    assert script.agreement_line(torch.tensor([0.7]), torch.tensor([1.0])).endswith("on right 0.7000 · on wrong n/a")
