"""What every side of the PPO benchmark shares: settings, the model folder, prompts, memory and FLOP counting.

The parent process writes one folder (a random GPT-2-shaped model, a 50,257-token tokenizer, a reward adapter);
each side then runs in a fresh child process that loads it, so no side inherits another's memory or caches.
``Settings.llama`` swaps the GPT-2 preset for a Llama-shaped model (``llama_shape``: TinyLlama's 1.1B shape and
smaller ones) with a 32,000-id tokenizer, for ``scale.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Offline everywhere: nothing may come from a model hub.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
                  TOKENIZERS_PARALLELISM="false")

import torch  # noqa: E402

PRESETS: dict[str, dict[str, int]] = {
    "small": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
}
GPT2_VOCAB = 50_257  # GPT-2's vocabulary, its last id being <|endoftext|>; a pad token is added on top
# TinyLlama-1.1B's shape (LlamaConfig fields): 22 layers, width 2048, SwiGLU 5632, 32 query / 4 key-value heads,
# 32,000 ids. Random weights; see llama_shape for the smaller shapes of the same proportions.
TINYLLAMA: dict[str, int] = {"num_hidden_layers": 22, "hidden_size": 2048, "intermediate_size": 5632,
                             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32_000}
EOS = "<|endoftext|>"
RESULT_PREFIX = "BENCH_RESULT "
GIB = 2**30


@dataclass
class Settings:
    """One benchmark configuration; the same for every side."""

    preset: str = "small"
    prompts: int = 16
    prompt_length: int = 32
    response_length: int = 64
    ppo_epochs: int = 4
    num_minibatches: int = 1
    precision: str = "32"  # Lightning's spelling: "32" or "bf16-mixed"
    iterations: int = 2  # measured iterations per child process, after the warm-up
    warmup: int = 1
    repeats: int = 2  # A B A B rounds
    lora_r: int = 16
    lora_alpha: float = 32.0
    lr: float = 1e-5
    device: str = "cpu"
    threads: int = 0  # torch threads; 0 = torch's default
    seed: int = 0
    mmap_threshold: int = 0  # glibc MALLOC_MMAP_THRESHOLD_ for every side; 0 = default
    workdir: str = ""
    ppo_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra PPO init args (ours only)
    # A Llama shape (LlamaConfig fields, see llama_shape) instead of the GPT-2 preset; empty: the preset.
    llama: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def architecture(self) -> dict[str, int]:
        """The GPT-2 preset's config fields (``preset``; not used when ``llama`` is set)."""
        return PRESETS[self.preset]

    @property
    def vocab_words(self) -> int:
        """Ids of the base tokenizer, EOS the last of them; its pad token comes on top. GPT-2: 50,257 (+ pad =
        50,258 rows); Llama: ``vocab_size - 1`` (+ pad = exactly ``vocab_size`` rows, 32,000 as TinyLlama's)."""
        return self.llama["vocab_size"] - 1 if self.llama else GPT2_VOCAB

    @property
    def rollout_rows(self) -> int:
        """Responses sampled per iteration (one per prompt for PPO)."""
        return self.prompts

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        return cls(**json.loads(text))


