"""The reward server (``python -m rlhf_lightning serve-reward``) and its client ``RemoteReward``: the real server
started on the loopback address, its schemas, scores equal to the in-process adapter's, batching, a fit through
it, and each refusal as one line."""

from __future__ import annotations

import csv
import json
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from rlhf_lightning import AdapterReward, RemoteReward
from rlhf_lightning.cli import main
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rewards.inputs import RewardInputs, reward_inputs
from rlhf_lightning.rewards.remote_protocol import tokenizer_identity
from rlhf_lightning.serving.command import require_serving
from tests.helpers.reward_server import SERVED_CLASS, reward_server
from tests.helpers.served_sources import NAN_MARKER

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # scores through the server vs in this process, in batches of other rows: float rounding


@dataclass
class Server:
    url: str

    def served(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/info").json()["served"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, reward_dir, tmp_path_factory) -> Iterator[Server]:
    """The real server, serving the reward adapter (NaN for :data:`NAN_MARKER`); SIGTERM must end it cleanly."""
    with reward_server(tmp_path_factory.mktemp("serve"), tiny_model_dir, reward_dir, max_batch_size=8,
                       max_wait_ms=50) as started:
        yield Server(started.url)
    assert "Traceback" not in started.stderr, started.stderr[-3000:]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(BaseModelSpec(name_or_path=str(tiny_model_dir)))


def rollout_inputs(tokenizer, rows: int = 7, seed: int = 0):
    """Reward inputs laid out as a rollout lays them out: prompts of several lengths left-padded, responses of
    several lengths right-padded, some stopped by EOS, each closed with EOS where the score is read."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.arange(len(tokenizer))
    words = words[~torch.isin(words, torch.tensor(tokenizer.all_special_ids))]
    prompt_len, response_len = 6, 5
    ids = torch.full((rows, prompt_len + response_len), tokenizer.pad_token_id)
    attention = torch.zeros_like(ids)
    response_mask = torch.zeros((rows, response_len), dtype=torch.long)
    for row in range(rows):
        p = 2 + row % (prompt_len - 1)
        r = 1 + (row * 2) % response_len
        ids[row, prompt_len - p:prompt_len] = words[torch.randint(len(words), (p,), generator=generator)]
        ids[row, prompt_len:prompt_len + r] = words[torch.randint(len(words), (r,), generator=generator)]
        if row % 2:
            ids[row, prompt_len + r - 1] = tokenizer.eos_token_id
        attention[row, prompt_len - p:prompt_len + r] = 1
        response_mask[row, :r] = 1
    prompts = [tokenizer.decode(row[mask.bool()][:-1]) for row, mask in zip(ids[:, :prompt_len],
                                                                            attention[:, :prompt_len], strict=True)]
    completions = [tokenizer.decode(row[mask.bool()], skip_special_tokens=True)
                   for row, mask in zip(ids[:, prompt_len:], response_mask, strict=True)]
    return reward_inputs(ids, attention, response_mask, completions, prompts, None, tokenizer)


def rows_of(inputs: RewardInputs, start: int, stop: int) -> RewardInputs:
    return RewardInputs(inputs.input_ids[start:stop], inputs.attention_mask[start:stop],
                        inputs.last_index[start:stop], inputs.prompts[start:stop], inputs.completions[start:stop],
                        inputs.completion_ids[start:stop])


def test_info_names_the_source_its_statistics_and_tokenizer(server, tokenizer, tiny_model_dir):
    info = httpx.get(f"{server.url}/info").json()
    assert info["schema"] == 1
    assert info["source"] == {"name": "reward_model", "class": SERVED_CLASS, "may_abstain": False}
    assert info["statistics"] == {"mean": 0.5, "std": 2.0}  # the adapter's reward_stats.json
    # The tokenizer's identity, with its folder by name only: no path of the server's machine reaches a client.
    assert info["tokenizer"] == {**tokenizer_identity(tokenizer), "name": Path(tiny_model_dir).name}
    assert "/" not in json.dumps(info["tokenizer"])
    assert info["max_batch_size"] == 8
    remote = RemoteReward(server.url)
    remote.setup(None, tokenizer)
    assert (remote.name, remote.statistics, remote.may_abstain) == ("reward_model", (0.5, 2.0), False)


def test_scores_through_the_server_equal_the_in_process_adapter(server, tiny_model_dir, reward_dir, tokenizer):
    inputs = rollout_inputs(tokenizer)
    base = SharedBase(load_causal_lm(BaseModelSpec(name_or_path=str(tiny_model_dir)), tokenizer))
    local = AdapterReward(str(reward_dir))
    local.setup(base, tokenizer)
    with torch.no_grad():
        expected = local.score(inputs)
    remote = RemoteReward(server.url)
    remote.setup(None, tokenizer)
    scores = remote.score(inputs)
    assert scores.shape == (7,) and expected.std() > 0.01  # distinct scores, so that a row mix-up shows
    assert torch.equal(scores, expected), (scores - expected).abs().max()  # the batch's own layout: the same bits
    chunked = RemoteReward(server.url, batch_size=3)  # requests of 3, 3 and 1 rows: other batches, other rounding
    chunked.setup(None, tokenizer)
    torch.testing.assert_close(chunked.score(inputs), expected, rtol=0, atol=TOLERANCE)
    # Without a layout the server left-pads the sequences itself (the attended tokens of each row).
    sequences = [row[mask.bool()].tolist() for row, mask in zip(inputs.input_ids, inputs.attention_mask, strict=True)]
    repadded = httpx.post(f"{server.url}/score", json={"prompts": inputs.prompts, "completions": inputs.completions,
                                                       "input_ids": sequences}).json()["scores"]
    torch.testing.assert_close(torch.tensor(repadded), expected, rtol=0, atol=TOLERANCE)
    # Text alone (a client outside this package): the server encodes it as the reward stage encodes a completion,
    # the prompt's tokens, the completion's, EOS.
    text = {"prompts": inputs.prompts[:1], "completions": inputs.completions[:1]}
    encoded = (tokenizer(text["prompts"][0])["input_ids"]
               + tokenizer(text["completions"][0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    from_text = httpx.post(f"{server.url}/score", json=text).json()["scores"]
    assert from_text == httpx.post(f"{server.url}/score", json={**text, "input_ids": [encoded]}).json()["scores"]


def test_concurrent_requests_are_scored_in_shared_batches(server, tokenizer):
    inputs = rollout_inputs(tokenizer, rows=8, seed=1)
    remote = RemoteReward(server.url, batch_size=1)
    remote.setup(None, tokenizer)
    alone = remote.score(inputs)  # one request per row, one after another: a batch each
    before = server.served()
    results: dict[int, float] = {}
    start = threading.Barrier(8)

    def one_row(row: int) -> None:
        client = RemoteReward(server.url)
        client.setup(None, tokenizer)
        start.wait()
        results[row] = float(client.score(rows_of(inputs, row, row + 1))[0])

    threads = [threading.Thread(target=one_row, args=(row,)) for row in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = server.served()
    assert after["requests"] - before["requests"] == 8 and after["rows"] - before["rows"] == 8
    assert after["batches"] - before["batches"] < 8  # requests waiting together were scored together
    torch.testing.assert_close(torch.tensor([results[row] for row in range(8)]), alone, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(("body", "expected"), [
    ({"prompts": ["a"]}, "completions: Field required; expected {"),
    ({"prompts": ["a", "b"], "completions": ["c"]}, "prompts has 2 entries for 1 completions: expected one per "
                                                    "completion"),
    ({"prompts": ["a"], "completions": ["c"], "input_ids": [[5, 10**6]]},
     "input_ids row 0 holds token id 1000000: expected ids in [0, "),
    ({"prompts": ["a"], "completions": ["c"], "input_ids": [[]]}, "input_ids row 0 is empty: expected the prompt's"),
    ({"prompts": ["a"], "completions": ["c"], "input_ids": [[5] * 65]},
     "input_ids row 0 has 65 tokens, beyond the 64 positions of the served model"),
    ({"prompts": ["a"], "completions": ["c"], "scores": [1]}, "scores: Extra inputs are not permitted; expected {"),
    ({"prompts": ["a", "b"], "completions": ["c", "d"], "input_ids": [[0, 5], [6]], "attention_mask": [[0, 1], [1]]},
     "input_ids/attention_mask row 1 has 1/1 entries, row 0 2: expected rows of one width (the padded batch)"),
    ({"prompts": ["a"], "completions": ["c"], "input_ids": [[0, 5]], "attention_mask": [[0, 0]]},
     "attention_mask row 0: expected 0 and 1, with a 1 on each attended token"),
    ("not json", "body: Invalid JSON: expected ident at line 1 column 2; expected {"),
    ('{"prompts": ["a"], "completions": ["\\ud800"]}', "body: Invalid JSON: unexpected end of hex escape at line 1 column 43; expected {"),
    ({"prompts": ["a"] * 1025, "completions": ["c"] * 1025}, "completions has 1025 entries, beyond the server's "
                                                             "max_rows 1024: send fewer per request"),
], ids=["missing", "lengths", "token-id", "empty", "too-long", "extra-key", "layout-width", "layout-mask",
        "not-json", "lone-surrogate", "too-many-rows"])
def test_a_bad_request_is_a_422_with_one_line(server, body, expected):
    if isinstance(body, str):
        response = httpx.post(f"{server.url}/score", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{server.url}/score", json=body)
    assert response.status_code == 422
    assert list(response.json()) == ["error"] and "\n" not in response.json()["error"]
    assert response.json()["error"].startswith(expected), response.json()["error"]


def test_a_non_finite_score_is_refused_naming_the_row(server, tokenizer):
    inputs = rollout_inputs(tokenizer, rows=3)
    inputs.completions[2] = NAN_MARKER
    remote = RemoteReward(server.url)
    remote.setup(None, tokenizer)
    with pytest.raises(ValueError) as error:
        remote.score(inputs)
    assert str(error.value) == (f"RemoteReward {server.url}/score: row 2 (completion {NAN_MARKER!r}): the served "
                                "source 'reward_model' gave null (NaN): expected a finite float")


def test_a_server_that_is_down_stops_the_run_at_setup_in_one_line(tiny_model_dir, capsys):
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "ppo_remote.yaml"), "--trainer.logger=false",
              f"--model.init_args.base.name_or_path={tiny_model_dir}",
              f"--model.init_args.reward.init_args={{url: {dead}, retries: 0, timeout: 5}}",
              "--data.init_args.synthetic_rows=16", "--data.init_args.batch_size=8"])
    assert exit_info.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: RemoteReward {dead}/info: connection refused or host unreachable (is the server "
                     "running?) (1 try, timeout 5s each)"]


class FakeEndpoint(BaseHTTPRequestHandler):
    """A web server that is not a reward server (or a broken one): it answers ``answers[path]`` as JSON."""

    answers: dict[str, object] = {}

    def do_GET(self) -> None:
        self.answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer()

    def answer(self) -> None:
        body = json.dumps(self.answers[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint(server, tokenizer) -> Iterator[tuple[str, dict]]:
    """A stand-in web server on a free loopback port, whose /info is the real server's until a test changes it."""
    answers = {"/info": httpx.get(f"{server.url}/info").json(), "/score": {"scores": [0.5, 1.5]}}
    http = ThreadingHTTPServer(("127.0.0.1", 0), type("Endpoint", (FakeEndpoint,), {"answers": answers}))
    thread = threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_address[1]}", answers
    http.shutdown()


