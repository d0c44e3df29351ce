"""FLOP counting: the analytic FLOPs of our PPO and GRPO iterations, and what this machine's matmuls reach.

The achieved fraction the benchmarks print is ``analytic FLOPs / seconds / matmul throughput``: how much of the
machine's best an iteration uses. The formulas are the package's (``rlhf_lightning.utils.flops``), which the training
loops' ``perf/mfu`` reads too.
"""

from __future__ import annotations

import torch

from rlhf_lightning.utils.flops import ModelShape
from rlhf_lightning.utils.flops import matmul_flops_per_second as measured_matmul

from .settings import GRPOSettings, Settings


def matmul_flops_per_second(device: str, dtype: torch.dtype = torch.float32, size: int = 2048,
                            seconds: float = 2.0, quick: bool = False) -> float:
    """Measured throughput of a large square matmul: what this machine's matmul units give at best (``quick``: a
    rough figure in a tenth of a second, for the dry runs)."""
    if quick:
        size, seconds = 256, 0.1
    return measured_matmul(device, dtype, size, seconds)


def iteration_flops(settings: Settings) -> dict[str, float]:
    """Analytic FLOPs of one of our PPO iterations, by pass (GPT-2 presets), counted as
    :mod:`rlhf_lightning.utils.flops` says: the reference and policy passes with the LM head on the response
    positions, the critic's and the reward's without, a backward as one forward (the base is frozen).
    """
    arch = settings.architecture
    layers, d = arch["n_layer"], arch["n_embd"]
    # matmuls: attention 4 d^2 + MLP 8 d^2 per block; LoRA: r * (in + out) for c_attn (d->3d), attn c_proj (d->d),
    # c_fc (d->4d), mlp c_proj (4d->d); the vocabulary: the pad token's row on top
    shape = ModelShape(layers, d, settings.vocab_words + 1, layers * 12 * d * d, layers * settings.lora_r * 16 * d)
    batch, prompt, response = settings.rollout_rows, settings.prompt_length, settings.response_length
    tokens = prompt + response
    full = shape.forward(batch * tokens, batch * tokens * (tokens + 1) / 2)  # causal: position i sees i + 1
    lm_head = shape.head(batch * response)
    generate = shape.generation(prompt, response, rows=batch)
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
