"""What the vLLM tests share, once per session: the server of the server engine's tests (starting one takes a
minute), a tiny Llama with the calculator task's tokenizer, and adapters on the tiny Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.rollout.engines import EngineSetup
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_server import VLLMServer
from rlhf_lightning.tasks.calculator import build_tokenizer
from tests.helpers.models import TINY_LLAMA, with_random_adapter

TEMPERATURE = 0.7


@pytest.fixture(scope="session")
def served(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a policy adapter that changes its outputs, and a sampler whose engine started a server of
    it; the server is stopped at the end."""
    model, tokenizer = with_random_adapter(tiny_llama_dir)
    engine = VLLMServer(kv_cache_gib=0.25, startup_timeout=300, request_timeout=120)
    engine.prepare(EngineSetup("cpu", run_folder=str(tmp_path_factory.mktemp("server-run"))))
    settings = SamplingSettings(max_new_tokens=8, temperature=TEMPERATURE, stop_token_ids=(tokenizer.eos_token_id,))
    sampler = Sampler(settings, Seeds(0), tokenizer.pad_token_id, engine=engine)
    yield model, sampler, tokenizer, engine
    sampler.close()


@pytest.fixture(scope="session")
def server_url(served) -> str:
    """The address of the session's server, started if no test has drawn from it yet."""
    model, _, _, engine = served
    if engine.url is None:
        engine.connect(model)
    return engine.url


@pytest.fixture(scope="session")
def calculator_llama_dir(tmp_path_factory):
    """A tiny random Llama with the calculator task's tokenizer, its turn-end token made likely so that turns end
    after a few tokens and episodes take several turns."""
    directory = tmp_path_factory.mktemp("calculator-llama")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**{key: value for key, value in TINY_LLAMA.items() if key != "model_type"},
                         vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        hidden = model.model(torch.randint(0, len(tokenizer), (8, 24))).last_hidden_state.mean((0, 1))
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 6.0 * hidden / hidden.square().sum()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def llama_adapters(tiny_llama_dir, tmp_path_factory):
    """A reward adapter with a head, and a policy adapter to distil from, on the tiny Llama (non-zero updates)."""
    from tests.helpers.models import save_reward_adapter

    out = tmp_path_factory.mktemp("llama-adapters")
    return save_reward_adapter(tiny_llama_dir, out / "reward"), save_reward_adapter(tiny_llama_dir, out / "teacher",
                                                                                      role=POLICY, head=False)