@pytest.mark.parametrize(("answer", "expected"), [
    ({"score": [0.5, 1.5]}, "/score: expected {\"scores\": [one per completion]}, got ['score']"),
    ({"scores": [0.5]}, "/score returned 1 scores for 2 completions (rows 0-1)"),
    ({"scores": [0.5, "high"]}, "/score: row 1 (completion 'b'): 'high' is not a score (expected a number, null or "
                                "'inf'/'-inf')"),
    ({"scores": ["-inf", 0.5]}, "/score: row 0 (completion 'a'): the served source 'reward_model' gave '-inf': "
                                "expected a finite float"),
], ids=["key", "count", "value", "infinite"])
def test_a_wrong_score_answer_is_refused_in_one_line(endpoint, tokenizer, answer, expected):
    url, answers = endpoint
    answers["/score"] = answer
    remote = RemoteReward(url, retries=0)
    remote.setup(None, tokenizer)
    inputs = rows_of(rollout_inputs(tokenizer, rows=2), 0, 2)
    inputs.completions[:] = ["a", "b"]
    with pytest.raises(ValueError) as error:
        remote.score(inputs)
    assert str(error.value) == f"RemoteReward {url}{expected}"


def test_not_a_reward_server_or_another_tokenizer_is_refused_at_setup(endpoint, tokenizer):
    url, answers = endpoint
    answers["/info"]["tokenizer"]["fingerprint"] = "0" * 32
    with pytest.raises(ValueError, match=r"the server's tokenizer \(.* tokens, EOS \d+\) is not this run's \(.*\): "
                                         "responses travel as token ids"):
        RemoteReward(url).setup(None, tokenizer)
    answers["/info"] = {"models": ["gpt-4"]}
    with pytest.raises(ValueError) as error:
        RemoteReward(url).setup(None, tokenizer)
    assert str(error.value) == (f"RemoteReward {url}/info: not a reward server's answer (expected schema 1 with keys "
                                "schema, source, statistics, tokenizer, max_batch_size, served; got ['models']): is "
                                "the url serve-reward's?")


