"""Decoding: a rollout's sampling by each engine, in one process, on the same model and draws.

A random model of the chosen shape (``--shape``: a GPT-2 preset, or ``qwen2-0.5b`` / ``llama-1b``, the layer
shapes of Qwen2-0.5B and Llama-3.2-1B with random weights; nothing is downloaded) with a ``policy`` LoRA adapter
samples ``--group`` responses to each of ``--prompts`` prompts of ``--prompt-length`` tokens, ``--response-length``
tokens each (no stop token: every response is full length, so each side decodes the same number of steps).
Sides, each the median of ``--repeats`` timed rollouts after one untimed warm-up (which holds the compile):

- ``generate``: transformers' ``generate`` with our sampler, every sample a row of its own (its prompt encoded
  ``group`` times): the path before the decode loop, and the baseline of the ratios;
- ``eager``: our loop, each prompt encoded once and its KV cache copied to its samples;
- ``compiled``: the same loop with its decode step compiled (``torch.compile``; CUDA graphs on a GPU);
- ``vllm``: vLLM in this process (the engine ``VLLMEngine``), the model saved to a temporary folder for it to load: run
  where vLLM is installed and serves the shape (Llama and Qwen2 shapes; vLLM has no LoRA on GPT-2), and skipped
  with its one-line reason otherwise. Its own lines: start-up seconds (building ``LLM``), the adapter push
  (tensors into its LoRA cache after an update), the memory it added (resident set on a CPU, allocated on a GPU),
  and how far its log-probs are from the trainer's pass over its tokens (mean and max, and the k3 KL). Its random
  streams are vLLM's, so its tokens are not ``generate``'s.
- ``vllm_server``: vLLM's own server (the engine ``VLLMServer``), started on 127.0.0.1 from the same folder
  (``--server-cpus`` binds it to some cores); the same lines, its memory the server process's own, and its start-up
  the wait for its first answer.

Printed: seconds per rollout, prefill (the prompts' forward pass timed alone, as each side runs it) and decode (the
rest), each with its ratio to ``generate``; decoded tokens per second; the compile seconds of the warm-up, and how
many rollouts the compile takes to pay for itself against ``eager``; whether each side drew ``generate``'s tokens
(the fraction of equal tokens). The last line is the result as JSON.

    python benchmarks/decoding.py --shape gpt2 --prompts 4 --group 8 --prompt-length 256 --response-length 64
    python benchmarks/decoding.py --device cuda --dtype bfloat16 --shape qwen2-0.5b --prompts 64 --group 8
    python benchmarks/decoding.py --shape llama-124m --prompts 2 --group 8 --prompt-length 256 --response-length 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.settings import GPT2_VOCAB, PRESETS  # noqa: E402
from rlhf_lightning.models.shared_base import SharedBase  # noqa: E402
from rlhf_lightning.models.spec import LoraSpec  # noqa: E402
from rlhf_lightning.rollout.engines import CompiledDecoder, EagerDecoder, Engine, Generate  # noqa: E402
from rlhf_lightning.rollout.sampler import Sampler  # noqa: E402
from rlhf_lightning.rollout.seeds import Seeds  # noqa: E402
from rlhf_lightning.rollout.settings import SamplingSettings  # noqa: E402

# Layer shapes of public models (random weights): Qwen2-0.5B and Llama-3.2-1B.
SHAPES = {
    "qwen2-0.5b": {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151_936,
                   "tie_word_embeddings": True},
    "llama-1b": {"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128_256,
                 "tie_word_embeddings": True},
    # GPT-2 small's sizes in Llama's shape (vLLM serves LoRA on it), and a tiny one for the dry runs.
    "llama-124m": {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 3072,
                   "num_attention_heads": 12, "num_key_value_heads": 12, "vocab_size": GPT2_VOCAB,
                   "tie_word_embeddings": True},
    "llama-tiny": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512},
    **{name: {"model_type": "gpt2", "vocab_size": GPT2_VOCAB, **shape} for name, shape in PRESETS.items()},
}
SIDES = ("generate", "eager", "compiled", "vllm", "vllm_server")


def build(shape: str, dtype: torch.dtype, device: str) -> SharedBase:
    """A random model of ``shape`` with a policy adapter whose update is not zero."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(SHAPES[shape])
    positions = {"n_positions": 2048} if fields["model_type"] == "gpt2" else {"max_position_embeddings": 4096}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields, **positions), dtype=dtype)
    base = SharedBase(model.to(device))
    base.add_adapter("policy", LoraSpec(r=16, alpha=32))
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
    return base.eval()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def rollout(base: SharedBase, sampler: Sampler, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace,
            seeds: list[int]) -> tuple[float, torch.Tensor]:
    """Seconds of one rollout by ``sampler`` (its engine kept between rollouts) and its response tokens."""
    synchronize(args.device)
    started = time.perf_counter()
    drawn = sampler.draw(base, "policy", ids, mask, args.group, seeds)
    synchronize(args.device)
    return time.perf_counter() - started, drawn.tokens


