"""Policy losses: a registry of pure per-token losses, each with its arguments as one typed group.

A loss maps ``(log-probs, old log-probs, advantages, mask)``, all ``[B, T]``, to ``(per-token loss [B, T],
statistics)``; the statistics are scalars (means over ``mask``), logged as ``<prefix>/policy/<name>``. What every
loss shares is applied around it once, by the loop (:class:`~rlhf_lightning.core.policy_gradient.PolicyGradient`):
the importance-sampling correction of the sampler's log-probs, the KL term, the entropy bonus and the aggregation
over the optimizer step.

A loss is a subclass of :class:`PolicyLoss`: its constructor's arguments are its group in the config (documented
in its docstring, shown by ``--help``), ``__call__`` its pure function. Defining the class registers it; a config
names it by class name or import path::

    policy_loss: CISPO                                # a registered loss with its defaults
    policy_loss:                                      # one with arguments; import path for one of your own
      class_path: my_losses.SAPO
      init_args: {temperature_positive: 1.0}
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from torch import Tensor

from rlhf_lightning.algorithms.masked import masked_mean
from rlhf_lightning.algorithms.registered import Registered
from rlhf_lightning.algorithms.surrogate import (
    RatioLevel,
    SurrogateOutput,
    cispo_surrogate,
    clipped_surrogate,
)
from rlhf_lightning.utils import checks


class LossOutput(NamedTuple):
    """A policy loss's per-token loss ``[B, T]`` (differentiable, 0 at padding) and its statistics (scalars)."""

    per_token: Tensor
    statistics: dict[str, Tensor]


class PolicyLoss(Registered):
    """Base of the policy losses. Subclass it, take the loss's arguments in ``__init__`` (checked there, one line
    each) and define ``__call__``; set ``ratio_level`` to the importance ratio the loss uses (the KL term's
    importance weighting follows it). Defining the class registers it (a name we ship is refused)."""

    ratio_level: RatioLevel = "token"
    # class name -> class, every loss defined so far: for listings and messages (the command line resolves names
    # and import paths itself)
    registry: ClassVar[dict[str, type[PolicyLoss]]] = {}
    family = "policy loss"

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        """``(per-token loss, statistics)`` of the policy's ``logprobs`` against the sampling policy's
        ``old_logprobs`` with ``advantages`` (a sequence advantage broadcast over its tokens), on ``mask``."""
        raise NotImplementedError


def clip_statistics(surrogate: SurrogateOutput, mask: Tensor) -> dict[str, Tensor]:
    """How often the clip was active (below, above, either) and the mean importance ratio, over ``mask``."""
    return {
        "clipfrac": masked_mean((surrogate.clipped_low | surrogate.clipped_high).float(), mask),
        "clipfrac_low": masked_mean(surrogate.clipped_low.float(), mask),
        "clipfrac_high": masked_mean(surrogate.clipped_high.float(), mask),
        "ratio": masked_mean(surrogate.ratio, mask),
    }


class Clip(PolicyLoss):
    """PPO's clipped surrogate (Schulman et al. 2017): -min(rho A, clip(rho, 1 - clip_range, 1 + clip_range_high) A).

    Args:
        clip_range: epsilon of the clip below 1 (and above, unless ``clip_range_high``).
        clip_range_high: epsilon above 1 (DAPO's clip-higher, e.g. 0.28); null = ``clip_range``.
        ratio_level: ``token`` ratios (PPO, GRPO); one ``sequence`` ratio per response, the geometric mean of its
            token ratios (GSPO); or ``sequence_sum``, the product of its token ratios (TRL's RLOO).
    """

    def __init__(self, clip_range: float = 0.2, clip_range_high: float | None = None,
                 ratio_level: RatioLevel = "token") -> None:
        checks.non_negative("policy_loss.clip_range", clip_range)
        checks.non_negative("policy_loss.clip_range_high", clip_range_high, optional=True)
        checks.one_of("policy_loss.ratio_level", ratio_level, ("token", "sequence", "sequence_sum"))
        if clip_range_high is not None and clip_range_high < clip_range:
            raise ValueError(f"policy_loss: clip_range_high={clip_range_high} is below clip_range={clip_range}: the upper "
                             "bound of the clip would be tighter than the lower one; clip-higher (DAPO) raises it, "
                             "e.g. clip_range 0.2 with clip_range_high 0.28 (null = the same as clip_range)")
        self.clip_range = clip_range
        self.clip_range_high = clip_range_high
        self.ratio_level = ratio_level

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        surrogate = clipped_surrogate(logprobs, old_logprobs, advantages, mask, self.clip_range, high,
                                      self.ratio_level)
        return LossOutput(surrogate.loss, clip_statistics(surrogate, mask))


class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1, Chen et al. 2025; TRL's ``loss_type: cispo``): the clipped, detached importance weight
    times the log-prob, -sg(clip(rho, min_weight, max_weight)) A log pi, so every token keeps its gradient.

    Args:
        max_weight: cap on the importance weight (TRL's ``epsilon_high`` under ``cispo``, 5.0 as ScaleRL
            recommends).
        min_weight: floor on the importance weight; null = none (TRL's).
        ratio_level: ``token``, ``sequence`` or ``sequence_sum`` weights, as :class:`Clip`'s ``ratio_level``.
    """

    def __init__(self, max_weight: float = 5.0, min_weight: float | None = None,
                 ratio_level: RatioLevel = "token") -> None:
        checks.positive("policy_loss.max_weight", max_weight)
        checks.non_negative("policy_loss.min_weight", min_weight, optional=True)
        checks.one_of("policy_loss.ratio_level", ratio_level, ("token", "sequence", "sequence_sum"))
        if min_weight is not None and min_weight >= max_weight:
            raise ValueError(f"policy_loss: min_weight={min_weight} must be below max_weight={max_weight}")
        self.max_weight = max_weight
        self.min_weight = min_weight
        self.ratio_level = ratio_level

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        surrogate = cispo_surrogate(logprobs, old_logprobs, advantages, mask, self.max_weight, self.min_weight,
                                    self.ratio_level)
        return LossOutput(surrogate.loss, clip_statistics(surrogate, mask))