def test_the_server_without_fastapi_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # what Python does for a package that is not installed
    with pytest.raises(RuntimeError) as error:
        require_serving()
    assert str(error.value) == ("serve-reward needs fastapi and uvicorn (import of fastapi halted; None in "
                                "sys.modules): pip install -e '.[serve]' (in the repository's clone)")


def test_a_ppo_fit_through_the_server_logs_the_in_process_scores(server, tiny_model_dir, reward_dir, tmp_path):
    """PPO trains on the server's scores (weight 1) while the in-process adapter scores the same rollouts beside
    it (weight 0): both are logged at every iteration, the same to the last digit."""
    sources = (f"[{{class_path: rlhf_lightning.RemoteReward, init_args: {{url: {server.url}, name: remote}}}}, "
               f"{{class_path: rlhf_lightning.AdapterReward, init_args: {{path: {reward_dir}}}}}]")
    main([  # the command line in this process: a second interpreter would double the test's time
        "fit", "--config", str(REPO / "configs" / "ppo_remote.yaml"),
        f"--model.init_args.base.name_or_path={tiny_model_dir}", f"--model.init_args.reward={sources}",
        "--model.init_args.reward_shaping.weights=[1.0, 0.0]", "--model.init_args.policy_lora={r: 4, alpha: 8}",
        "--model.init_args.critic.lora={r: 4, alpha: 8}", "--model.init_args.sampling.max_new_tokens=6",
        "--model.init_args.update.epochs=1", "--data.init_args.synthetic_rows=16", "--data.init_args.val_fraction=0.0",
        "--data.init_args.batch_size=8", "--trainer.max_epochs=1", "--trainer.limit_val_batches=0",
        "--validate_at_start.enabled=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir=logs",
    ])
    with open(next(tmp_path.rglob("metrics.csv"))) as file:
        rows = [row for row in csv.DictReader(file) if row.get("ppo/objective/score/remote")]
    assert len(rows) == 2  # two iterations, each scored by both
    for row in rows:  # each rollout of 8 rows scored in one batch of the server, in the rollout's layout
        assert row["ppo/objective/score/remote"] == row["ppo/objective/score/reward_model"]
        assert row["ppo/objective/score"] == row["ppo/objective/score/remote"]  # trained on the server's


