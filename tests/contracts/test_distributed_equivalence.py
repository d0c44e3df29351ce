"""The proof of the distributed paths is equality: every stage, a few steps on the same global batch and seeds, in
one process, under DDP on two CPU processes and under FSDP2 (Lightning's ``ModelParallelStrategy``) on two CPU
processes, gives the same logged losses, the same gradients of every trainable parameter at every optimizer step,
the same trained weights and the same exported adapters; under FSDP2 each rank holds half of the base.

Tolerance, fp32: the ranks' partial sums are added in another order than one process adds them (gradients are
averaged over ranks after each rank sums its own rows), which moves the last bits only: relative 1e-4 with an
absolute floor of 1e-6 on gradients and metrics, 1e-5 on weights after the steps (Adam divides by the square root
of the second moment, so a gradient near zero can move its weight by a few times its own relative error).

Every logged value is compared but the per-token diagnostics of the online loop (:data:`PER_RANK`): those are
means over ranks of each rank's own token means, by design, as in TRL and OpenRLHF; the losses, rewards, KL,
lengths and every per-response mean are the global batch's.

The online algorithms sample with ``seed_scope: prompt`` (each response from a stream of its own prompt), so the
two ranks draw exactly the responses one process draws; each rank holds responses of other lengths than the other,
which exercises the loss normaliser that counts tokens across ranks. ``num_minibatches: 1`` (every optimizer step
sees the whole rollout: a minibatch of N rows split over ranks is not the same rows as one shuffled in one
process) with two epochs and, for PPO, two micro-batches per step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import (
    COMMON,
    MODEL_PARALLEL,
    ONLINE,
    PER_RANK,
    STRATEGIES,
    close,
    largest_differences,
    run_all,
    stages,
)
from tests.helpers.environment import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tiny_model_dir, reward_dir, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """stage -> strategy -> what :class:`tests.helpers.equivalence.Probe` recorded (and the exported adapters' folder)."""
    tmp_path = tmp_path_factory.mktemp("equivalence")
    plans = {"single": [], "distributed": []}
    for stage, (config, overrides, batch, val_batch) in stages(tiny_model_dir, reward_dir).items():
        for strategy in ("single", *STRATEGIES):
            ranks = 1 if strategy == "single" else 2
            sizes = [f"--data.init_args.batch_size={batch // ranks}"]
            if val_batch:
                sizes.append(f"--data.init_args.val_batch_size={val_batch // ranks}")
            out = tmp_path / f"{stage}-{strategy}"
            args = ["--config", str(REPO / "configs" / config), *COMMON, *overrides, *sizes,
                    f"--model.init_args.export_dir={out}-export", *STRATEGIES.get(strategy, ["--trainer.devices=1"])]
            plans["single" if strategy == "single" else "distributed"].append({"args": args, "out": f"{out}.pt"})
    run_all(plans["single"], tmp_path, "single")
    run_all(plans["distributed"], tmp_path, "distributed")
    return {stage: {strategy: {**torch.load(tmp_path / f"{stage}-{strategy}.pt"),
                               "export": tmp_path / f"{stage}-{strategy}-export"}
                    for strategy in ("single", *STRATEGIES)}
            for stage in stages(tiny_model_dir, reward_dir)}


def unordered(config: dict) -> dict:
    """A saved config with its lists of names sorted (peft writes ``target_modules``, a set, in hash order)."""
    return {key: sorted(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value
            for key, value in config.items()}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "dpo_precomputed", "kto", "ppo", "grpo", "rloo", "reinforce_pp",
                                   "online_dpo"])