def prefill_seconds(base: SharedBase, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace) -> float:
    """Seconds of the prompts' forward pass alone (``rows`` x prompt), as each side's prefill runs it."""
    synchronize(args.device)
    started = time.perf_counter()
    with torch.no_grad(), base.role("policy"):
        base.hf_model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
    synchronize(args.device)
    return time.perf_counter() - started


def memory_now(device: str) -> float:
    """GiB: allocated on a GPU; this process's resident set on a CPU."""
    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**30
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**30


def vllm_side(base: SharedBase, sampler: Sampler, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace,
              memory_before: float) -> dict:
    """The vLLM engine's own figures after its rollouts: start-up, an adapter push, memory, and the log-prob
    mismatch with the trainer's pass (``mismatch_statistics``, as the fits log it)."""
    from rlhf_lightning.algorithms.rollout_correction import mismatch_statistics
    from rlhf_lightning.core.policy import pad_to_sequence
    from rlhf_lightning.models.logprobs import token_logprobs

    engine = sampler.engine(base)
    process = getattr(engine, "process", None)  # the server side: the memory is its server's
    memory = server_memory_gib(process.process.pid) if process else memory_now(args.device) - memory_before
    lora_b = next(p for name, p in base.model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.mul_(1.0)  # an in-place write, as an optimizer step's
    sampler.sync(base, "policy", 1)  # the training loop's sync after it: the adapter pushed, timed
    drawn = sampler.draw(base, "policy", ids, mask, args.group, list(range(ids.shape[0] * args.group)))
    sequence_mask = pad_to_sequence(drawn.mask, drawn.sequences.shape[1])
    with torch.no_grad():
        trainer, _ = token_logprobs(base, "policy", drawn.sequences, drawn.attention_mask, sequence_mask)
    mismatch = mismatch_statistics(trainer[:, -drawn.mask.shape[1]:], drawn.logprobs, drawn.mask)
    return {"startup_seconds": engine.startup_seconds, "push_seconds": engine.push_seconds, "memory_gib": memory,
            "logprob_diff_mean": float(mismatch["logprob_diff_mean"]),
            "logprob_diff_max": float(mismatch["logprob_diff_max"]), "kl_sample_train": float(mismatch["kl"])}


def save_word_tokenizer(folder: str, vocab_size: int) -> None:
    """A tokenizer of ``vocab_size`` words ``t0``, ``t1``, ... for the random model: what a server needs to
    detokenize its answers (the tokens themselves travel as ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1").save_pretrained(folder)


def server_memory_gib(pid: int) -> float:
    """Resident memory of a server process and its children, GiB (psutil, which vLLM installs)."""
    import psutil

    server = psutil.Process(pid)
    return sum(process.memory_info().rss for process in [server, *server.children(recursive=True)]) / 2**30


def engine_of(side: str, args: argparse.Namespace, folder: str) -> Engine:
    """The engine of a side (the server's adapters and log in ``folder``)."""
    if side == "vllm":
        from rlhf_lightning.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(kv_cache_gib=args.kv_cache_gib)
    if side == "vllm_server":
        from rlhf_lightning.rollout.engines import EngineSetup
        from rlhf_lightning.rollout.vllm_server import VLLMServer

        cpus = None if args.server_cpus is None else [int(cpu) for cpu in args.server_cpus.split(",")]
        engine = VLLMServer(kv_cache_gib=args.kv_cache_gib, cpus=cpus)
        engine.prepare(EngineSetup(args.device, run_folder=folder))
        return engine
    return {"generate": Generate, "eager": EagerDecoder, "compiled": CompiledDecoder}[side]()


def vllm_refused(base: SharedBase) -> str | None:
    """Why the vLLM side cannot run here (vLLM absent or untested, a shape it serves no LoRA on), or None."""
    from rlhf_lightning.rollout.vllm_support import installed_version, version_refusal

    if refusal := version_refusal(installed_version()):
        return refusal
    if base.hf_model.config.model_type == "gpt2":
        return "vLLM has no LoRA for gpt2: use --shape llama-124m, qwen2-0.5b or llama-1b"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``--dry-run``: the tiny preset, short prompts, one repeat); unknown ``--sides`` are an
    error here, before any model is built."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", default=",".join(SIDES), help="vllm is skipped, saying why, where it cannot run")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="the vLLM sides' KV cache")
    parser.add_argument("--server-cpus", help="cores the vllm_server side's server is bound to, e.g. 0 (default: "
                                              "unbound)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny preset, short prompts, one repeat")
    parser.add_argument("--workdir", help="unused (the model is built in memory); accepted as every benchmark does")
    args = parser.parse_args(argv)
    if args.dry_run:  # the tiny GPT-2, or the tiny Llama when asked for (vLLM's side)
        args.shape = "llama-tiny" if args.shape == "llama-tiny" else "tiny"
        args.prompts, args.group, args.prompt_length, args.response_length, args.repeats = (
            2, 2, 8, 4, 1)
    if unknown := set(args.sides.split(",")) - set(SIDES):
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from {', '.join(SIDES)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sides = args.sides.split(",")
    dtype = getattr(torch, args.dtype)
    base = build(args.shape, dtype, args.device)
    vocab = base.hf_model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (args.prompts, args.prompt_length), generator=generator).to(args.device)
    mask = torch.ones_like(ids)
    rows = args.prompts * args.group
    seeds = list(range(rows))  # one random stream per response, the same for every side
    parameters = sum(p.numel() for p in base.hf_model.parameters())
    print(f"{args.shape}: {parameters / 1e6:.1f}M parameters, {args.dtype} on {args.device} "
          f"({torch.get_num_threads()} threads); {args.prompts} prompts x {args.group} samples, prompt "
          f"{args.prompt_length}, response {args.response_length} tokens")
    results, reference_tokens, vllm = {}, None, {}
    for side in [side for side in sides if side.startswith("vllm")]:
        if refusal := vllm_refused(base):
            print(f"{side}: skipped ({refusal})")
            sides.remove(side)
    folder = tempfile.TemporaryDirectory(prefix="decoding-vllm-")
    for side in sides:
        sampler = Sampler(SamplingSettings(max_new_tokens=args.response_length), Seeds(0), 0,
                          engine=engine_of(side, args, folder.name))
        memory_before = memory_now(args.device)
        if side.startswith("vllm") and base.hf_model.config.name_or_path != folder.name:
            base.save_merged(None, folder.name)  # vLLM loads the model from a folder: the same weights, saved
            save_word_tokenizer(folder.name, base.hf_model.config.vocab_size)  # a server detokenizes its answers
            base.hf_model.config.name_or_path = folder.name
        warmup, tokens = rollout(base, sampler, ids, mask, args, seeds)
        seconds = statistics.median(rollout(base, sampler, ids, mask, args, seeds)[0] for _ in range(args.repeats))
        prefill_rows = rows if side == "generate" else args.prompts
        # vLLM's prefill runs inside its scheduler, not timed apart (its decode column is the whole rollout)
        prefill = 0.0 if side.startswith("vllm") else statistics.median(
            prefill_seconds(base, ids.repeat_interleave(prefill_rows // args.prompts, 0),
                            mask.repeat_interleave(prefill_rows // args.prompts, 0), args)
            for _ in range(args.repeats))
        if reference_tokens is None:
            reference_tokens = tokens
        same = float((tokens == reference_tokens).float().mean()) if tokens.shape == reference_tokens.shape else 0.0
        decoder = getattr(sampler.engine(base), "decoder", None)  # our engines' decoding loop (not generate's)
        results[side] = {"seconds": seconds, "prefill_seconds": prefill, "decode_seconds": seconds - prefill,
                         "tokens_per_second": rows * args.response_length / seconds,
                         "warmup_seconds": warmup, "same_tokens": same,
                         "compile_seconds": decoder.stats.compile_seconds if decoder is not None else 0.0}
        if side.startswith("vllm"):
            vllm[side] = results[side]["vllm"] = vllm_side(base, sampler, ids, mask, args, memory_before)
            sampler.close()
    baseline = results.get("generate", next(iter(results.values())))
    print(f"{'side':<11} {'s/rollout':>9} {'ratio':>6} {'prefill s':>9} {'ratio':>6} {'decode s':>9} {'ratio':>6} "
          f"{'tok/s':>8} {'compile s':>9} {'same tokens':>11}")
    for side, result in results.items():
        for name in ("", "prefill_", "decode_"):
            result[f"{name}ratio"] = result[f"{name}seconds"] / baseline[f"{name}seconds"]
        print(f"{side:<11} {result['seconds']:9.3f} {result['ratio']:6.3f} {result['prefill_seconds']:9.3f} "
              f"{result['prefill_ratio']:6.3f} {result['decode_seconds']:9.3f} {result['decode_ratio']:6.3f} "
              f"{result['tokens_per_second']:8.0f} {result['compile_seconds']:9.1f} {result['same_tokens']:11.4f}")
    if {"eager", "compiled"} <= results.keys() and results["compiled"]["seconds"] < results["eager"]["seconds"]:
        saved = results["eager"]["seconds"] - results["compiled"]["seconds"]
        print(f"the compile pays for itself after {results['compiled']['compile_seconds'] / saved:.1f} rollouts "
              f"of this shape ({saved:.3f} s saved per rollout against eager)")
    for side, figures in vllm.items():
        print(f"{side}: start-up {figures['startup_seconds']:.1f} s · adapter push {figures['push_seconds'] * 1e3:.1f} "
              f"ms · memory added {figures['memory_gib']:.2f} GiB · trainer vs vLLM log-probs: |difference| mean "
              f"{figures['logprob_diff_mean']:.2e}, max {figures['logprob_diff_max']:.2e}, KL(vLLM || trainer) k3 "
              f"{figures['kl_sample_train']:.2e}")
    folder.cleanup()
    summary = {"settings": dict(vars(args)), "sides": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
