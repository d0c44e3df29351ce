"""Asynchronous training (``asynchronous.max_staleness``): the rollouts of later iterations drawn on the vLLM server
while the policy trains. Everywhere: the ``asynchronous`` group's checks, the refusals, the producer's waits and
failures, the seeds and the loader's batches drawn ahead. With vLLM (the tests marked ``vllm``, on the session's
server of ``tests/rollout/conftest.py``): a fit at S = 1 whose first iteration is the synchronous one's bit for bit
and whose samples are one iteration old, versions kept loaded while drawn from, a stuck server and a failed draw in
one line, and the exact resume after kill -9."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.data.loader import ResumableLoader
from rlhf_lightning.rollout.ahead import Asynchronous, loader_ahead
from rlhf_lightning.rollout.engines import Auto, EagerDecoder, PolicyVersion
from rlhf_lightning.rollout.producer import Job, ProducerError, RolloutProducer
from rlhf_lightning.rollout.seeds import Seeds, derive_seed
from rlhf_lightning.rollout.vllm_server import VLLMServer
from tests.helpers.group_checks import assert_check_names_the_field

with_vllm = pytest.mark.vllm
SERVER = "rlhf_lightning.rollout.vllm_server.VLLMServer"


# ---- everywhere ---------------------------------------------------------------------------------------------

def test_only_an_engine_with_its_own_devices_draws_ahead_the_others_refuse_in_one_line(tiny_llama_dir, reward_dir,
                                                                                       capsys):
    from tests.helpers.cli import grpo, one_line

    for engine in (Auto(), EagerDecoder()):
        refusal = engine.ahead_refusal(2)
        assert refusal.startswith(f"asynchronous.max_staleness=2: the engine {type(engine).__name__} draws in the "
                                  "trainer's own process") and "VLLMServer" in refusal
        assert refusal.endswith("or asynchronous.max_staleness: 0")
    server = VLLMServer(urls=["http://127.0.0.1:9"])
    assert server.ahead_refusal(2) is None and server.staleness == 0  # asking configures nothing
    server.keep_versions(2)
    assert server.staleness == 2 and server.where() == "the vLLM server at None"
    line = one_line(capsys, *grpo(tiny_llama_dir, reward_dir, "--model.init_args.asynchronous.max_staleness=1"))
    assert line.startswith("error: asynchronous.max_staleness=1: the engine Auto draws in the trainer's own process")


@pytest.mark.parametrize("bad, message", [
    (dict(max_staleness=-1), "asynchronous.max_staleness must be an integer >= 0, got -1"),
    (dict(max_staleness=1.5), "asynchronous.max_staleness must be an integer >= 0, got 1.5"),
    (dict(rollout_timeout=0.0), "asynchronous.rollout_timeout must be > 0, got 0.0"),
    (dict(rollout_timeout=-5.0), "asynchronous.rollout_timeout must be > 0, got -5.0"),
])
def test_the_asynchronous_group_names_its_dotted_key(bad, message):
    assert_check_names_the_field(Asynchronous(**bad), message, "asynchronous", "ahead")
    assert Asynchronous().check() == Asynchronous(max_staleness=0, rollout_timeout=1800.0)  # synchronous by default
    assert Asynchronous(max_staleness=2, rollout_timeout=5.0).check() == Asynchronous(2, 5.0)


def test_a_loader_that_cannot_hand_out_batches_ahead_names_the_setting():
    with pytest.raises(TypeError, match=r"^asynchronous\.max_staleness needs a training loader that can hand out its "
                                        r"next batches ahead \(rlhf_lightning\.data\.loader\.ResumableLoader\), not list$"):
        loader_ahead([[1, 2]])


@dataclasses.dataclass(frozen=True)
class Named(PolicyVersion):
    """A handle that names a served model and counts its releases (the producer's tests draw without an engine)."""

    name: str
    version: int = 0
    releases: list = dataclasses.field(default_factory=list, compare=False)

    def release(self) -> None:
        self.releases.append(self.version)


def job(iteration: int) -> Job:
    return Job(iteration, max(0, iteration - 1), Named("policy-v0"), (iteration,), (1, 1))


def test_the_producer_hands_out_jobs_by_iteration_and_a_failed_one_stops_the_fit_with_its_cause():
    finished: list[int] = []

    def draw(job: Job, prompts: dict) -> str:
        if prompts["fail"]:
            raise ConnectionError("the server hung up")
        return f"rollout {job.iteration}"

    producer = RolloutProducer(draw, lambda job: finished.append(job.iteration), 10.0, lambda: "the server at X")
    producer.submit(job(0), {"fail": False})
    producer.submit(job(1), {"fail": False})
    assert [j.iteration for j in producer.pending] == [0, 1]
    assert producer.take(1) == (job(1), "rollout 1") and producer.take(0)[1] == "rollout 0"
    producer.submit(job(2), {"fail": False})
    with pytest.raises(ProducerError, match="submitted twice"):
        producer.submit(job(2), {"fail": False})
    producer.take(2)
    producer.submit(job(3), {"fail": True})
    deadline = time.monotonic() + 10
    while 3 not in finished and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ProducerError) as failed:
        producer.check()  # at the next iteration's start, not when iteration 4 comes
    assert str(failed.value) == ("the rollout producer failed drawing iteration 4's rollout (drawn by the policy of "
                                 "iteration 3, adapter version 0) from the server at X: ConnectionError: the server "
                                 "hung up")
    assert finished == [0, 1, 2, 3]  # every job released its version, the failed one too
    with pytest.raises(ProducerError, match=r"^no rollout was submitted for iteration 6"):
        producer.take(5)
    producer.close()


