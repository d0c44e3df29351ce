"""What a side does first in its process: set its threads and seed, and load its models from the model folder.

The sides: ours (``bench_ours``: our modules under a real ``lightning.Trainer``), TRL's trainers
(``bench_trl``, ``bench_trl_grpo``, ``bench_trl_dpo``; each checks the TRL version it measures) and the floor
(``bench_floor``: the bare pieces of work, on the plain transformers model).
"""

from __future__ import annotations

import torch

from .fixtures import model_dir
from .settings import Settings


def configure_threads(settings: Settings) -> None:
    """Use ``settings.threads`` torch threads (0: torch's default)."""
    if settings.threads:
        torch.set_num_threads(settings.threads)


def load_trl_side(settings: Settings, version: str, script: str):
    """``(tokenizer, policy)`` of a TRL side, after checking the TRL version and setting threads and seed."""
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not trl.__version__.startswith(version):
        raise RuntimeError(f"this side measures TRL {version}.x, found {trl.__version__}: run the benchmark "
                           f"with the python of an environment with TRL {version} (see {script})")
    configure_threads(settings)
    torch.manual_seed(settings.seed)
    path = model_dir(settings)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def load_base_model(settings: Settings):
    """The floor's base: the plain transformers model with the fused GELU kernel, the fastest pieces we know."""
    from transformers import AutoModelForCausalLM

    from rlhf_lightning.models.loading import disable_dropout
    from rlhf_lightning.ops.activations import fuse_tanh_gelu

    model = AutoModelForCausalLM.from_pretrained(model_dir(settings))
    disable_dropout(model)
    fuse_tanh_gelu(model)
    return model
