"""Token sampling inside Hugging Face ``generate``, with our own sampler as the last logits processor.

``generate(do_sample=True)`` draws each token with ``torch.multinomial``, which on CPU draws one exponential
variate per vocabulary entry: for GPT-2's 50,257 ids about a tenth of the decoding time on two cores. The
inverse-CDF draw below needs one uniform number per row. ``generate`` then runs greedily over the sampler's
output (0 at the drawn token, -inf elsewhere), so each token is a sample of the distribution that the
temperature, top-k and top-p warpers define: the one PPO's log-probs are computed from.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class InverseCDFSampler(LogitsProcessor):
    """Draw one token per row from ``softmax(scores)`` by inverting its cumulative distribution.

    Returns scores that are 0 at the drawn token and -inf elsewhere, so a greedy step picks it. Tokens whose
    probability is 0 (filtered by top-k or top-p) are never drawn. Draws from torch's global generator, so
    ``torch.manual_seed`` makes them reproducible, or, given ``draws``, reads the uniform number of each row and
    step from it. Non-finite scores raise instead of sampling garbage.

    Args:
        draws: ``[B, max_new_tokens]`` uniform numbers in [0, 1): row b's token t is drawn with ``draws[b, t]``,
            so each row's tokens depend on nothing else in the batch; None = the global generator.
        prompt_length: columns of ``input_ids`` before the first generated token (to count the steps).
    """

    def __init__(self, draws: Tensor | None = None, prompt_length: int = 0) -> None:
        self.draws = draws
        self.prompt_length = prompt_length
        self.chosen_logprobs: list[Tensor] = []  # [B] per step: the log-probability of the drawn token

    def sampled_logprobs(self) -> Tensor:
        """``[B, steps]`` log-probabilities the drawn tokens had under the distribution they were drawn from (the
        sampler's own, kept to measure and correct a mismatch with the trainer's pass; float32)."""
        return torch.stack(self.chosen_logprobs, 1)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.draws is None:
            dtype = torch.float32 if scores.device.type == "mps" else torch.float64
            uniform = torch.rand((scores.shape[0], 1), device=scores.device, dtype=dtype)
        else:
            step = input_ids.shape[1] - self.prompt_length
            uniform = self.draws[:, step : step + 1]
        tokens, logprobs, finite = inverse_cdf_draw(scores, uniform)
        if not bool(finite.all()):
            raise nonfinite_scores_error(~finite, input_ids.shape[1])
        self.chosen_logprobs.append(logprobs)
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens[:, None], 0.0)


def inverse_cdf_draw(scores: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Draw one token per row of ``scores`` ``[B, V]`` from ``softmax(scores)`` with the uniform numbers ``uniform``
    ``[B, 1]`` in [0, 1): the first token whose cumulative probability exceeds ``uniform * total``.

    Returns ``(tokens [B], the drawn tokens' log-probabilities [B] (float32), finite [B])``; a row whose scores are
    NaN or all -inf is not finite and its token is meaningless (but a valid index). Pure tensor code without host
    synchronisation, so a compiled decode step can hold it.
    """
    # float64: the running sum over a large vocabulary keeps every token's share exact to ~1e-16 (Apple's MPS
    # has no float64; float32's error there is ~1e-7 per share).
    dtype = torch.float32 if scores.device.type == "mps" else torch.float64
    wide = scores.to(dtype)
    cdf = torch.softmax(wide, dim=-1)
    # The drawn token's log-prob without keeping a second [B, V] tensor: log p_t = s_t - log Z, and
    # log Z = s_top - log p_top, read at the most likely token (p_top >= 1/V) before the running sum below.
    top = wide.argmax(-1, keepdim=True)
    log_partition = wide.gather(-1, top) - cdf.gather(-1, top).log()
    cdf.cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    draws = uniform.to(device=cdf.device, dtype=dtype) * total
    # The second bound (the last token with a positive probability) only matters when rounding makes the draw
    # equal the total; the clamp keeps a non-finite row's index inside the vocabulary.
    tokens = torch.minimum(torch.searchsorted(cdf, draws, right=True), torch.searchsorted(cdf, total))
    tokens = tokens.clamp_(max=scores.shape[-1] - 1)
    logprobs = (wide.gather(-1, tokens) - log_partition).squeeze(-1).float()
    return tokens.squeeze(-1), logprobs, torch.isfinite(total.squeeze(-1))


# The draw as one opaque operator for compiled code: Inductor's own lowering of the softmax and running sum over a
# large vocabulary (a split scan) fails to generate its CUDA kernel (torch 2.11, an H200: GPT-2's 50,257 and
# Qwen2's 151,936 ids). Opaque, the draw runs ATen's kernels, inside the same CUDA graph, with eager's numbers.
inverse_cdf_draw_op = torch.library.custom_op("rlhf_lightning::inverse_cdf_draw", inverse_cdf_draw, mutates_args=())


@inverse_cdf_draw_op.register_fake
def _inverse_cdf_draw_shapes(scores: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows = scores.shape[0]
    return (scores.new_empty(rows, dtype=torch.long), scores.new_empty(rows, dtype=torch.float32),
            scores.new_empty(rows, dtype=torch.bool))


def nonfinite_scores_error(bad_rows: Tensor, tokens_so_far: int) -> FloatingPointError:
    """The error for next-token scores that cannot be sampled (``bad_rows``: ``[B]`` bool)."""
    return FloatingPointError(
        f"next-token scores of rows {bad_rows.nonzero().flatten().tolist()} (of {bad_rows.shape[0]}) are NaN or all "
        f"-inf after {tokens_so_far} tokens: the sampling model's weights or activations are not finite")


def sampling_warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList:
    """transformers' own temperature, top-k and top-p warpers, in the order ``do_sample=True`` applies them (those
    that are on)."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def sampling_processors(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, draws: Tensor | None = None,
                        prompt_length: int = 0) -> LogitsProcessorList:
    """Logits processors for ``generate(do_sample=False, logits_processor=...)`` that sample: the
    :func:`sampling_warpers`, then :class:`InverseCDFSampler` (with ``draws``, see there)."""
    processors = sampling_warpers(temperature, top_k, top_p)
    processors.append(InverseCDFSampler(draws, prompt_length))
    return processors


def row_draws(seeds: list[int], length: int, device: torch.device | str = "cpu") -> Tensor:
    """``[len(seeds), length]`` uniform numbers (float64), row b from a generator seeded with ``seeds[b]``: the
    ``draws`` of :class:`InverseCDFSampler` for rows that must sample alike wherever they are batched."""
    rows = [torch.rand(length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) for seed in seeds]
    return torch.stack(rows).to(device)
