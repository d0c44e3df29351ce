"""vLLM's own server as the rollout engine (``engine: VLLMServer``), for real: one server of the tiny Llama started
on 127.0.0.1 with vLLM's CPU build (``served``, in ``tests/rollout/conftest.py``), shared by the tests of the session (the tests marked ``vllm``, in the README's
vLLM environment). Its log-probs agree with the trainer's pass, the adapter goes to it by version after each sync, a
stale or missing adapter stops the draw in one line, the same seeds redraw the same responses, a GRPO fit trains on
it, and a server that serves another base, a too short ``max_model_len`` or a server that died are one line. Its
argument checks and refusals run everywhere."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rlhf_lightning.cli import main
from rlhf_lightning.core.policy import POLICY, pad_to_sequence
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.logprobs import token_logprobs
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rollout.engines import EngineSetup
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_process import ServerError, request_json
from rlhf_lightning.rollout.vllm_server import VLLMServer
from rlhf_lightning.rollout.vllm_support import installed_version
from tests.helpers.models import LORA, save_reward_adapter
from tests.helpers.preemption import COMMON, ONLINE

with_vllm = pytest.mark.vllm
TEMPERATURE = 0.7


# ---- everywhere ---------------------------------------------------------------------------------------------

def test_its_arguments_and_what_it_cannot_serve_are_refused_in_one_line(tiny_model_dir):
    with pytest.raises(ValueError, match="engine.init_args.urls: name at least one server, or null to start one"):
        VLLMServer(urls=[])
    gpt2 = VLLMServer(urls=["http://127.0.0.1:1"]).refusal(EngineSetup("cpu", name_or_path=str(tiny_model_dir),
                                                                       adapters={POLICY: LORA}))
    assert "no LoRA for that family" in gpt2
    # under FSDP2 it is allowed: the server has the weights, the trainer its shards
    started = VLLMServer().refusal(EngineSetup("cpu", sharded=True, name_or_path=None))
    if installed_version() is None:
        assert started.startswith("the engine VLLMServer (without urls) needs vLLM, which is not installed")
    else:
        assert "base.name_or_path" in started


def test_an_unreachable_server_is_one_line_when_the_fit_is_set_up(tiny_llama_dir, tmp_path):
    engine = VLLMServer(urls=["http://127.0.0.1:9"], request_timeout=5)
    with pytest.raises(ServerError, match=r"^cannot reach the vLLM server: GET http://127.0.0.1:9/v1/models: "):
        engine.prepare(EngineSetup("cpu", name_or_path=str(tiny_llama_dir), run_folder=str(tmp_path)))


def test_a_fit_given_an_unreachable_server_stops_at_setup_in_one_line(tiny_llama_dir, reward_dir, capsys):
    from tests.helpers.cli import grpo, one_line

    line = one_line(capsys, *grpo(tiny_llama_dir, reward_dir, "--model.init_args.engine={class_path: "
                                  "rlhf_lightning.rollout.vllm_server.VLLMServer, init_args: {urls: "
                                  "[http://127.0.0.1:9], request_timeout: 5}}"))
    assert line.startswith("error: cannot reach the vLLM server: GET http://127.0.0.1:9/v1/models: ")


# ---- one server for the session (tests/rollout/conftest.py) ------------------------------------------------------------------------------

def draw(served, texts=("good movie", "the plot was", "i"), group=4, seeds=None, settings=None):
    model, sampler, tokenizer, _ = served
    tokenizer.padding_side = "left"
    batch = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    if settings is not None:
        sampler.settings = settings
    return sampler.draw(model, POLICY, batch["input_ids"], batch["attention_mask"], group, seeds)


def trainer_gap(model, drawn) -> float:
    mask = pad_to_sequence(drawn.mask, drawn.sequences.shape[1])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, POLICY, drawn.sequences, drawn.attention_mask, mask, TEMPERATURE)
    return float((logprobs[:, -drawn.mask.shape[1]:] - drawn.logprobs)[drawn.mask].abs().max())


def served_names(engine) -> set[str]:
    return {card["id"] for card in request_json("GET", f"{engine.url}/v1/models", None, 10)["data"]}


@with_vllm
def test_the_servers_tokens_come_with_the_trainers_log_probs_and_the_same_seeds_redraw_them(served):
    model, _, _, engine = served
    first = draw(served, seeds=list(range(12)))
    assert first.tokens.shape[0] == 12 and first.mask.any()
    gap = trainer_gap(model, first)
    assert gap < 1e-4
    print(f"\nthe server's log-probs against the trainer's pass: largest gap {gap:.2e}")
    assert engine.loaded == {POLICY: 0} and engine.adapter_name(POLICY, 0) in served_names(engine)
    assert engine.adapter_name(POLICY, 0).startswith("policy-v0-")
    again = draw(served, seeds=list(range(12)))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.logprobs, again.logprobs)


@with_vllm
def test_each_sync_loads_a_new_version_by_name_and_retires_the_one_before(served):
    model, sampler, _, engine = served
    draw(served)
    lora_b = next(p for name, p in model.model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.add_(0.3)  # what an optimizer step does
    sampler.sync(model, POLICY, 1)
    names = served_names(engine)
    assert engine.adapter_name(POLICY, 1) in names and engine.adapter_name(POLICY, 0) not in names
    assert (engine.run_folder / "engine-adapters" / "policy-v1" / "adapter_model.safetensors").is_file()
    assert engine.push_seconds < 5.0
    assert trainer_gap(model, draw(served)) < 1e-4  # the server samples from the updated adapter


@with_vllm
def test_drawing_ahead_keeps_loaded_the_versions_another_rank_may_still_draw_from(served):
    """Ranks sharing a server load a version under one name, and another rank's producer may still draw from one
    this rank has released: at staleness S the S + 1 newest versions stay loaded, whatever this rank's pins say (a
    DDP run drawing ahead on one server failed with a 404 for a version rank 0 had unloaded)."""
    model, sampler, _, engine = served
    engine.keep_versions(1)
    try:
        for version in (10, 11, 12):
            sampler.sync(model, POLICY, version)
            engine.serve_version(model, POLICY, version).release()  # this rank is done with it at once
        names = served_names(engine)
        assert {engine.adapter_name(POLICY, 11), engine.adapter_name(POLICY, 12)} <= names
        assert engine.adapter_name(POLICY, 10) not in names  # older than any rank's rollout in flight
    finally:
        engine.keep_versions(0)
        sampler.sync(model, POLICY, 13)  # loaded at once again, the versions before it retired


@with_vllm
def test_a_stale_or_missing_adapter_stops_the_draw_in_one_line(served, monkeypatch):
    model, sampler, _, engine = served
    version = engine.loaded[POLICY]
    lora_b = next(p for name, p in model.model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.add_(0.1)  # an update the loop did not sync
    with pytest.raises(RuntimeError, match=rf"the adapter 'policy' changed since its last sync \(version {version}\)"):
        draw(served)
    real_call = engine.call
    # a sync whose load silently does nothing: the server never holds the next version
    monkeypatch.setattr(engine, "call", lambda method, path, body=None: None if "lora_adapter" in path
                        else real_call(method, path, body))
    sampler.sync(model, POLICY, version + 1)
    monkeypatch.undo()
    with pytest.raises(ServerError, match=rf"answered 404 to POST .*/v1/completions: .*policy-v{version + 1}"):
        draw(served)
    engine.loaded.pop(POLICY)  # what the server holds is unknown now: the next draw loads the synced version
    engine.resident.pop(POLICY)
    assert trainer_gap(model, draw(served)) < 1e-4


@with_vllm
def test_a_server_of_another_base_and_a_too_short_max_model_len_are_one_line(served, tiny_model_dir):
    model, _, _, engine = served
    other = SharedBase(load_causal_lm(BaseModelSpec(name_or_path=str(tiny_model_dir)),
                                      load_tokenizer(BaseModelSpec(name_or_path=str(tiny_model_dir)))))
    with pytest.raises(ServerError, match=rf"serves .*, not the trainer's base {tiny_model_dir}"):
        VLLMServer(urls=[engine.url]).prepare(EngineSetup("cpu", name_or_path=str(tiny_model_dir)))  # at setup
    with pytest.raises(ServerError, match=rf"serves .*, not the trainer's base {tiny_model_dir}"):
        VLLMServer(urls=[engine.url]).connect(other)  # at the first draw, where the setup named no folder
    sampler, kept = served[1], served[1].settings
    try:
        with pytest.raises(ValueError, match=rf"exceed the vLLM server's max_model_len \(.*\) {engine.max_model_len}:"):
            draw(served, settings=SamplingSettings(max_new_tokens=engine.max_model_len, stop_token_ids=()))
    finally:
        sampler.settings = kept


@with_vllm
@pytest.mark.slow
def test_a_grpo_fit_trains_on_a_server_it_is_given(served, server_url, tiny_llama_dir, tmp_path):
    from tests.helpers.cli import REPO

    _, _, _, engine = served
    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    history = tmp_path / "run"
    main(["fit", "--config", str(REPO / "configs" / "grpo.yaml"), f"--model.init_args.base.name_or_path={tiny_llama_dir}",
          f"--model.init_args.reward.init_args.path={reward}", *COMMON, *ONLINE,
          "--model.init_args.engine={class_path: rlhf_lightning.rollout.vllm_server.VLLMServer, init_args: {urls: ["
          f"{server_url}]}}}}", "--model.init_args.export_dir=null", "--trainer.limit_train_batches=2",
          "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={history}"])
    versions = sorted(folder.name for folder in (history / "engine-adapters").iterdir())
    assert versions[-1] == "policy-v4" and len(versions) >= 2  # 2 iterations x 2 epochs x 1 minibatch
    run = hashlib.sha1(str((history / "engine-adapters").resolve()).encode()).hexdigest()[:8]
    fits = {name for name in served_names(engine) if name.endswith(f"-{run}")}
    assert fits == {f"policy-v4-{run}"}  # the fit's last version, beside ours and other fits' (the session's server)


def server_fit(llama, reward, url: str, *extra: str) -> list[str]:
    from tests.helpers.cli import REPO

    return ["--config", str(REPO / "configs" / "grpo.yaml"), f"--model.init_args.base.name_or_path={llama}",
            f"--model.init_args.reward.init_args.path={reward}", *COMMON, *ONLINE,
            "--model.init_args.engine={class_path: rlhf_lightning.rollout.vllm_server.VLLMServer, init_args: "
            f"{{urls: [{url}]}}}}", "--model.init_args.export_dir=null", "--trainer.limit_val_batches=0", *extra]


@with_vllm
@pytest.mark.slow
def test_two_ddp_or_fsdp2_ranks_on_one_server_train_as_one_process_does(served, server_url, tiny_llama_dir, tmp_path):
    """One process on the whole batch, then two CPU ranks (DDP, then FSDP2: the adapter gathered from its shards
    and written by rank 0) on its halves, each sending its prompts to the same server, seeded per prompt."""
    from tests.helpers.distributed import STRATEGIES, largest_differences
    from tests.helpers.preemption import drive, run

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    arguments = server_fit(tiny_llama_dir, reward, server_url, "--trainer.limit_train_batches=2",
                           "--model.init_args.seed_scope=prompt")
    single = drive(tmp_path, "single", [run(tmp_path, "single", [*arguments, "--data.init_args.batch_size=4"])])
    assert single.returncode == 0, single.stderr[-4000:]
    full = torch.load(tmp_path / "single.pt")
    for layout in ("ddp", "fsdp2"):
        ranks = drive(tmp_path, layout, [run(tmp_path, layout, [*arguments, "--data.init_args.batch_size=2",
                                                                 *STRATEGIES[layout]])])
        assert ranks.returncode == 0, ranks.stderr[-4000:]
        largest = largest_differences(full, torch.load(tmp_path / f"{layout}.pt"))
        print(f"\nthe vLLM server engine on two {layout} ranks against one process: largest differences {largest}")


@with_vllm
@pytest.mark.slow
def test_a_grpo_run_on_the_server_resumes_exactly_after_kill_9(served, server_url, tiny_llama_dir, tmp_path):
    from tests.helpers.preemption import kill_and_resume

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    arguments = server_fit(tiny_llama_dir, reward, server_url, "--trainer.limit_train_batches=4",
                           "--trainer.enable_checkpointing=true")
    _, resumed_probe = kill_and_resume(tmp_path, arguments)
    print(f"\nthe vLLM server engine, GRPO killed with SIGKILL in iteration 3 and resumed: "
          f"{sum(len(row) for row in resumed_probe['metrics'])} logged values equal the uninterrupted run's")


def api_servers() -> set[int]:
    import psutil

    return {process.pid for process in psutil.process_iter(["cmdline"])
            if "vllm.entrypoints.openai.api_server" in " ".join(process.info["cmdline"] or [])}


@with_vllm
@pytest.mark.slow
def test_a_server_the_fit_started_ends_with_the_fit_even_when_it_is_killed(served, tiny_llama_dir, tmp_path):
    """Without ``urls`` the fit starts its own server; a kill -9 of the fit leaves no server behind."""
    import signal
    import time

    from tests.helpers.preemption import drive, run

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    before = api_servers()
    arguments = [*server_fit(tiny_llama_dir, reward, "http://unused", "--trainer.limit_train_batches=3")]
    arguments[arguments.index(next(a for a in arguments if "VLLMServer" in a))] = (
        "--model.init_args.engine={class_path: rlhf_lightning.rollout.vllm_server.VLLMServer, init_args: "
        "{kv_cache_gib: 0.25}}")
    killed = drive(tmp_path, "killed", [run(tmp_path, "killed", arguments, {
        "class_path": "tests.helpers.equivalence.KillAt", "init_args": {"iteration": 2, "step": 1}})])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    assert (tmp_path / "killed" / "engine-adapters" / "server-rank0.log").is_file()  # it had started one
    deadline = time.monotonic() + 60
    while api_servers() - before and time.monotonic() < deadline:
        time.sleep(1)
    assert not api_servers() - before


def benchmark(script: str, *arguments: str) -> dict:
    import subprocess
    import sys

    from tests.helpers.cli import REPO

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *arguments], capture_output=True,
                          text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"stdout": done.stdout, **json.loads(done.stdout.strip().splitlines()[-1])}


@with_vllm
@pytest.mark.slow
def test_the_decoding_benchmark_times_the_server_beside_vllm_in_the_process():
    result = benchmark("decoding.py", "--dry-run", "--shape", "llama-tiny", "--sides", "eager,vllm,vllm_server")
    for side in ("vllm", "vllm_server"):
        figures = result["sides"][side]["vllm"]
        assert result["sides"][side]["seconds"] > 0 and figures["startup_seconds"] > 0
        assert figures["push_seconds"] > 0 and figures["memory_gib"] > 0 and figures["logprob_diff_max"] < 1e-4
    assert "vllm_server: start-up " in result["stdout"]


@with_vllm
@pytest.mark.slow
def test_the_placement_benchmark_times_a_grpo_iteration_in_each_placement(tmp_path):
    result = benchmark("placement.py", "--dry-run", "--workdir", str(tmp_path))
    assert set(result["placements"]) == {"in_process", "server", "eager"}
    assert all(figures["seconds"] > 0 for figures in result["placements"].values())
    assert result["placements"]["in_process"]["ratio"] == 1.0
    assert "placement    s/iter rollout s  ratio" in result["stdout"]


@with_vllm
def test_a_server_that_died_is_named_with_its_log(served):
    _, _, _, engine = served
    engine.process.stop()  # last in this module: the shared server is gone after it
    with pytest.raises(ServerError, match=r"the vLLM server the fit started exited with code .*; its log: .*"
                                          r"server-rank0\.log"):
        draw(served)