def test_serve_reward_refusals_are_one_line(tiny_model_dir, reward_dir, tmp_path, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    adapter = f"{{class_path: rlhf_lightning.AdapterReward, init_args: {{path: {reward_dir}}}}}"
    missing = f"{{class_path: rlhf_lightning.AdapterReward, init_args: {{path: {tmp_path}}}}}"
    base = f"--base.name_or_path={tiny_model_dir}"
    cases = [
        ([base, "--reward", adapter, "--port", str(port)], 1,
         f"error: serve-reward cannot listen on 127.0.0.1:{port} (Address already in use): choose another --port "
         "(0 = a free one) or --host"),
        (["--base", str(tiny_model_dir), "--reward", missing, "--port", "0"], 1,  # --base PATH: the model folder
         f"error: reward adapter: {tmp_path}/adapter_config.json not found; run the reward stage first (python -m "
         "rlhf_lightning fit --config configs/reward.yaml) or set reward.init_args.path"),
        ([base, "--reward", adapter, "--max_batch_size", "0"], 1, "error: max_batch_size must be an integer >= 1, got 0"),
        ([base, "--reward", adapter, "--port", "http"], 2, "error: port: Expected a <class 'int'>. Got value: http"),
    ]
    with taken:
        for arguments, code, expected in cases:
            with pytest.raises(SystemExit) as exit_info:
                main(["serve-reward", *arguments])
            assert exit_info.value.code == code
            assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")] == [expected]


def needs_reference(prompts, completions, reference, **columns):
    """A served reward function that needs a column ``reference`` (TRL's signature)."""
    return [float(c == r) for c, r in zip(completions, reference, strict=True)]


def test_a_request_without_a_column_the_function_needs_is_the_clients_mistake_named(tokenizer):
    """A 422 (the server answers a RequestError so), which RemoteReward does not retry: not a 500 with Python's
    'missing 1 required positional argument'."""
    from rlhf_lightning.rewards.sources import FunctionReward
    from rlhf_lightning.serving.scoring import RequestError, RewardService

    service = RewardService(FunctionReward(needs_reference), None, tokenizer, torch.device("cpu"))
    with pytest.raises(RequestError, match=r"^columns: reward function .*needs_reference needs column 'reference', "
                                           r"which the prompt data lacks .*\(the request's columns are the prompt "
                                           r"data here\)$"):
        service.rows(["p"], ["c"], None, None, {})
    assert len(service.rows(["p"], ["c"], None, None, {"reference": ["c"]})) == 1


def lengths(completions, **kwargs):
    """A served reward function: each completion's length."""
    return [float(len(c)) for c in completions]


def test_a_row_that_cannot_fit_is_refused_by_its_head_before_it_is_encoded_whole(server, tokenizer):
    """A 4 MB completion is refused for the model's 64 positions by its first kilobyte; a long text whose head fits
    (spaces, which the tokenizer drops) is encoded whole and scored."""
    from rlhf_lightning.rewards.sources import FunctionReward
    from rlhf_lightning.serving.scoring import RequestError, RewardService

    huge = "the dog " * 500_000
    response = httpx.post(f"{server.url}/score", json={"prompts": ["a"], "completions": [huge]}, timeout=60)
    assert response.status_code == 422
    assert response.json() == {"error": "row 0: the completion has 4000000 characters, and its first 1023 alone are "
                                        "256 tokens, beyond the 64 positions of the served model"}
    service = RewardService(FunctionReward(lengths), None, tokenizer, torch.device("cpu"), max_length=64)
    with pytest.raises(RequestError, match=r"^row 1: the prompt has 40000 characters, and its first 1023 alone"):
        service.rows(["a", "the dog " * 5000], ["b", "c"], None, None, {})
    sparse = "the" + " " * 5000 + "dog"
    assert service.rows(["a"], [sparse], None, None, {}).sequences[0][-3:-1] == tokenizer("the dog")["input_ids"]
