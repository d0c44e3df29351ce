"""The vLLM server the server engine's tests share: one for the session (starting one takes a minute)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.core.policy import POLICY
from rlhf_lightning.models.loading import load_causal_lm, load_tokenizer
from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.models.spec import BaseModelSpec
from rlhf_lightning.rollout.engines import EngineSetup
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import SamplingSettings
from rlhf_lightning.rollout.vllm_server import VLLMServer
from tests.helpers.models import LORA

TEMPERATURE = 0.7


@pytest.fixture(scope="session")
def served(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a policy adapter that changes its outputs, and a sampler whose engine started a server of
    it; the server is stopped at the end."""
    spec = BaseModelSpec(name_or_path=str(tiny_llama_dir))
    tokenizer = load_tokenizer(spec)
    model = SharedBase(load_causal_lm(spec, tokenizer))
    model.add_adapter(POLICY, LORA)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
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