@dataclass
class GRPOSettings(Settings):
    """The GRPO benchmark's configuration: ``prompts`` prompts x ``group_size`` responses each per iteration;
    ``ppo_epochs`` and ``num_minibatches`` are the update passes (TRL's ``num_iterations`` and
    ``steps_per_generation``). ``beta`` is the KL coefficient of the beta > 0 sides (the ``_beta0`` sides run at 0)."""

    group_size: int = 8  # TRL's num_generations default
    beta: float = 0.04
    trl_gradient_checkpointing: bool = False  # TRL's GRPOConfig turns it on by default; ours has none

    @property
    def rollout_rows(self) -> int:
        return self.prompts * self.group_size

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per iteration: every pass over the rollout makes one per minibatch."""
        return self.ppo_epochs * self.num_minibatches


@dataclass
class DPOSettings(Settings):
    """The DPO benchmark's configuration: an iteration is one optimizer step on ``prompts`` preference pairs (one
    micro-batch, ``2 x prompts`` rows through the model). Every pair has a prompt of ``prompt_length`` tokens, a
    chosen response of ``response_length`` tokens and a rejected one of ``rejected_length`` tokens (EOS included in
    both). ``precompute`` is set per side: the reference log-probs of every pair computed once before training."""

    rejected_length: int = 48
    beta: float = 0.1  # TRL's DPOConfig default
    precompute: bool = False
    trl_gradient_checkpointing: bool = False  # TRL's DPOConfig turns it on by default; ours has none

    @property
    def rollout_rows(self) -> int:
        return 2 * self.prompts

    @property
    def steps(self) -> int:
        """Optimizer steps per process, warm-up included: one pass over every pair of the dataset."""
        return self.warmup + self.iterations

    @property
    def max_length(self) -> int:
        """The longest sequence, prompt + the longer response: both sides' ``max_length``, so nothing is cut."""
        return self.prompt_length + max(self.response_length, self.rejected_length)


# ---- the shared model folder ----------------------------------------------------------------------------


def build_tokenizer(words: int = GPT2_VOCAB):
    """A word-level tokenizer with ``words`` ids (``t0`` ... plus ``<|endoftext|>``, by default GPT-2's 50,257)
    and a pad token on top, built locally: random token ids cost the same as real text once they are ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(words - 1)}
    vocab[EOS] = words - 1
    core = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                        pad_token="<|pad|>")
    tokenizer.padding_side = "left"
    return tokenizer


def model_dir(settings: Settings) -> Path:
    return Path(settings.workdir) / "model"


def reward_dir(settings: Settings) -> Path:
    return Path(settings.workdir) / "adapters" / "reward"


def model_config(settings: Settings, tokenizer):
    """The transformers config of the benchmark's base: the GPT-2 preset, or the Llama shape ``settings.llama``
    (untied input and output embeddings, as TinyLlama's)."""
    from transformers import GPT2Config, LlamaConfig

    ids = {"bos_token_id": tokenizer.eos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    if settings.llama:
        if len(tokenizer) != settings.llama["vocab_size"]:
            raise ValueError(f"tokenizer of {len(tokenizer)} ids for a vocabulary of {settings.llama['vocab_size']}")
        return LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, **ids, **settings.llama)
    return GPT2Config(vocab_size=len(tokenizer), n_positions=1024, **ids, **settings.architecture)


def prepare_workdir(settings: Settings, reward_adapter: bool = True) -> None:
    """Write the random base model, its tokenizer and (``reward_adapter``) a random reward adapter with head under
    ``workdir``."""
    from transformers import AutoModelForCausalLM

    from rlhf_lightning.models.loading import load_causal_lm
    from rlhf_lightning.models.shared_base import SharedBase
    from rlhf_lightning.models.spec import BaseModelSpec

    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer(settings.vocab_words)
    model = AutoModelForCausalLM.from_config(model_config(settings, tokenizer))
    model.save_pretrained(model_dir(settings))
    del model  # before the reward adapter's base is loaded: one copy of the weights at a time
    tokenizer.save_pretrained(model_dir(settings))
    if not reward_adapter:
        return
    # The reward model of our side: an adapter with a non-zero update and a head on the same base.
    spec = BaseModelSpec(name_or_path=str(model_dir(settings)))
    base = SharedBase(load_causal_lm(spec, tokenizer))
    base.add_adapter("reward", lora_spec(settings))
    base.add_head("reward")
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    base.save_adapter("reward", Path(settings.workdir) / "adapters")


def lora_spec(settings: Settings):
    from rlhf_lightning.models.spec import LoraSpec

    return LoraSpec(r=settings.lora_r, alpha=settings.lora_alpha, target_modules="all-linear")


def peft_config(settings: Settings, model):
    """The ``peft.LoraConfig`` of ``lora_spec`` for ``model``: ``fan_in_fan_out`` where its layers store weights
    transposed (GPT-2's ``Conv1D``), not for ``nn.Linear`` (Llama), as ``SharedBase.add_adapter`` decides."""
    from transformers.pytorch_utils import Conv1D

    return lora_spec(settings).to_peft(fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()))


