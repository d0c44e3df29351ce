"""What a causal LM does to its LM head's output before it returns logits, found by asking the model itself.

Most models return ``lm_head(hidden)``, but some post-process it: Gemma-2/3 soft-cap the logits
(``cap * tanh(logits / cap)``), Cohere multiplies them by ``logit_scale``, Granite divides them by
``logits_scaling`` (HyperCLOVA X multiplies by a field of the same name). Log-probabilities computed from
``lm_head(hidden)`` alone would then differ from the distribution ``generate`` samples from, by tens of nats.

Rather than trusting field names, :func:`find_logit_transform` tries the transforms the config suggests on a short
probe sequence and keeps the one that reproduces the model's own forward pass; when none does, the caller must use
the model's full forward pass for logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

PROBE_LENGTH = 8


@dataclass(frozen=True)
class LogitTransform:
    """``logits -> softcap * tanh(scale * logits / softcap)`` (no cap when ``softcap`` is None)."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def is_linear(self) -> bool:
        """A pure scaling, which folds into the sampling temperature (the fused log-prob head handles it)."""
        return self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def candidate_transforms(config) -> list[LogitTransform]:
    """The transforms ``config``'s fields suggest, the most specific first and the identity last."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scales = []
    if isinstance(getattr(config, "logit_scale", None), (int, float)):
        scales.append(float(config.logit_scale))
    if isinstance(getattr(config, "logits_scaling", None), (int, float)) and config.logits_scaling:
        scales += [1.0 / float(config.logits_scaling), float(config.logits_scaling)]
    scales.append(1.0)
    softcap = getattr(config, "final_logit_softcapping", None)
    caps = [float(softcap), None] if isinstance(softcap, (int, float)) and softcap > 0 else [None]
    candidates = [LogitTransform(scale, cap) for cap in caps for scale in dict.fromkeys(scales)]
    return list(dict.fromkeys(candidates))


@torch.no_grad()
def find_logit_transform(model: nn.Module, hidden_states, full_logits=None) -> LogitTransform | None:
    """The transform that turns ``lm_head(hidden_states(ids, mask))`` into ``model(ids, mask).logits``, or None
    when no candidate reproduces the model's forward pass (then use the forward pass itself).

    ``hidden_states(input_ids, attention_mask)`` is the caller's decoder-only pass, ``full_logits(input_ids,
    attention_mask)`` its full forward pass (default: ``model(...).logits``).
    """
    was_training = model.training
    model.eval()
    try:
        vocab = model.get_input_embeddings().num_embeddings
        device = model.get_input_embeddings().weight.device
        # Ordinary tokens (past the first few ids, where special tokens usually sit), one sequence, no padding.
        input_ids = (torch.arange(PROBE_LENGTH, device=device) * 7 + min(10, vocab - 1)) % vocab
        input_ids, attention_mask = input_ids[None], torch.ones(1, PROBE_LENGTH, dtype=torch.long, device=device)
        expected = (full_logits(input_ids, attention_mask) if full_logits is not None
                    else model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits).float()
        raw = model.get_output_embeddings()(hidden_states(input_ids, attention_mask)).float()
    finally:
        model.train(was_training)
    precise = expected.dtype == torch.float32 and model.get_input_embeddings().weight.dtype == torch.float32
    tolerance = (1e-4 if precise else 2e-2) * max(1.0, float(expected.abs().max()))
    for transform in candidate_transforms(model.config):
        if float((transform(raw) - expected).abs().max()) <= tolerance:
            return transform
    log.warning("%s post-processes its logits in a way not recognised; log-probs will use the model's full "
                "forward pass (exact, but without the memory-saving fused head)", type(model).__name__)
    return None
