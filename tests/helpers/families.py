"""Tiny random models of eight architectures, each with a BPE tokenizer trained here and a chat template in the
style of its family: the test matrix of ``tests/contracts/test_model_families.py``.

Nothing is downloaded. Each family's tokenizer has the special tokens its family uses (Llama-3 has no pad token,
OPT's BOS is its EOS, Qwen's ChatML ends a turn with EOS then a newline, Gemma and Phi end a turn with a token
other than EOS) and a chat template written here in the same shape as the family's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "the cat sat on the mat and the dog ran to the park",
    "a small model reads a short prompt and writes a short answer",
    "what is two plus three? two plus three is five.",
    "please write one line about the sea. the sea is wide and blue.",
    "user assistant system model question answer instruct output",
    "sort these words: pear apple fig. apple fig pear.",
    "hello there, how are you today? i am well, thank you.",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 and letters a b c d e f g",
]


@dataclass(frozen=True)
class Family:
    """One architecture: its transformers config fields, special tokens and chat template."""

    name: str
    architecture: dict[str, Any]
    special: dict[str, str]  # bos/eos/pad/unk -> token text (pad absent: the family has none)
    extra_tokens: tuple[str, ...] = ()
    chat_template: str | None = None
    turn_end: str | None = None  # the token that ends an assistant turn, when the template has one
    conversational: bool = True
    notes: dict[str, Any] = field(default_factory=dict)


_LAYERS = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
           "max_position_embeddings": 128}

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

FAMILIES = {
    "llama": Family(
        "llama", {"model_type": "llama", **_LAYERS, "num_key_value_heads": 2},
        {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
        ("<|start_header_id|>", "<|end_header_id|>"), LLAMA3_TEMPLATE, "<|eot_id|>"),
    "qwen2": Family(
        "qwen2", {"model_type": "qwen2", **_LAYERS, "num_key_value_heads": 2},
        {"eos": "<|im_end|>", "pad": "<|endoftext|>"}, ("<|im_start|>",), CHATML_TEMPLATE, "<|im_end|>"),
    "mistral": Family(
        "mistral", {"model_type": "mistral", **_LAYERS, "num_key_value_heads": 2, "sliding_window": 64},
        {"bos": "<s>", "eos": "</s>", "unk": "<unk>"}, ("[INST]", "[/INST]"), MISTRAL_TEMPLATE, "</s>"),
    "gemma": Family(
        "gemma", {"model_type": "gemma", **_LAYERS, "num_key_value_heads": 1, "head_dim": 8},
        {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>"}, ("<start_of_turn>", "<end_of_turn>"),
        GEMMA_TEMPLATE, "<end_of_turn>"),
    # A soft cap far below the logits' scale, so that skipping it would show (Gemma-2 ships 30.0).
    "gemma2": Family(
        "gemma2", {"model_type": "gemma2", **_LAYERS, "num_key_value_heads": 1, "head_dim": 8,
                   "final_logit_softcapping": 0.5, "attn_logit_softcapping": 5.0, "sliding_window": 64},
        {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>"}, ("<start_of_turn>", "<end_of_turn>"),
        GEMMA_TEMPLATE, "<end_of_turn>"),
    "phi": Family(
        "phi", {"model_type": "phi", **_LAYERS, "partial_rotary_factor": 0.5},
        {"bos": "<|endoftext|>", "eos": "<|endoftext|>"}, ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
        PHI_TEMPLATE, "<|end|>"),
    "gpt_neox": Family(
        "gpt_neox", {"model_type": "gpt_neox", **_LAYERS, "rotary_pct": 0.25},
        {"bos": "<|endoftext|>", "eos": "<|endoftext|>"}, ("<|im_start|>", "<|im_end|>"), CHATML_TEMPLATE,
        "<|im_end|>"),
    # OPT has no chat template: plain-text prompts, and its BOS is its EOS.
    "opt": Family(
        "opt", {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 32, "ffn_dim": 64,
                "num_attention_heads": 4, "word_embed_proj_dim": 32, "max_position_embeddings": 128},
        {"bos": "</s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}, conversational=False),
}


def build_tokenizer(family: Family):
    """A byte-level BPE tokenizer trained on :data:`CORPUS` with the family's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([*family.special.values(), *family.extra_tokens]))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False,
        **{f"{kind}_token": token for kind, token in family.special.items()},
        additional_special_tokens=[t for t in family.extra_tokens if t not in family.special.values()],
    )
    if family.special.get("bos") and family.name in ("llama", "mistral", "gemma", "gemma2", "opt"):
        # These families' tokenizers put BOS in front of plain text themselves.
        from tokenizers import processors

        bos = family.special["bos"]
        backend = tokenizer.backend_tokenizer
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.chat_template = family.chat_template
    return tokenizer


def build_model_dir(family: Family, directory: Path, seed: int = 0, logit_scale: float = 1.0) -> Path:
    """Save a fresh random model of ``family`` and its tokenizer under ``directory`` (``from_pretrained``-able).

    ``logit_scale`` multiplies the output embeddings (untied) so that the logits are large, where post-processing
    such as soft-capping matters.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(family)
    fields = dict(family.architecture)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompts(family: Family, n: int = 8) -> list[Any]:
    """``n`` prompts of the family's data kind: conversations, or plain text for families without a template."""
    questions = ["what is two plus three?", "please write one line about the sea.", "sort these words: pear fig.",
                 "hello there, how are you today?"]
    texts = [questions[i % len(questions)] for i in range(n)]
    if not family.conversational:
        return [f"question: {text} answer:" for text in texts]
    return [[{"role": "user", "content": text}] for text in texts]