def prompt_ids(settings: Settings, count: int) -> torch.Tensor:
    """``[count, prompt_length]`` random token ids, the same on every side (no EOS, no pad: no padding)."""
    generator = torch.Generator().manual_seed(settings.seed + 1)
    return torch.randint(0, settings.vocab_words - 1, (count, settings.prompt_length), generator=generator)


def preference_path(settings: Settings) -> Path:
    return Path(settings.workdir) / "pairs.jsonl"


def write_preference_pairs(settings: DPOSettings) -> Path:
    """Write the DPO benchmark's pairs, the same file for every side: ``prompts x (warmup + iterations)`` rows of
    ``prompt``/``chosen``/``rejected`` text, random words of the word-level tokenizer (``t<id>``, one token each,
    never EOS). The responses carry no EOS: each side appends one itself, as it does for plain-text data, so the
    chosen and rejected responses are ``response_length`` and ``rejected_length`` tokens with it."""
    generator = torch.Generator().manual_seed(settings.seed + 2)
    count = total_prompts(settings)

    def words(length: int) -> list[str]:
        ids = torch.randint(0, settings.vocab_words - 1, (count, length), generator=generator).tolist()
        return [" ".join(f"t{i}" for i in row) for row in ids]

    prompts = words(settings.prompt_length)
    chosen = words(settings.response_length - 1)
    rejected = words(settings.rejected_length - 1)
    path = preference_path(settings)
    with path.open("w") as handle:
        for row in zip(prompts, chosen, rejected, strict=True):
            # the responses start with a space: TRL tokenizes prompt + response as one string
            handle.write(json.dumps({"prompt": row[0], "chosen": " " + row[1], "rejected": " " + row[2]}) + "\n")
    return path


def read_preference_pairs(settings: Settings) -> list[dict[str, str]]:
    with preference_path(settings).open() as handle:
        return [json.loads(line) for line in handle]


def even_token_reward(prompts: list, completions: list, completion_ids: list[list[int]], **columns) -> list[float]:
    """The GRPO benchmark's reward on every side, with TRL's reward-function signature: the fraction of even token
    ids in each completion. A function and no model, so no reward model's forward pass muddies the comparison; it
    still varies within a group, so the advantages and the gradients are not zero."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def total_prompts(settings: Settings) -> int:
    return settings.prompts * (settings.warmup + settings.iterations)


def configure_threads(settings: Settings) -> None:
    if settings.threads:
        torch.set_num_threads(settings.threads)


# ---- measurements ---------------------------------------------------------------------------------------


def add_common_arguments(parser, iterations: int, unit: str, precisions: tuple[str, ...] = ("32", "bf16-mixed"),
                         profile_sides: tuple[str, ...] = ("ours",)) -> None:
    """The options every side-by-side benchmark shares (``unit``: what one measured iteration is;
    ``profile_sides``: the sides ``--profile`` can profile)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--precision", choices=precisions, default="32",
                        help="Lightning's precision; bf16-true (where offered): our base in bf16 weights, ours only")
    parser.add_argument("--iterations", type=int, default=iterations, help=f"measured {unit} per process")
    parser.add_argument("--warmup", type=int, default=1, help=f"unmeasured {unit} first, per process")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds of fresh processes")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process; 0 = torch's default")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in every side's process, e.g. 1048576: "
                             "large tensors are then returned to the OS when freed instead of fragmenting the "
                             "heap; 0 = the allocator's default")
    parser.add_argument("--workdir", default=None, help="folder for the model and logs (default: a temp dir)")
    parser.add_argument("--profile", nargs="?", const="ours", default=None, choices=profile_sides, metavar="SIDE",
                        help=f"print torch.profiler's top operators of SIDE's last measured {unit.rstrip('s')} (first "
                             f"round; SIDE: {', '.join(profile_sides)}; default ours); its time then includes the "
                             "profiler's overhead")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default=None, help=argparse.SUPPRESS)


