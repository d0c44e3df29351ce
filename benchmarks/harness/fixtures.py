"""What every side is given, the same on each: the model folder, the prompts, DPO's pairs and GRPO's reward.

The parent process writes one folder under ``settings.workdir`` (a random base model built from a config, a
word-level tokenizer built here, a random reward adapter); each side then loads it in its own process. Nothing
comes from a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .settings import DPOSettings, Settings

EOS = "<|endoftext|>"


def build_tokenizer(words: int):
    """A word-level tokenizer with ``words`` ids (``t0`` ... plus ``<|endoftext|>``) and a pad token on top, built
    locally: random token ids cost the same as real text once they are ids."""
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
    """The folder of the base model and its tokenizer."""
    return Path(settings.workdir) / "model"


def reward_dir(settings: Settings) -> Path:
    """The folder of our side's reward adapter and head."""
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

    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer(settings.vocab_words)
    model = AutoModelForCausalLM.from_config(model_config(settings, tokenizer))
    model.save_pretrained(model_dir(settings))
    del model  # before the reward adapter's base is loaded: one copy of the weights at a time
    tokenizer.save_pretrained(model_dir(settings))
    if reward_adapter:
        save_random_reward_adapter(model_dir(settings), lora_spec(settings), Path(settings.workdir) / "adapters")


def save_random_reward_adapter(base_dir: Path, lora, folder: Path) -> Path:
    """Save a reward adapter (LoRA ``lora``, a ``LoraSpec``) with a non-zero update and a head on the base in
    ``base_dir`` under ``folder``, as the reward stage would; returns its folder. Our side's reward model."""
    from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
    from rlhf_lightning.models.shared_base import SharedBase
    from rlhf_lightning.models.spec import BaseModelSpec

    spec = BaseModelSpec(name_or_path=str(base_dir))
    base = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    base.add_adapter("reward", lora)
    base.add_head("reward")
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:  # a new adapter's B is zero: the reward would not depend on it
                parameter.normal_(0, 0.02)
    return base.save_adapter("reward", folder)


def lora_spec(settings: Settings):
    """The LoRA of every adapter of every side: rank ``lora_r``, ``lora_alpha``, all linear layers."""
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
    """The DPO benchmark's pairs file."""
    return Path(settings.workdir) / "pairs.jsonl"


def write_preference_pairs(settings: DPOSettings) -> Path:
    """Write the DPO benchmark's pairs, the same file for every side: ``prompts x (warmup + iterations)`` rows of
    ``prompt``/``chosen``/``rejected`` text, random words of the word-level tokenizer (``t<id>``, one token each,
    never EOS). The responses carry no EOS: each side appends one itself, as it does for plain-text data, so the
    chosen and rejected responses are ``response_length`` and ``rejected_length`` tokens with it."""
    generator = torch.Generator().manual_seed(settings.seed + 2)
    count = settings.total_prompts

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
    """The rows :func:`write_preference_pairs` wrote."""
    with preference_path(settings).open() as handle:
        return [json.loads(line) for line in handle]


def even_token_reward(prompts: list, completions: list, completion_ids: list[list[int]], **columns) -> list[float]:
    """The GRPO benchmark's reward on every side, with TRL's reward-function signature: the fraction of even token
    ids in each completion. A function and no model, so no reward model's forward pass muddies the comparison; it
    still varies within a group, so the advantages and the gradients are not zero."""
    return [sum(1 for token in ids if token % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
