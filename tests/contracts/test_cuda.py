"""What only a CUDA GPU can check, marked ``cuda`` (``pytest -m cuda``; ``benchmarks/gpu_checks.py`` runs these first
on a lent GPU):

- one iteration (one optimizer step for the offline stages) of every algorithm in ``bf16-mixed`` and ``bf16-true``,
  through the command line as a user runs it: every logged value, gradient and exported weight finite;
- the compiled decode step (``torch.compile``, CUDA graphs) draws the eager step's tokens and compiles once a shape;
- FSDP2 through Lightning's ``ModelParallelStrategy`` with NCCL on one GPU: one PPO and one GRPO iteration;
- the fused ops (``rlhf_lightning/ops``) against their plain twins on CUDA.

The runs reuse the CPU suite's pieces: the tiny model fixtures, the stages and overrides of
``tests/contracts/test_distributed_equivalence.py`` and its :class:`tests.helpers.equivalence.Probe`, the decoding helpers of
``tests/rollout/test_decode.py`` and the adapters of ``tests/ops/test_lora.py``. Without CUDA the module is one skip (the
check at its end, after every test is defined, so a CPU collection still evaluates their definitions).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.activations import GELUTanh, NewGELUActivation

from rlhf_lightning.ops.lm_head import head_logprobs
from rlhf_lightning.ops.lora import FusedLoraLinear
from rlhf_lightning.ops.sampling import inverse_cdf_draw
from tests.helpers import equivalence
from tests.helpers.decoding import policy_base, prompts, sample, sampler
from tests.helpers.distributed import COMMON, MODEL_PARALLEL, REPO, run_all, stages
from tests.helpers.lora_ops import forward_backward, gpt2_base, llama_base, with_adapters

pytestmark = pytest.mark.cuda
CUDA = "cuda"
# precision -> the base's dtype, as a user sets them together (tests/contracts/test_model_families.py's bf16 test)
PRECISIONS = {"bf16-mixed": "float32", "bf16-true": "bfloat16"}
ALGORITHMS = ["sft", "reward", "dpo", "dpo_precomputed", "kto", "ppo", "grpo", "rloo", "reinforce_pp", "online_dpo",
              "distill"]
ON_GPU = ["--trainer.accelerator=gpu", "--trainer.devices=1"]
# One iteration (online) or optimizer step (offline); the online stages validate once, after it.
ONE_ITERATION = ["--trainer.limit_train_batches=1", "--trainer.max_steps=-1", "--trainer.val_check_interval=1"]
ONE_STEP = ["--trainer.max_steps=1"]


def algorithm_run(name: str, model_dir: Path, reward_dir: Path, run: Path) -> list[str]:
    """The command-line arguments of one fit of algorithm ``name`` on the tiny model, exporting to
    ``<run>-export``: the CPU equivalence tests' stage, on the whole global batch in one process."""
    if name == "distill":  # the teacher: the tiny base itself, a model folder (tests/stages/test_distill.py)
        config, overrides, batch, _ = stages(model_dir, reward_dir)["grpo"]
        config = "distill.yaml"
        overrides = [*overrides, f"--model.init_args.teacher={model_dir}"]
    else:
        config, overrides, batch, _ = stages(model_dir, reward_dir)[name]
    online = any(o.startswith("--model.init_args.sampling.max_new_tokens") for o in overrides)
    return ["--config", str(REPO / "configs" / config), *COMMON, *overrides, f"--data.init_args.batch_size={batch}",
            *(ONE_ITERATION if online else ONE_STEP), f"--model.init_args.export_dir={run}-export", *ON_GPU]


def run_and_check(run: Path, args: list[str], subprocess: bool = False) -> dict:
    """Fit with ``args`` and :class:`~tests.helpers.equivalence.Probe` (in this process, or in its own with
    ``subprocess``), then check what it recorded in ``<run>.pt``: at least one step, every logged value and
    gradient finite, some gradient not zero, every exported tensor finite."""
    out = f"{run}.pt"
    if subprocess:
        run_all([{"args": args, "out": out}], run.parent, run.name)
    else:  # in this process: one CUDA context for every fit
        runs = Path(f"{run}.json")
        runs.write_text(json.dumps([{"args": args, "out": out}]))
        equivalence.main(str(runs))
    record = torch.load(out)
    assert record["metrics"] and record["gradients"], out
    for step in record["metrics"]:
        bad = {name: value for name, value in step.items() if not torch.isfinite(torch.tensor(value))}
        assert not bad, bad
    for step in record["gradients"]:
        assert all(bool(torch.isfinite(g).all()) for g in step.values()), [n for n, g in step.items()
                                                                           if not torch.isfinite(g).all()]
    assert any(bool(g.abs().sum() > 0) for step in record["gradients"] for g in step.values())
    exported = list(Path(f"{run}-export").rglob("*.safetensors"))
    assert exported
    for file in exported:
        assert all(bool(torch.isfinite(t.float()).all()) for t in load_file(file).values()), file
    return record


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_iteration_of_every_algorithm_on_cuda(algorithm, precision, tiny_model_dir, reward_dir, tmp_path):
    run = tmp_path / algorithm
    record = run_and_check(run, [*algorithm_run(algorithm, tiny_model_dir, reward_dir, run),
                                 f"--trainer.precision={precision}",
                                 f"--model.init_args.base.dtype={PRECISIONS[precision]}"])
    assert record["backend"] is None and not record["sharded"]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_fsdp2_with_nccl_on_one_gpu_runs_an_iteration(algorithm, tiny_model_dir, reward_dir, tmp_path):
    """``ModelParallelStrategy`` over a world of one GPU: the process group is NCCL's, the base is FSDP2-sharded
    (one rank: it holds every parameter), and the iteration's values, gradients and exports are finite."""
    run = tmp_path / f"{algorithm}-fsdp2"
    args = [*algorithm_run(algorithm, tiny_model_dir, reward_dir, run), f"--trainer.strategy={MODEL_PARALLEL}",
            "--trainer.strategy.init_args.data_parallel_size=1", "--trainer.strategy.init_args.tensor_parallel_size=1",
            "--trainer.strategy.init_args.save_distributed_checkpoint=false"]
    record = run_and_check(run, args, subprocess=True)  # its own process: NCCL's group ends with it
    assert record["backend"] == "nccl" and record["sharded"]
    assert record["base_shares"] == [record["base_numel"]]