def common_settings(args, prefix: str) -> dict[str, Any]:
    """The :class:`Settings` fields of :func:`add_common_arguments`' options (a temp workdir ``<prefix>-bench-*``
    when none is given; LoRA's alpha = 2 r)."""
    import tempfile

    return {"preset": args.preset, "precision": args.precision, "iterations": args.iterations,
            "warmup": args.warmup, "repeats": args.repeats, "lora_r": args.lora_r, "lora_alpha": 2.0 * args.lora_r,
            "device": args.device, "threads": args.threads, "mmap_threshold": args.mmap_threshold,
            "workdir": args.workdir or tempfile.mkdtemp(prefix=f"{prefix}-bench-")}


def side_order(requested: str, sides: Sequence[str], floor_pieces: Sequence[str] = ()) -> list[str]:
    """The processes of one round: the requested ``sides`` (comma-separated) in ``sides`` order, then each floor
    piece (``floor/<piece>``) when ``floor`` is requested (a benchmark with ``floor_pieces``); an unknown side is
    a clear error."""
    asked = requested.split(",")
    known = [*sides, "floor"] if floor_pieces else list(sides)
    unknown = set(asked) - set(known)
    if unknown:
        raise SystemExit(f"unknown sides {sorted(unknown)}; choose from {','.join(known)}")
    return [side for side in sides if side in asked] + (
        [f"floor/{piece}" for piece in floor_pieces] if "floor" in asked else [])