def test_a_wait_for_the_producer_times_out_in_one_line_naming_what_it_waited_for():
    release = threading.Event()
    producer = RolloutProducer(lambda job, prompts: release.wait(30), lambda job: None, 0.2, lambda: "the server at X")
    producer.submit(job(0), {})
    start = time.monotonic()
    with pytest.raises(ProducerError) as waited:
        producer.take(0)
    assert time.monotonic() - start < 5
    assert str(waited.value) == ("waited 0.2 s for iteration 1's rollout (drawn by the policy of iteration 1, adapter "
                                 "version 0) from the server at X, and it is still being drawn: is the server stuck or "
                                 "overloaded (its log)? asynchronous.rollout_timeout raises the wait")
    release.set()
    producer.close()


def test_closing_the_producer_releases_the_versions_of_jobs_never_started():
    release, ended = threading.Event(), []
    producer = RolloutProducer(lambda job, prompts: release.wait(30), lambda job: ended.append(job.iteration), 10.0,
                               lambda: "the server at X")
    producer.submit(job(0), {})
    producer.submit(job(1), {})
    deadline = time.monotonic() + 10
    while not producer.jobs[0][1].running() and time.monotonic() < deadline:
        time.sleep(0.01)
    producer.close()  # the fit ends: job 1 never starts, job 0 is being drawn
    assert ended == [1]
    release.set()
    while ended != [1, 0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended == [1, 0]  # the one being drawn releases its version when it ends


def test_seeds_drawn_ahead_are_the_synchronous_loops_request_seeds():
    seeds = Seeds(7)
    torch.manual_seed(derive_seed(7, "train", 5, 1))  # the synchronous loop's start of iteration 5 on rank 1
    requests = torch.randint(0, 2**62, (3,)).tolist()  # what its server engine draws: one seed per prompt
    ahead = seeds.ahead(5, 1, torch.tensor([4, 9, 2]), 3, 2)
    assert ahead[::2] == requests and ahead[1::2] == requests
    per_prompt = Seeds(7, "prompt")
    rows = per_prompt.rows("train 5", torch.tensor([4, 9]), 2)
    assert per_prompt.ahead(5, 1, torch.tensor([4, 9]), 2, 2) == Seeds.turn(rows, 1)  # the first turn's, as drawn


def test_the_loader_hands_out_ahead_the_batches_it_will_hand_out_across_epochs_each_read_once():
    collated = []

    def collate(rows):
        collated.append(list(rows))
        return list(rows)

    loader = ResumableLoader(list(range(10)), 3, collate, seed=3, limit=2)
    handed = iter(loader)
    first = next(handed)
    ahead = [loader.ahead(count) for count in (1, 2, 3)]  # the epoch's last batch, then the next epoch's two
    assert loader.ahead(2) is ahead[1]  # asked again: the same batch, not read again
    later = [next(handed)]
    loader.set_epoch(1)
    later += list(iter(loader))
    assert ahead == later and first not in ahead[:1]
    assert all(drawn is trained for drawn, trained in zip(ahead, later, strict=True))  # the very batches trained on
    assert len(collated) == 1 + 3  # the loader read: every batch once
    with pytest.raises(ValueError, match="from 1"):
        loader.ahead(0)


def test_a_resumed_loader_reads_ahead_from_where_it_stopped():
    loader = ResumableLoader(list(range(10)), 3, lambda rows: list(rows), seed=3)
    handed = iter(loader)
    next(handed)
    state = loader.state_dict()
    expected = [loader.ahead(1), loader.ahead(2)]
    resumed = ResumableLoader(list(range(10)), 3, lambda rows: list(rows), seed=3)
    resumed.load_state_dict(state)
    drawn = [resumed.ahead(1), resumed.ahead(2)]
    assert drawn == expected  # the same rows as the loader it resumes
    rest = list(iter(resumed))  # the epoch's two batches left (3 of 10 rows each, the last row dropped)
    assert len(rest) == 2 and all(a is b for a, b in zip(drawn, rest, strict=True))


# ---- on the session's vLLM server ---------------------------------------------------------------------------

def fit_arguments(tiny_llama_dir, reward, url: str, staleness: int, *extra: str) -> list[str]:
    from tests.rollout.test_vllm_server import server_fit

    return server_fit(tiny_llama_dir, reward, url, f"--model.init_args.asynchronous.max_staleness={staleness}",
                      *extra)


@with_vllm
def test_versions_drawn_from_stay_loaded_until_released(served, server_url, tmp_path):
    """An engine of its own on the session's server (its own run folder, so its own adapter names) and a copy of
    the model, so that the session's engine and model stay as they were."""
    import copy

    from rlhf_lightning.rollout.engines import EngineSetup
    from tests.rollout.test_vllm_server import served_names

    model = copy.deepcopy(served[0])
    engine = VLLMServer(urls=[server_url], request_timeout=120)
    engine.prepare(EngineSetup("cpu", run_folder=str(tmp_path)))
    engine.keep_versions(1)  # drawing ahead: a sync records the version, the producer loads what it draws from
    engine.connect(model)
    engine.sync(model, POLICY, 0)
    assert served_names(engine).isdisjoint({engine.adapter_name(POLICY, 0)})  # not pushed by the sync
    first = engine.serve_version(model, POLICY, 0)  # loaded and pinned: a producer's job draws from it
    name = first.name
    lora_b = next(p for n, p in model.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.add_(0.1)
    engine.sync(model, POLICY, 1)
    second = engine.serve_version(model, POLICY, 1)
    newer = second.name
    assert {name, newer} <= served_names(engine)  # the pinned version stays while the new one is loaded
    first.release()
    second.release()
    with torch.no_grad():
        lora_b.add_(0.1)
    engine.sync(model, POLICY, 2)
    third = engine.serve_version(model, POLICY, 2)  # a released version goes when the next one is loaded ...
    latest = third.name
    names = served_names(engine)
    # ... unless it is among the max_staleness + 1 newest, which another rank's producer may still draw from
    assert latest in names and newer in names and name not in names
    assert dataclasses.replace(third) == third and (third.role, third.version) == (POLICY, 2)  # immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        third.name = name  # a handle never changes what it draws from
    third.release()
    for left in (newer, latest):
        engine.call("POST", "/v1/unload_lora_adapter", {"lora_name": left})


@with_vllm
def test_a_stuck_server_and_a_draw_from_a_version_it_does_not_hold_are_one_line(served, server_url):
    model, sampler, tokenizer, engine = served
    batch = tokenizer(["good movie"], return_tensors="pt", add_special_tokens=False)

    def draw(job: Job, prompts: dict):
        return engine.request(job.source.name, batch["input_ids"], batch["attention_mask"], 2, sampler.settings,
                              tokenizer.pad_token_id, [1, 1])

    producer = RolloutProducer(draw, lambda job: None, 3.0, lambda: f"the vLLM server at {engine.url}")
    server = engine.process.process
    os.kill(server.pid, signal.SIGSTOP)  # a straggler: the server takes the request and never answers meanwhile
    try:
        producer.submit(Job(0, 0, Named(engine.base_name), (0,), (1, 1)), {})
        with pytest.raises(ProducerError, match=r"^waited 3 s for iteration 1's rollout .* from the vLLM server at "
                                                r"http://127\.0\.0\.1:\d+, and it is still being drawn"):
            producer.take(0)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    producer.close()
    producer = RolloutProducer(draw, lambda job: None, 60.0, lambda: f"the vLLM server at {engine.url}")
    producer.submit(Job(1, 0, Named("policy-v7-nowhere", 7), (0,), (1, 1)), {})
    with pytest.raises(ProducerError, match=r"^the rollout producer failed drawing iteration 2's rollout .*: "
                                            r"ServerError: .*404"):
        producer.take(1)
    producer.close()


@with_vllm
@pytest.mark.slow
def test_at_staleness_1_the_first_iteration_is_the_synchronous_one_and_the_others_one_iteration_old(
        served, server_url, tiny_llama_dir, tmp_path):
    from tests.helpers.models import save_reward_adapter
    from tests.helpers.preemption import drive, run

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    probes = {}
    for staleness in (0, 1):
        arguments = fit_arguments(tiny_llama_dir, reward, server_url, staleness, "--trainer.limit_train_batches=3")
        done = drive(tmp_path, f"s{staleness}", [run(tmp_path, f"s{staleness}", arguments)])
        assert done.returncode == 0, done.stderr[-4000:]
        probes[staleness] = torch.load(tmp_path / f"s{staleness}.pt")["metrics"]
    synchronous, overlapped = probes[0], probes[1]
    for key in ("grpo/objective/score", "grpo/response/length", "grpo/rollout/mismatch_kl"):
        assert overlapped[0][key] == synchronous[0][key], key  # the same policy, the same seeds
    assert [row["grpo/rollout/staleness_mean"] for row in overlapped] == [0.0, 1.0, 1.0]
    assert [row["grpo/rollout/staleness_steps"] for row in overlapped] == [0.0, 2.0, 2.0]  # 2 steps an iteration
    assert "grpo/rollout/staleness_mean" not in synchronous[0]
    assert overlapped[1]["grpo/rollout/mismatch_kl"] > 1e-6  # the sampler's policy is one update behind


@with_vllm
@pytest.mark.slow
def test_a_run_drawing_two_iterations_ahead_resumes_exactly_after_kill_9(served, server_url, tiny_llama_dir,
                                                                         tmp_path):
    from tests.helpers.models import save_reward_adapter
    from tests.helpers.preemption import kill_and_resume

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    arguments = fit_arguments(tiny_llama_dir, reward, server_url, 2, "--trainer.limit_train_batches=4",
                              "--trainer.enable_checkpointing=true")
    full, resumed = kill_and_resume(tmp_path, arguments)
    assert [row["grpo/rollout/staleness_mean"] for row in full["metrics"]] == [0.0, 1.0, 2.0, 2.0]
    print(f"\nasynchronous.max_staleness 2, killed with SIGKILL in iteration 3 and resumed: "
          f"{sum(len(row) for row in resumed['metrics'])} logged values equal the uninterrupted run's")


@with_vllm
@pytest.mark.slow
def test_two_ddp_or_fsdp2_ranks_drawing_ahead_train_as_one_process_does(served, server_url, tiny_llama_dir,
                                                                        tmp_path):
    """At asynchronous.max_staleness 1, one process on the whole batch, then two CPU ranks (DDP, then FSDP2: the
    adapters kept for the producer gathered from their shards on every rank) on its halves, each with its own
    producer sending its prompts to the same server, seeded per prompt."""
    from tests.helpers.distributed import STRATEGIES, largest_differences
    from tests.helpers.models import save_reward_adapter
    from tests.helpers.preemption import drive, run

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    arguments = fit_arguments(tiny_llama_dir, reward, server_url, 1, "--trainer.limit_train_batches=3",
                              "--model.init_args.seed_scope=prompt")
    single = drive(tmp_path, "single", [run(tmp_path, "single", [*arguments, "--data.init_args.batch_size=4"])])
    assert single.returncode == 0, single.stderr[-4000:]
    full = torch.load(tmp_path / "single.pt")
    assert [row["grpo/rollout/staleness_mean"] for row in full["metrics"]] == [0.0, 1.0, 1.0]
    for layout in ("ddp", "fsdp2"):
        ranks = drive(tmp_path, layout, [run(tmp_path, layout, [*arguments, "--data.init_args.batch_size=2",
                                                                 *STRATEGIES[layout]])])
        assert ranks.returncode == 0, ranks.stderr[-4000:]
        largest = largest_differences(full, torch.load(tmp_path / f"{layout}.pt"))
        print(f"\nasynchronous.max_staleness 1 on two {layout} ranks against one process: largest differences {largest}")


@with_vllm
@pytest.mark.slow
def test_sigterm_while_two_iterations_are_drawn_ahead_skips_no_prompt_and_trains_none_twice(
        served, server_url, tiny_llama_dir, tmp_path):
    """SIGTERM in iteration 3 of 5 at asynchronous.max_staleness 2 (iterations 4 and 5 drawn ahead or being drawn):
    the checkpoint of iteration 3 holds the adapters that drew them, the resumed run redraws them, and the prompts
    trained before and after the stop are the uninterrupted run's, each once, with the same logged values."""
    import json

    from tests.helpers.models import save_reward_adapter
    from tests.helpers.preemption import assert_same_training, drive, run

    reward = save_reward_adapter(tiny_llama_dir, tmp_path / "reward")
    arguments = fit_arguments(tiny_llama_dir, reward, server_url, 2, "--trainer.limit_train_batches=5")
    checkpoint = {"class_path": "rlhf_lightning.callbacks.Checkpoint",
                  "init_args": {"every_n_train_steps": 50, "save_last": True, "enable_version_counter": False}}

    def rows(name: str) -> dict:
        return {"class_path": "tests.helpers.equivalence.RowsTrained", "init_args": {"out": str(tmp_path / name)}}

    def read(name: str) -> list[list[int]]:
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    full = drive(tmp_path, "full", [run(tmp_path, "full", arguments, checkpoint, rows("full.rows"))])
    assert full.returncode == 0, full.stderr[-4000:]
    signalled = drive(tmp_path, "signalled", [run(tmp_path, "signalled", arguments, checkpoint, rows("stopped.rows"),
                                                  {"class_path": "tests.helpers.equivalence.SignalAt",
                                                   "init_args": {"batch": 3, "step": 2}})])
    assert signalled.returncode == 128 + signal.SIGTERM, signalled.stderr[-4000:]
    resumed = drive(tmp_path, "resumed", [run(tmp_path, "signalled", arguments, checkpoint, rows("resumed.rows"),
                                              resume=True)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    trained = read("stopped.rows") + read("resumed.rows")
    assert trained == read("full.rows") and len(trained) == 5
    prompts = [row for batch in trained for row in batch]
    assert len(prompts) == len(set(prompts)) == 10  # none skipped, none trained twice
    assert_same_training(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "signalled.pt"), 4, 2)


def test_a_synchronous_runs_checkpoint_cannot_resume_drawing_ahead(tiny_llama_dir):
    """It kept no adapters to redraw the rollouts drawn ahead from: one line, before anything is drawn."""
    from rlhf_lightning import GRPO, FunctionReward
    from rlhf_lightning.models.spec import BaseModelSpec
    from rlhf_lightning.tasks.arithmetic import exact_match
    from rlhf_lightning.utils.atomic_io import CheckpointError
    from tests.helpers.models import LORA, built

    def module(staleness: int) -> GRPO:
        return built(GRPO(base=BaseModelSpec(name_or_path=str(tiny_llama_dir)), policy_lora=LORA, samples_per_prompt=2,
                          reward=FunctionReward(exact_match),
                          engine=VLLMServer(urls=["http://127.0.0.1:9"]), asynchronous={"max_staleness": staleness}))

    checkpoint = {"state_dict": module(0).state_dict()}
    module(0).on_save_checkpoint(checkpoint)
    with pytest.raises(CheckpointError, match=r"^the checkpoint: written by a synchronous run, which kept no adapters "
                                              r".*; resume it with asynchronous\.max_staleness: 0$"):
        module(1).on_load_checkpoint(checkpoint)


ALGORITHMS = {  # the other online algorithms, each on stale samples
    "ppo": ["--model.init_args.critic.lora={r: 4, alpha: 8}", "--model.init_args.correction.mode=token_truncate"],
    "rloo": ["--model.init_args.correction.mode=token_mask"],
    "reinforce_pp": ["--model.init_args.correction.mode=token_truncate"],
    "online_dpo": ["--model.init_args.update.epochs=1"],
    "distill": ["--model.init_args.correction.mode=token_truncate"],
}


@with_vllm
@pytest.mark.slow
def test_every_online_algorithm_trains_on_rollouts_drawn_one_iteration_ahead(served, server_url, tiny_llama_dir,
                                                                             llama_adapters, tmp_path):
    from tests.helpers.cli import REPO
    from tests.helpers.preemption import COMMON, ONLINE, drive, run

    reward, teacher = llama_adapters
    runs = []
    for name, extra in ALGORITHMS.items():
        arguments = ["--config", str(REPO / "configs" / f"{name}.yaml"),
                     f"--model.init_args.base.name_or_path={tiny_llama_dir}",
                     f"--model.init_args.reward.init_args.path={reward}", *COMMON, *ONLINE,
                     f"--model.init_args.engine={{class_path: {SERVER}, init_args: {{urls: [{server_url}]}}}}",
                     "--model.init_args.export_dir=null", "--trainer.limit_val_batches=0",
                     "--trainer.limit_train_batches=3", "--model.init_args.asynchronous.max_staleness=1", *extra,
                     *([f"--model.init_args.teacher={teacher}"] if name == "distill" else [])]
        runs.append(run(tmp_path, name, arguments))
    result = drive(tmp_path, "algorithms", runs)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ALGORITHMS:
        metrics = torch.load(tmp_path / f"{name}.pt")["metrics"]
        ages = [row[key] for row in metrics for key in row if key.endswith("rollout/staleness_mean")]
        assert ages == [0.0, 1.0, 1.0], (name, ages)
        if name != "online_dpo":  # stale samples: the proximal policy has moved away from the sampler's
            drift = [row[key] for row in metrics for key in row if key.endswith("rollout/mismatch_kl")]
            assert drift[0] < 1e-6 < drift[1], (name, drift)


@with_vllm
@pytest.mark.slow
def test_episodes_are_drawn_ahead_turn_by_turn_on_a_server_the_fit_starts(calculator_llama_dir, tmp_path):
    """Multi-turn episodes with an environment (one that answers every turn), drawn by the producer (its own
    tokenizer, one version for every turn of an episode) on a server the fit starts (no urls)."""
    from tests.helpers.cli import REPO
    from tests.helpers.preemption import COMMON, drive, run

    arguments = ["--config", str(REPO / "configs" / "calculator_grpo.yaml"),
                 f"--model.init_args.base.name_or_path={calculator_llama_dir}", *COMMON,
                 "--model.init_args.policy_lora={r: 4, alpha: 8}", "--model.init_args.sampling.max_new_tokens=6",
                 "--model.init_args.episodes.max_tokens=40", "--model.init_args.samples_per_prompt=2",
                 "--model.init_args.update.num_minibatches=1", "--data.init_args.batch_size=2",
                 "--data.init_args.synthetic_rows=40", "--trainer.limit_val_batches=0",
                 "--trainer.limit_train_batches=3", "--model.init_args.export_dir=null",
                 "--model.init_args.asynchronous.max_staleness=1", "--model.init_args.correction.mode=token_truncate",
                 "--model.init_args.episodes.environment={class_path: tests.helpers.episodes.Feedback}",
                 f"--model.init_args.engine={{class_path: {SERVER}, init_args: {{kv_cache_gib: 0.25}}}}"]
    result = drive(tmp_path, "episodes", [run(tmp_path, "episodes", arguments)])
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = torch.load(tmp_path / "episodes.pt")["metrics"]
    assert [row["grpo/rollout/staleness_mean"] for row in metrics] == [0.0, 1.0, 1.0]
    assert max(row["grpo/episode/turns"] for row in metrics) > 1.0