def test_two_ranks_compute_what_one_process_computes(results, stage, strategy):
    one, two = results[stage]["single"], results[stage][strategy]
    # the same steps, logging the same values
    assert len(two["metrics"]) == len(one["metrics"]) >= 2
    for step, (expected, actual) in enumerate(zip(one["metrics"], two["metrics"], strict=True)):
        assert expected.keys() == actual.keys(), step
        for name, value in expected.items():
            if not name.endswith(PER_RANK):
                assert actual[name] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, name)
    # the same gradients of every trainable parameter before every optimizer step
    assert len(two["gradients"]) == len(one["gradients"]) >= 3
    for step, (expected, actual) in enumerate(zip(one["gradients"], two["gradients"], strict=True)):
        assert expected.keys() == actual.keys() and expected, step
        assert any(bool(value.abs().sum() > 0) for value in expected.values())
        for name, value in expected.items():
            assert close(actual[name], value, 1e-4, 1e-6), (step, name, (actual[name] - value).abs().max())
    # the same weights after the steps, but for parameters whose gradient is zero in exact arithmetic (the reward
    # head's bias: the Bradley-Terry loss sees only differences of scores): their gradient is rounding noise, of
    # another sign on two ranks, which Adam normalises into steps of up to the learning rate; for them the
    # gradients, all below 1e-7, were compared above.
    assert one["weights"].keys() == two["weights"].keys()
    for name, value in one["weights"].items():
        if all(float(step[name].abs().max()) < 1e-7 for step in one["gradients"] if name in step):
            continue
        assert close(two["weights"][name], value, 1e-5, 1e-5), (name, (two["weights"][name] - value).abs().max())
    # the same validation (sampled with each prompt's own seed, so the same responses)
    assert one["validation"].keys() == two["validation"].keys()
    for name, value in one["validation"].items():
        assert two["validation"][name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    values = [(a[n], e[n]) for e, a in zip(one["metrics"], two["metrics"], strict=True) for n in e
              if not n.endswith(PER_RANK)]
    gradients = [(a[n], e[n]) for e, a in zip(one["gradients"], two["gradients"], strict=True) for n in e]
    print(f"\n{stage} under {strategy}: {len(values)} logged values over {len(one['metrics'])} steps, largest "
          f"difference {max(abs(a - e) for a, e in values):.1e}; {len(gradients)} gradient tensors over "
          f"{len(one['gradients'])} optimizer steps, {max(float((a - e).abs().max()) for a, e in gradients):.1e}; "
          f"{len(one['weights'])} trained tensors, "
          f"{max(float((two['weights'][n] - w).abs().max()) for n, w in one['weights'].items()):.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "reward", "dpo", "ppo", "grpo"])
def test_fsdp2_exports_the_files_one_process_writes(results, stage):
    one, two = results[stage]["single"]["export"], results[stage]["fsdp2"]["export"]
    files = sorted(path.relative_to(one) for path in one.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(two) for path in two.rglob("*") if path.is_file()) and files
    for name in files:
        if name.suffix == ".safetensors":
            expected, actual = load_file(one / name), load_file(two / name)
            assert expected.keys() == actual.keys()
            for key, value in expected.items():
                if stage == "reward" and key == "linear.bias":  # zero gradient in exact arithmetic (see above)
                    continue
                assert close(actual[key], value, 1e-5, 1e-5), (name, key)
        elif name.suffix == ".json" and name.name != "reward_stats.json":
            assert unordered(json.loads((one / name).read_text())) == unordered(json.loads((two / name).read_text()))


@pytest.mark.slow
def test_adapters_exported_under_fsdp2_load_in_peft_and_merge(results, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_lightning.cli.merge_command import merge_adapter

    policy = results["ppo"]["fsdp2"]["export"] / "policy"
    ids = torch.arange(5, 15)[None]
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), policy)(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merge_adapter(policy, tmp_path / "merged"))(ids).logits
    torch.testing.assert_close(merged, peft_logits, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(peft_logits, AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "reward", "ppo", "grpo", "dpo"])
def test_under_fsdp2_each_rank_holds_half_of_the_base(results, stage):
    fsdp, ddp = results[stage]["fsdp2"], results[stage]["ddp"]
    assert fsdp["sharded"] and not ddp["sharded"]
    total = fsdp["base_numel"]
    assert ddp["base_shares"] == [total, total]  # DDP: the whole base on every rank
    assert sum(fsdp["base_shares"]) >= total
    for share in fsdp["base_shares"]:
        assert share <= 0.5 * total * 1.05, (share, total)


def checkpointed_grpo(model_dir: Path, reward_dir: Path, strategy: str = "fsdp2") -> list[str]:
    """Four GRPO iterations in one process (``single``) or on two ranks (``ddp``, ``fsdp2``), on the same global
    batch; the checkpoint callbacks are the run's (:func:`iteration_checkpoints`)."""
    config, overrides, batch, _ = stages(model_dir, reward_dir)["grpo"]
    ranks = 1 if strategy == "single" else 2
    return ["--config", str(REPO / "configs" / config), *COMMON, *overrides, f"--data.init_args.batch_size={batch // ranks}",
            "--trainer.enable_checkpointing=true", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=0",
            "--model.init_args.sharded_rollout=gathered", "--model.init_args.export_dir=null",
            *STRATEGIES.get(strategy, ["--trainer.devices=1"])]


def iteration_checkpoints(directory: Path) -> dict:
    """A checkpoint after every iteration in ``directory``, every one kept (``epoch=0-step=<2 x iteration>.ckpt``:
    two optimizer steps per iteration), and ``last.ckpt``."""
    return {"class_path": "rlhf_lightning.callbacks.IterationCheckpoint",
            "init_args": {"dirpath": str(directory), "every_n_iterations": 1, "save_last": True, "save_top_k": -1,
                          "enable_version_counter": False}}


@pytest.mark.slow
def test_fsdp2_resume_after_kill_9_is_exact(tiny_model_dir, reward_dir, tmp_path):
    """Both ranks killed with SIGKILL in the middle of iteration 3's update; resumed with ``--ckpt_path last``, the
    run logs the values and reaches the weights of an uninterrupted run; its checkpoints hold no base weight."""
    args = checkpointed_grpo(tiny_model_dir, reward_dir)

    def plan(name: str, *extra: dict, resume: bool = False) -> list[dict]:
        return [{"args": [*args, *(["--ckpt_path=last"] if resume else [])], "out": str(tmp_path / f"{name}.pt"),
                 "callbacks": [iteration_checkpoints(tmp_path / name), *extra]}]

    run_all(plan("uninterrupted"), tmp_path, "uninterrupted")
    runs_file = tmp_path / "killed.json"
    runs_file.write_text(json.dumps(plan("killed", {"class_path": "tests.helpers.equivalence.KillAt",
                                                    "init_args": {"iteration": 3, "step": 2}})))
    killed = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "equivalence.py"), str(runs_file)], cwd=tmp_path,
                            env=with_repo_on_path(), capture_output=True, text=True, timeout=600,
                            start_new_session=True)  # its own process group: the kill takes both ranks, not pytest
    assert killed.returncode == -9, killed.stderr[-3000:]
    saved = sorted(path.name for path in (tmp_path / "killed").iterdir())
    # iterations 1 and 2 (two optimizer steps each: two epochs of one minibatch)
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], saved
    state = torch.load(tmp_path / "killed" / "last.ckpt", weights_only=False)["state_dict"]
    assert state and all("lora_" in key for key in state), sorted(state)[:3]  # adapters only, never the base
    run_all(plan("killed", resume=True), tmp_path, "resumed")

    full, resumed = torch.load(tmp_path / "uninterrupted.pt"), torch.load(tmp_path / "killed.pt")
    assert resumed["checkpoint_io"] == "AtomicCheckpointIO"  # temp file, fsync, rename: as on one device
    assert len(full["metrics"]) == 4 and len(resumed["metrics"]) == 2  # iterations 3 and 4, run again
    for expected, actual in zip(full["metrics"][2:], resumed["metrics"], strict=True):
        assert expected.keys() == actual.keys()
        for name, value in expected.items():
            assert actual[name] == value, name  # bit for bit
    for expected, actual in zip(full["gradients"][-4:], resumed["gradients"], strict=True):
        for name, value in expected.items():
            assert torch.equal(actual[name], value), name
    for name, value in full["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    compared = sum(len(row) for row in resumed["metrics"])
    print(f"\nFSDP2 resume after kill -9 in iteration 3: {compared} logged values of iterations 3-4, "
          f"{sum(len(step) for step in resumed['gradients'])} gradient tensors and {len(full['weights'])} trained "
          "tensors compared with the uninterrupted run: 0 differ (bit for bit)")


@pytest.mark.slow
def test_a_checkpoint_moves_between_one_process_and_two_ranks(tiny_model_dir, reward_dir, tmp_path):
    """A GRPO checkpoint written in one process after iteration 2 resumes under DDP and under FSDP2 on two ranks,
    and their checkpoints after iteration 3 resume in one process again: each resumed run continues the
    uninterrupted one-process run (same logged values, gradients and final weights, to the tolerance of the
    equivalence tests above: the ranks add their partial sums in another order)."""

    def plan(name: str, strategy: str, ckpt_path: Path | None = None) -> dict:
        return {"args": [*checkpointed_grpo(tiny_model_dir, reward_dir, strategy),
                         *([f"--ckpt_path={ckpt_path}"] if ckpt_path else [])],
                "out": str(tmp_path / f"{name}.pt"), "callbacks": [iteration_checkpoints(tmp_path / name)]}

    after = {iteration: f"epoch=0-step={2 * iteration}.ckpt" for iteration in (2, 3)}
    run_all([plan("single", "single")], tmp_path, "single")
    run_all([plan(strategy, strategy, tmp_path / "single" / after[2]) for strategy in STRATEGIES], tmp_path, "ranks")
    run_all([plan(f"{strategy}-single", "single", tmp_path / strategy / after[3]) for strategy in STRATEGIES],
            tmp_path, "back")

    full = torch.load(tmp_path / "single.pt")
    assert len(full["metrics"]) == 4
    for name, iterations in [(strategy, 2) for strategy in STRATEGIES] + [(f"{s}-single", 1) for s in STRATEGIES]:
        resumed = torch.load(tmp_path / f"{name}.pt")
        assert len(resumed["metrics"]) == iterations, name
        largest = largest_differences(full, resumed)
        print(f"\n{name}: resumed {iterations} iteration(s); largest differences from the uninterrupted run: "
              + ", ".join(f"{what} {value:.1e}" for what, value in largest.items()))


@pytest.mark.slow
@pytest.mark.parametrize("devices, settings, error", [
    (2, [], None),  # the class alone: the sizes and the checkpoint format our modules support are filled in
    (1, ["data_parallel_size=1", "tensor_parallel_size=1", "save_distributed_checkpoint=false"], None),
    (1, ["data_parallel_size=1", "tensor_parallel_size=1", "save_distributed_checkpoint=false", "bf16-true"], None),
    (1, ["data_parallel_size=1", "tensor_parallel_size=1", "save_distributed_checkpoint=true"],
     "error: trainer.strategy ModelParallelStrategy with save_distributed_checkpoint=true writes a folder per "
     "checkpoint, which the atomic checkpoints and the resume fallback do not cover; set "
     "trainer.strategy.init_args.save_distributed_checkpoint=false (the checkpoint holds only the adapters, heads "
     "and optimizer state, gathered on rank 0)"),
    (2, ["data_parallel_size=4", "tensor_parallel_size=1", "save_distributed_checkpoint=false"],
     "error: trainer.strategy.init_args.data_parallel_size=4 x tensor_parallel_size=1 does not match the world size 2 "
     "(trainer.devices=2 x trainer.num_nodes=1); set data_parallel_size=2 and tensor_parallel_size=1: our modules "
     "shard the base over data-parallel ranks"),
    (2, ["data_parallel_size=1", "tensor_parallel_size=2", "save_distributed_checkpoint=false"],
     "error: trainer.strategy ModelParallelStrategy with tensor_parallel_size=2: our modules shard the base with "
     "FSDP2 over data-parallel ranks and apply no tensor parallelism; set "
     "trainer.strategy.init_args.data_parallel_size=2 (devices x num_nodes) and tensor_parallel_size=1"),
])
def test_model_parallel_settings_run_or_are_refused_in_one_line(tiny_model_dir, reward_dir, tmp_path, devices,
                                                                settings, error):
    """FSDP2 named by its class alone runs on two ranks; over a world of one (a single GPU's case) it runs in fp32
    and in bf16-true (the plugin's conversion is applied before sharding); folder checkpoints, sizes that do not
    multiply to the world size and tensor parallelism are refused before the second process starts."""
    command = [sys.executable, "-m", "rlhf_lightning", "fit", "--config", str(REPO / "configs" / "grpo.yaml"), *COMMON,
               *stages(tiny_model_dir, reward_dir)["grpo"][1], "--data.init_args.batch_size=2",
               "--trainer.limit_val_batches=0", f"--trainer.devices={devices}", f"--trainer.strategy={MODEL_PARALLEL}",
               *(f"--trainer.strategy.init_args.{setting}" for setting in settings if "=" in setting),
               *(f"--trainer.precision={setting}" for setting in settings if "=" not in setting),
               f"--model.init_args.export_dir={tmp_path / 'export'}", "--trainer.callbacks=[]"]
    result = subprocess.run(command, cwd=tmp_path, env=with_repo_on_path(), capture_output=True,
                            text=True, timeout=300)
    if error is None:
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / "export" / "policy" / "adapter_model.safetensors").exists()
    else:
        assert result.returncode == 1, result.stderr[-3000:]
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert lines and set(lines) == {error}, result.stderr[-3000:]
        assert "Traceback" not in result.stderr


