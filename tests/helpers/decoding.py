"""Decoding as the tests run it: a policy base per architecture, random prompts, a sampler."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rollout.engines import Auto, CompiledDecoder, EagerDecoder, Engine, Generate
from rlhf_lightning.rollout.sampler import Sampler
from rlhf_lightning.rollout.seeds import Seeds
from rlhf_lightning.rollout.settings import SamplingSettings
from tests.helpers.families import FAMILIES
from tests.helpers.models import LORA, TINY_ARCHITECTURE

VOCAB = 300


STOPS = tuple(range(1, 31))  # a tenth of a random model's vocabulary: most responses stop, at various lengths


ARCHITECTURES = {"gpt2": {**TINY_ARCHITECTURE, "n_positions": 128}, **{name: family.architecture for name, family in FAMILIES.items()}}


def policy_base(family: str, dtype: torch.dtype = torch.float32) -> SharedBase:
    """A random model of ``family`` with a ``policy`` adapter whose update is not zero (so roles differ)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**ARCHITECTURES[family], "vocab_size": VOCAB})
    base = SharedBase(AutoModelForCausalLM.from_config(config))
    base.add_adapter("policy", LORA)
    with torch.no_grad():
        for name, parameter in base.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return base.to(dtype).eval()


def prompts(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: row 0 has 3 pad columns."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(STOPS) + 1, VOCAB, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


# The engines by the short names the tests use
ENGINES: dict[str, type[Engine]] = {"auto": Auto, "eager": EagerDecoder, "compiled": CompiledDecoder,
                                    "generate": Generate}
SAMPLERS: dict[tuple[int, str], Sampler] = {}  # one per model and engine: its engine keeps caches and compiled steps


def sampler(base: SharedBase, decoding: str) -> Sampler:
    key = (id(base), decoding)
    if key not in SAMPLERS:
        SAMPLERS[key] = Sampler(SamplingSettings(max_new_tokens=24, stop_token_ids=STOPS), Seeds(0), pad_token_id=0,
                                engine=ENGINES[decoding]())
    return SAMPLERS[key]


def sample(base: SharedBase, decoding: str, ids, mask, group: int, new_tokens: int = 24, role: str | None = "policy"):
    """``(sequences, response mask, sampler log-probs)`` of ``group`` samples per prompt, each row from a seed of its
    own (``generate``: every sample a row of its own, its prompt encoded again)."""
    drawn = sampler(base, decoding).draw(base, role, ids, mask, group, seeds=list(range(ids.shape[0] * group)),
                                         max_new_tokens=new_tokens)
    return drawn.sequences, drawn.mask, drawn.logprobs


def family_params() -> list:
    """Every family of :data:`ARCHITECTURES` as a parameter, all but GPT-2 marked ``slow``: the fast suite checks one
    family, the full suite every one."""
    return [pytest.param(family, marks=() if family == "gpt2" else pytest.mark.slow) for family in ARCHITECTURES]
