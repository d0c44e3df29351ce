"""FLOP counting: the analytic FLOPs of our PPO and GRPO iterations, and what this machine's matmuls reach.

The achieved fraction the benchmarks print is ``analytic FLOPs / seconds / matmul throughput``: how much of the
machine's best an iteration uses.
"""

from __future__ import annotations

import torch

from .measure import Stopwatch
from .settings import GRPOSettings, Settings


def matmul_flops_per_second(device: str, dtype: torch.dtype = torch.float32, size: int = 2048,
                            seconds: float = 2.0, quick: bool = False) -> float:
    """Measured throughput of a large square matmul: what this machine's matmul units give at best (``quick``: a
    rough figure in a tenth of a second, for the dry runs)."""
    if quick:
        size, seconds = 256, 0.1
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    watch = Stopwatch(device)
    for _ in range(2):
        a @ b
    count, start = 0, watch.now()
    while watch.now() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (watch.now() - start)


def iteration_flops(settings: Settings) -> dict[str, float]:
    """Analytic FLOPs of one of our PPO iterations, by pass (GPT-2 presets).

    A forward pass costs ``2 * N_dec`` per token through the decoder (N_dec: parameters of the transformer blocks,
    embeddings excluded) plus attention ``4 * n_layer * d * ctx`` per token (QK^T and AV over the ``ctx``
    positions it attends to), plus the LM head ``2 * V * d`` per position where log-probs are needed (response
    positions only). LoRA adds ``2 * r * (in + out)`` per adapted matrix and token. With the base frozen, a
    backward computes only activation gradients and the small LoRA weight gradients: about one forward.
    Generation runs the prompt once and then one token per step with a KV cache.
    """
    arch = settings.architecture
    layers, d = arch["n_layer"], arch["n_embd"]
    vocab = settings.vocab_words + 1  # the pad token's row on top
    batch, prompt, response = settings.rollout_rows, settings.prompt_length, settings.response_length
    n_dec = layers * 12 * d * d  # attention 4 d^2 + MLP 8 d^2 per block
    # LoRA parameters: r * (in + out) for c_attn (d->3d), attn c_proj (d->d), c_fc (d->4d), mlp c_proj (4d->d)
    lora = layers * settings.lora_r * 16 * d
    tokens = prompt + response

    def decoder(tokens_per_row: int, ctx: float, adapters: bool) -> float:
        return batch * tokens_per_row * (2 * n_dec + 4 * layers * d * ctx + (2 * lora if adapters else 0))

    lm_head = 2 * vocab * d * batch * response
    average_ctx = (tokens + 1) / 2  # causal: position i attends to i + 1 positions
    full = decoder(tokens, average_ctx, adapters=True)
    generate = (decoder(prompt, (prompt + 1) / 2, True)
                + sum(decoder(1, prompt + step + 1, True) for step in range(response - 1))
                + 2 * vocab * d * batch * response)
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