FAILING_REWARD = """
import os
import signal
import time


def reward(prompts, completions, **columns):
    if os.environ.get("LOCAL_RANK", "0") == "{rank}":
        with open("failed_at", "w") as file:
            file.write(str(time.time()))
        {failure}
    return [0.0] * len(completions)
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy, rank, failure, lines", [
    ("ddp", 1, "raise ValueError('the reward service returned 503')",
     ["[rank 1] error: iteration 1: the reward service returned 503",
      "error: rank 1 failed: ValueError: iteration 1: the reward service returned 503"]),
    ("fsdp2", 1, "os.kill(os.getpid(), signal.SIGKILL)",
     ["error: rank 1 was killed by SIGKILL, without an error report"]),
    ("fsdp2", 0, "return [1 / 0]",  # a bug: its traceback, printed by its own rank only
     ["[rank 1] error: rank 0 failed: ZeroDivisionError: division by zero (its traceback is in that rank's output)"]),
])
def test_a_rank_that_fails_or_dies_is_named_in_one_line_by_every_rank(tiny_model_dir, tmp_path, strategy, rank,
                                                                      failure, lines):
    """A reward function that raises (or kills its process) on one rank of two: the rank that raised prints its own
    error, every other rank one line naming it and its error (or how it ended), instead of gloo's traceback about a
    closed connection; the job exits with status 1 within seconds."""
    (tmp_path / "failing.py").write_text(FAILING_REWARD.format(rank=rank, failure=failure))
    command = [sys.executable, "-m", "rlhf_lightning", "fit", "--config", str(REPO / "configs" / "grpo.yaml"), *COMMON,
               *ONLINE, f"--model.init_args.base.name_or_path={tiny_model_dir}",
               "--model.init_args.reward={class_path: rlhf_lightning.FunctionReward, init_args: {fn: failing.reward}}",
               "--data.init_args.batch_size=2", "--trainer.limit_val_batches=0", "--model.init_args.export_dir=null",
               f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.callbacks=[]", *STRATEGIES[strategy]]
    result = subprocess.run(command, cwd=tmp_path, env=with_repo_on_path(), capture_output=True,
                            text=True, timeout=300)
    seconds = time.time() - float((tmp_path / "failed_at").read_text())
    assert result.returncode == 1, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if "error:" in line] == lines, result.stderr[-3000:]
    assert "Connection closed" not in result.stderr and "RuntimeError" not in result.stderr
    tracebacks = result.stderr.count("Traceback")
    assert tracebacks == (1 if "1 / 0" in failure else 0), result.stderr[-3000:]
    assert seconds < 30, seconds  # no hang (gloo's timeout is 30 minutes): the measured time is printed below
    print(f"\n{strategy}, rank {rank}: {failure}: the job ended {seconds:.1f} s after the failure")