def load_trl_side(settings: Settings, version: str, script: str):
    """``(tokenizer, policy)`` of a TRL side, after checking the TRL version and setting threads and seed."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not trl.__version__.startswith(version):
        raise RuntimeError(f"this side measures TRL {version}.x, found {trl.__version__}: run the benchmark "
                           f"with the TRL {version} environment's python (see {script})")
    configure_threads(settings)
    torch.manual_seed(settings.seed)
    path = model_dir(settings)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_cuda_bytes() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def weights_bytes(settings: Settings) -> int:
    """Bytes of one copy of the base weights in the benchmark's dtype (fp32 storage in both precisions), counted
    on the meta device: this process holds no copy of them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir(settings)),
                                                 dtype=torch.float32)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def llama_shape(layers: int, hidden: int, vocab: int = TINYLLAMA["vocab_size"], **fields: int) -> dict[str, int]:
    """A Llama shape (LlamaConfig fields) with TinyLlama's proportions: SwiGLU width 2.75 x ``hidden`` (5632 at
    2048) rounded to a multiple of 8, heads of 64 dimensions, 8 query heads per key-value head; ``fields``
    override any of them."""
    heads = max(1, hidden // 64)
    shape = {"num_hidden_layers": layers, "hidden_size": hidden,
             "intermediate_size": max(8, round(2.75 * hidden / 8) * 8), "num_attention_heads": heads,
             "num_key_value_heads": max(1, heads // 8), "vocab_size": vocab}
    shape.update(fields)
    if shape["hidden_size"] % shape["num_attention_heads"] or \
            shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ValueError(f"heads do not divide the shape: {shape}")
    return shape


def llama_parameters(shape: dict[str, int]) -> int:
    """Parameters of a Llama model of ``shape`` (untied embeddings, no biases): embeddings and LM head
    ``2 V d``, per layer ``2 d^2 + 2 d (d kv / heads)`` for attention, ``3 d I`` for the MLP and ``2 d`` for
    its norms, and the final norm ``d``."""
    d, inner = shape["hidden_size"], shape["intermediate_size"]
    kv_width = d * shape["num_key_value_heads"] // shape["num_attention_heads"]
    layer = 2 * d * d + 2 * d * kv_width + 3 * d * inner + 2 * d
    return 2 * shape["vocab_size"] * d + shape["num_hidden_layers"] * layer + d


def meminfo_bytes(field: str) -> int:
    """A field of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``) in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        if name == field:
            return int(value.split()[0]) * 1024
    raise KeyError(field)


def rss_bytes(pid: int) -> int:
    """The current resident set size of process ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def load_base_model(settings: Settings):
    """The floor's base: the plain transformers model with the fused GELU kernel, the fastest pieces we know."""
    from transformers import AutoModelForCausalLM

    from rlhf_lightning.models.loading import disable_dropout
    from rlhf_lightning.ops.activations import fuse_tanh_gelu

    model = AutoModelForCausalLM.from_pretrained(model_dir(settings))
    disable_dropout(model)
    fuse_tanh_gelu(model)
    return model


def report(payload: dict[str, Any]) -> None:
    """Hand a child's result to the parent: one line on stdout."""
    payload = {**payload, "peak_rss": peak_rss_bytes(), "peak_cuda": peak_cuda_bytes()}
    print(RESULT_PREFIX + json.dumps(payload), flush=True)


class MemoryLimitExceeded(RuntimeError):
    """A child process grew past the resident memory it was allowed and was killed (see :func:`run_child`)."""

    def __init__(self, side: str, rss: int, limit: int, log: Path) -> None:
        super().__init__(f"{side} was killed at {rss / GIB:.2f} GiB resident, past its limit of "
                         f"{limit / GIB:.2f} GiB; see {log}")
        self.rss, self.limit = rss, limit


def run_child(script: str | Path, side: str, settings: Settings, profile: bool = False, python: str | None = None,
              rss_limit: int | None = None) -> dict[str, Any]:
    """Run one side of a benchmark in a fresh Python process (``script --child side --settings ...``, this
    interpreter or ``python``) and return its result; its output is appended to ``workdir/logs/<side>.log``.

    ``rss_limit``: bytes of resident memory the child may reach; its RSS is polled (5 times a second) and past the
    limit it is killed and :class:`MemoryLimitExceeded` raised, so a side that would not fit never brings the
    machine to the kernel's OOM killer."""
    import subprocess

    command = [python or sys.executable, str(Path(script).resolve()), "--child", side, "--settings",
               settings.to_json()]
    if profile:
        command.append("--profile")
    log = Path(settings.workdir) / "logs" / f"{side.replace('/', '_')}.log"
    log.parent.mkdir(exist_ok=True)
    env = dict(os.environ)
    if settings.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(settings.mmap_threshold)
    if rss_limit is None:
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    else:
        result = _run_watched(command, env, side, rss_limit, log)
    with log.open("a") as handle:
        handle.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{side} failed (exit {result.returncode}); see {log}:\n{result.stderr[-3000:]}")
    if profile:
        print(result.stdout.split(RESULT_PREFIX)[0], flush=True)
    line = next(line for line in reversed(result.stdout.splitlines()) if line.startswith(RESULT_PREFIX))
    return json.loads(line[len(RESULT_PREFIX):])


def run_rounds(script: str | Path, order: Sequence[str], settings: Settings, profile_side: str | None,
               settings_of: Callable[[str], Settings] | None = None, unit: str = "s/iter", digits: int = 2,
               details: Callable[[str, dict[str, Any]], str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``settings.repeats`` alternating rounds of fresh processes, every side of ``order`` in turn (its settings
    ``settings_of(side)`` where given), ``profile_side`` profiled in the first round; each process's seconds
    per ``unit``, ``details(side, result)`` (which may also check the result) and peak printed as it ends.
    Returns every side's results."""
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in order}
    for round_index in range(settings.repeats):
        for side in order:
            result = run_child(script, side, settings_of(side) if settings_of else settings,
                               side == profile_side and round_index == 0)
            extra = details(side, result) if details else ""
            results[side].append(result)
            seconds = [f"{row['seconds']:.{digits}f}" for row in result["iterations"]]
            print(f"round {round_index + 1}: {side:<22} {unit} {seconds}{extra} peak "
                  f"{result['peak_rss'] / GIB:.3f} GiB", flush=True)
    return results


def peak_memory_key(device: str) -> str:
    """The summary's peak-memory entry for ``device``: CUDA's allocator peak on a GPU, else the peak RSS."""
    return "peak_cuda" if device.startswith("cuda") else "peak_rss"


def _run_watched(command: list[str], env: dict[str, str], side: str, rss_limit: int, log: Path):
    """``subprocess.run(command)`` with the child killed once its resident memory passes ``rss_limit``."""
    import subprocess

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while True:
        try:
            stdout, stderr = process.communicate(timeout=0.2)
            return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            rss = rss_bytes(process.pid)
            if rss > rss_limit:
                process.kill()
                stdout, stderr = process.communicate()
                with log.open("a") as handle:
                    handle.write(stdout + stderr + f"\nKILLED: resident {rss} bytes > limit {rss_limit}\n")
                raise MemoryLimitExceeded(side, rss, rss_limit, log) from None


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per side: median iteration seconds, rollout/update split, tokens/s, peak memory over all processes and the
    median ``precompute`` seconds where the processes report one (DPO's reference pass before training)."""
    summary = {}
    for side, runs in results.items():
        rows = [row for run in runs for row in run["iterations"]]
        seconds = median([row["seconds"] for row in rows])
        entry = {"seconds": seconds, "peak_rss": max(run["peak_rss"] for run in runs)}
        if runs[0].get("peak_cuda") is not None:
            entry["peak_cuda"] = max(run["peak_cuda"] for run in runs)
        if "rollout" in rows[0]:
            entry["rollout"] = median([row["rollout"] for row in rows])
            entry["update"] = median([row["seconds"] - row["rollout"] for row in rows])
            entry["tokens_per_second"] = median([row["tokens"] for row in rows]) / seconds
        if "precompute" in runs[0]:  # seconds of a pass made once per process, before the measured iterations
            entry["precompute"] = median([run["precompute"] for run in runs])
        if "phases" in rows[0]:
            names = {name for row in rows for name in row["phases"]}
            entry["phases"] = {name: median([row["phases"].get(name, 0.0) for row in rows]) for name in sorted(names)}
        summary[side] = entry
    return summary


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_iteration_table(summary: dict[str, dict[str, Any]], sides: Sequence[str],
                          floors: dict[str, dict[str, Any]], weights: int, memory_key: str) -> None:
    """The online benchmarks' table: per side (in ``sides`` order) seconds per iteration, its rollout/update
    split, generated tokens per second and peak memory; then each floor with its pieces."""
    print(f"\none copy of the weights: {weights / GIB:.3f} GiB; peak memory = {memory_key}")
    print(f"{'side':<16} {'s/iter':>8} {'rollout':>8} {'update':>8} {'tok/s':>8} {'peak GiB':>9} {'x weights':>9}")
    for side in sides:
        if side in summary:
            s = summary[side]
            print(f"{side:<16} {s['seconds']:>8.2f} {s['rollout']:>8.2f} {s['update']:>8.2f} "
                  f"{s['tokens_per_second']:>8.1f} {s[memory_key] / GIB:>9.3f} {s[memory_key] / weights:>9.1f}")
    for name, floor in floors.items():
        if floor:
            print(f"{name:<16} {floor['seconds']:>8.2f} {'':>8} {'':>8} {'':>8} {floor['peak'] / GIB:>9.3f} "
                  f"{floor['peak'] / weights:>9.1f}")
            for piece, seconds in floor["pieces"].items():
                print(f"  {piece:<14} {seconds:>8.2f} s")


class IterationProfiler:
    """torch.profiler over iteration ``iteration`` of a side (0-based, warm-up included; None: no profile):
    ``begin(index)`` as each iteration begins, ``stop()`` as it ends, which prints the top operators by their own
    CPU time (the table ``--profile`` shows)."""

    def __init__(self, iteration: int | None) -> None:
        self.iteration = iteration
        self.profiler = None

    def begin(self, index: int) -> None:
        if index == self.iteration:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def stop(self, rows: int = 25) -> None:
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        print(self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
        self.profiler = None


class Stopwatch:
    """Wall-clock seconds of named pieces, synchronising the device so asynchronous kernels are counted."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def now(self) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def matmul_flops_per_second(device: str, dtype: torch.dtype = torch.float32, size: int = 2048,
                            seconds: float = 2.0) -> float:
    """Measured throughput of a large square matmul: what this machine's matmul units give at best."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    watch = Stopwatch(device)
    for _ in range(2):
        a @ b
    count, start = 0, watch.now()
    while watch.now() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (watch.now() - start)


def iteration_flops(settings: Settings) -> dict[str, float]:
    """Analytic FLOPs of one of our PPO iterations, by pass.

    A forward pass costs ``2 * N_dec`` per token through the decoder (N_dec: parameters of the transformer blocks,
    embeddings excluded) plus attention ``4 * n_layer * d * ctx`` per token (QK^T and AV over the ``ctx``
    positions it attends to), plus the LM head ``2 * V * d`` per position where log-probs are needed (response
    positions only). LoRA adds ``2 * r * (in + out)`` per adapted matrix and token. With the base frozen, a
    backward computes only activation gradients and the small LoRA weight gradients: about one forward.
    Generation runs the prompt once and then one token per step with a KV cache.
    """
    arch = settings.architecture
    layers, d = arch["n_layer"], arch["n_embd"]
    vocab = GPT2_VOCAB + 1
    batch, prompt, response = settings.rollout_rows, settings.prompt_length, settings.response_length
    n_dec = layers * 12 * d * d  # attention 4 d^2 + MLP 8 d^2 per block
    # LoRA parameters: r * (in + out) for c_attn (d->3d), attn c_proj (d->d), c_fc (d->4d), mlp c_proj (4d->d)
    lora = layers * settings.lora_r * 16 * d
    tokens = prompt + response

    def decoder(tokens_per_row: int, ctx: float, adapters: bool) -> float:
        return batch * tokens_per_row * (2 * n_dec + 4 * layers * d * ctx + (2 * lora if adapters else 0))

    lm_head = 2 * vocab * d * batch * response
    average_ctx = (tokens + 1) / 2  # causal: position i attends to i + 1 positions
    full = decoder(tokens, average_ctx, adapters=True)
    generate = (decoder(prompt, (prompt + 1) / 2, True)
                + sum(decoder(1, prompt + step + 1, True) for step in range(response - 1))
                + 2 * vocab * d * batch * response)
    rollout = {
        "generate": generate,
        "reference": full + lm_head,
        "critic": full,
        "reward": full,
    }
    update = {"policy_forward": full + lm_head, "policy_backward": full + lm_head,
              "critic_forward": full, "critic_backward": full}
    flops = {f"rollout/{k}": v for k, v in rollout.items()}
    flops.update({f"update/{k}": settings.ppo_epochs * v for k, v in update.items()})
    flops["total"] = sum(flops.values())
    return flops


def grpo_iteration_flops(settings: GRPOSettings, beta: float) -> dict[str, float]:
    """Analytic FLOPs of one of our GRPO iterations, by pass (see :func:`iteration_flops`): generation, the old
    log-probs when there is more than one optimizer step, the reference pass at ``beta`` > 0, and the policy's
    forward and backward over every response ``ppo_epochs`` times (the minibatches split the rows, not the work)."""
    ppo = iteration_flops(settings)
    flops = {"rollout/generate": ppo["rollout/generate"]}
    if settings.optimizer_steps > 1:
        flops["rollout/old_logprobs"] = ppo["rollout/reference"]
    if beta:
        flops["rollout/reference"] = ppo["rollout/reference"]
    flops["update/policy_forward"] = ppo["update/policy_forward"]
    flops["update/policy_backward"] = ppo["update/policy_backward"]
    flops["total"] = sum(flops.values())
    return flops


def python_executable() -> str:
    return sys.executable