# ---- the compiled decode step: tests/rollout/test_decode.py's checks, on the GPU (CUDA graphs) ----

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_decoding_draws_the_eager_tokens_on_cuda_and_compiles_once(family):
    base = policy_base(family).to(CUDA)
    for rollout in range(2):  # the same shape twice: the second rollout compiles nothing
        ids, mask = (tensor.to(CUDA) for tensor in prompts(3, 11, seed=rollout))
        expected, expected_mask, expected_logprobs = sample(base, "eager", ids, mask, group=2)
        sequences, response_mask, logprobs = sample(base, "compiled", ids, mask, group=2)
        assert torch.equal(sequences, expected) and torch.equal(response_mask, expected_mask)
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)
        assert sampler(base, "compiled").engine(base).decoder.stats.compiles == 1


def test_compiled_decoding_in_bf16_on_cuda_samples_its_tokens_with_their_log_probs():
    """As the CPU test of bf16: fused bf16 kernels may flip a draw that falls near a token's cumulative boundary, so
    the compiled path's log-probs are checked against eager teacher-forcing of its own tokens (0.05 nats)."""
    base = policy_base("llama", torch.bfloat16).to(CUDA)
    ids, mask = (tensor.to(CUDA) for tensor in prompts(3, 11, seed=4))
    eager, _, _ = sample(base, "eager", ids, mask, group=4)
    sequences, response_mask, logprobs = sample(base, "compiled", ids, mask, group=4)
    assert (sequences == eager).all(1).float().mean() >= 0.5
    with torch.no_grad(), base.role("policy"):
        full_mask = torch.cat([mask.repeat_interleave(4, 0), response_mask.long()], 1)
        logits = base.hf_model(input_ids=sequences, attention_mask=full_mask).logits
    width = response_mask.shape[1]
    forced = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1).gather(-1, sequences[:, -width:, None])[..., 0]
    torch.testing.assert_close(logprobs[response_mask], forced[response_mask], rtol=0, atol=0.05)


# ---- the fused ops against their plain twins ----

@pytest.mark.parametrize("architecture", ["gpt2 (Conv1D)", "llama (nn.Linear)"])
def test_fused_lora_layers_give_peft_outputs_and_gradients_on_cuda(architecture, tiny_model_dir):
    def build(fused: bool):
        base = gpt2_base(tiny_model_dir, fused) if architecture.startswith("gpt2") else llama_base(fused)
        return with_adapters(base).to(CUDA)

    fused, plain = build(True), build(False)
    assert any(isinstance(m, FusedLoraLinear) for m in fused.model.modules())
    for role in ("policy", "reward", None):
        hidden, grads = forward_backward(fused, role)
        expected, expected_grads = forward_backward(plain, role)
        assert hidden.is_cuda
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_fused_log_prob_head_matches_the_logits_path_on_cuda(autocast):
    torch.manual_seed(0)
    hidden = torch.randn(4, 16, 64, device=CUDA, requires_grad=True)
    weight = (0.05 * torch.randn(1000, 64, device=CUDA)).requires_grad_()  # logits of order 1, as a trained head's
    labels = torch.randint(0, 1000, (4, 16), device=CUDA)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    results = []
    for fused in (True, False):
        with torch.autocast(CUDA, dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropy = head_logprobs(hidden, labels, lambda h: h @ weight.t(), 0.7, with_entropy=True,
                                              entropy_grad=False, fused_weight=weight if fused else None)
        gradients = torch.autograd.grad(logprobs.sum(), [hidden, weight])
        results.append((logprobs, entropy, *gradients))
    assert results[0][0].dtype == torch.float32 and bool(torch.isfinite(results[0][0]).all())
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **tolerance)


def test_fused_gelu_is_the_python_formula_on_cuda():
    x = torch.randn(8, 4096, device=CUDA)
    torch.testing.assert_close(GELUTanh()(x), NewGELUActivation()(x), rtol=1e-6, atol=1e-6)


def test_inverse_cdf_draw_picks_the_cpu_tokens_on_cuda():
    """The same uniform numbers give the same tokens on either device (float64 sums over GPT-2's vocabulary)."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 50_258, generator=generator) * 3
    uniform = torch.rand(64, 1, generator=generator, dtype=torch.float64)
    tokens, logprobs, finite = inverse_cdf_draw(scores, uniform)
    cuda_tokens, cuda_logprobs, cuda_finite = inverse_cdf_draw(scores.to(CUDA), uniform.to(CUDA))
    assert torch.equal(cuda_tokens.cpu(), tokens) and bool(cuda_finite.all()) and bool(finite.all())
    torch.testing.assert_close(cuda_logprobs.cpu(), logprobs, rtol=0, atol=1e-5)


# Last, so that a collection without CUDA has evaluated every test's definition and parameters above.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on one: python benchmarks/gpu_checks.py)", allow_module_level=True)
