"""What one benchmark configuration is: the model's shape and the algorithm's settings, the same for every side.

:class:`Settings` is PPO's (and the base of the others), :class:`GRPOSettings` GRPO's and :class:`DPOSettings`
DPO's. A configuration travels to each side's process as JSON (``to_json``/``from_json``). The model is a GPT-2
preset (``PRESETS``) or, for ``scale.py``, a Llama shape (``llama_shape``: TinyLlama's 1.1B shape and smaller ones
of the same proportions).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2},  # the dry runs: every code path, in seconds
    "small": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12},
}
# Chat-like workloads (``--workload``): the prompt and response lengths, and GRPO's group size, of chat-style RL
# (a system prompt and a question, a short answer, 8 samples per prompt); options given on the command line win.
WORKLOADS: dict[str, dict[str, int]] = {
    "chat256": {"prompt_length": 256, "response_length": 128, "group_size": 8},
    "chat512": {"prompt_length": 512, "response_length": 128, "group_size": 8},
}
GPT2_VOCAB = 50_257  # GPT-2's vocabulary, its last id being <|endoftext|>; a pad token is added on top
# The dry runs' vocabulary: a 50,257-word tokenizer costs seconds to build and load in every process, and the dry
# runs check that the code runs, not how fast.
TINY_VOCAB = 1_024
# TinyLlama-1.1B's shape (LlamaConfig fields): 22 layers, width 2048, SwiGLU 5632, 32 query / 4 key-value heads,
# 32,000 ids. Random weights; see llama_shape for the smaller shapes of the same proportions.
TINYLLAMA: dict[str, int] = {"num_hidden_layers": 22, "hidden_size": 2048, "intermediate_size": 5632,
                             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32_000}


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
    # The responses' lengths (harness.lengths.LENGTHS): "equal" = stop token off, every response response_length
    # tokens; "task", "long-tail" = stop token on, each row's EOS forced where the seeded plan puts it, every side alike.
    lengths: str = "equal"

    @property
    def architecture(self) -> dict[str, int]:
        """The GPT-2 preset's config fields (``preset``; not used when ``llama`` is set)."""
        return PRESETS[self.preset]

    @property
    def vocab_words(self) -> int:
        """Ids of the base tokenizer, EOS the last of them; its pad token comes on top. GPT-2: 50,257 (+ pad =
        50,258 rows; ``TINY_VOCAB`` for the ``tiny`` preset); Llama: ``vocab_size - 1`` (+ pad = exactly
        ``vocab_size`` rows, 32,000 as TinyLlama's)."""
        if self.llama:
            return self.llama["vocab_size"] - 1
        return TINY_VOCAB if self.preset == "tiny" else GPT2_VOCAB

    @property
    def rollout_rows(self) -> int:
        """Responses sampled per iteration (one per prompt for PPO)."""
        return self.prompts

    @property
    def total_prompts(self) -> int:
        """Prompts of one process: one batch per iteration, warm-up included."""
        return self.prompts * (self.warmup + self.iterations)

    def to_json(self) -> str:
        """The settings as one JSON object (what a side's process is given)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        """The settings of :meth:`to_json`'s text."""
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
