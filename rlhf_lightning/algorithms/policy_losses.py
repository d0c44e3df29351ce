"""Policy losses: a registry of per-token losses, each with its arguments as one typed group.

A loss maps one :class:`PolicyLossInput` (the policy's log-probs now, at the update's start (proximal), at sampling
(behaviour) and the reference's; the advantages, the mask, the rollout correction's weights), all ``[B, T]``, to
``(per-token loss [B, T], statistics)``; the statistics are scalars (means over ``mask``), logged as
``<prefix>/policy/<name>``. Which log-probs its ratio is taken against is the loss's option (``clip_against``): the
proximal ones with the correction's weights is AReaL's decoupled objective for stale rollouts. What every loss
shares is applied around it once, by the loop (:class:`~rlhf_lightning.core.policy_gradient.PolicyGradient`): the
KL term, the entropy bonus and the aggregation over the optimizer step.

A loss is a subclass of :class:`PolicyLoss`: its constructor's arguments are its group in the config (documented
in its docstring, shown by ``--help``); it defines :meth:`~PolicyLoss.surrogate`, a pure function of the log-probs,
the anchor's, the advantages and the mask (the base applies the anchor and the correction), or ``__call__`` to read
the whole input. Defining the class registers it; a config names it by class name or import path::

    policy_loss: CISPO                                # a registered loss with its defaults
    policy_loss:                                      # one with arguments; import path for one of your own
      class_path: my_losses.SAPO
      init_args: {temperature_positive: 1.0}
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, get_args

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

Anchor = Literal["proximal", "sampler"]
ANCHORS: tuple[str, ...] = get_args(Anchor)


@dataclass(frozen=True)
class PolicyLossInput:
    """What a policy loss sees of one micro-batch, every tensor ``[B, T]`` over the response tokens.

    ``logprobs`` carry the gradient; the others are detached. ``proximal`` and ``behaviour`` are the same tensor
    when the trainer samples with its own pass and the policy has not moved since (one optimizer step per rollout).
    """

    logprobs: Tensor  # the policy's now (with gradients)
    proximal: Tensor  # the trainer's at the start of the update
    behaviour: Tensor  # the sampler's: those the tokens were drawn with (another engine, a stale policy)
    advantages: Tensor  # a sequence advantage broadcast over its tokens, or per-token ones (GAE)
    mask: Tensor  # the response tokens
    reference: Tensor | None = None  # the reference policy's, when the run computes them
    correction: Tensor | None = None  # the rollout correction's weight of each token's loss; None = off (1)

    def anchor(self, against: Anchor) -> Tensor:
        """The ratio's denominator: the ``proximal`` log-probs or the ``sampler``'s (behaviour)."""
        return self.proximal if against == "proximal" else self.behaviour


class LossOutput(NamedTuple):
    """A policy loss's per-token loss ``[B, T]`` (differentiable, 0 at padding) and its statistics (scalars)."""

    per_token: Tensor
    statistics: dict[str, Tensor]


class PolicyLoss(Registered):
    """Base of the policy losses. Subclass it, take the loss's arguments in ``__init__`` (checked there, one line
    each) and define :meth:`surrogate` (or ``__call__`` of the whole :class:`PolicyLossInput`); set
    ``ratio_level`` to the importance ratio the loss uses and ``clip_against`` to its anchor (the KL term's
    importance weighting and ``policy/approx_kl`` follow both). Defining the class registers it (a name we ship is
    refused)."""

    ratio_level: RatioLevel = "token"
    clip_against: Anchor = "proximal"
    # class name -> class, every loss defined so far: for listings and messages (the command line resolves names
    # and import paths itself)
    registry: ClassVar[dict[str, type[PolicyLoss]]] = {}
    family = "policy loss"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        call = vars(cls).get("__call__")
        if call is not None and len(inspect.signature(call).parameters) > 2:
            raise TypeError(f"{cls.__module__}.{cls.__name__}.__call__ takes the loss's tensors one by one: a policy "
                            "loss now receives one PolicyLossInput; rename the method to surrogate(self, logprobs, "
                            "old_logprobs, advantages, mask) (the base applies clip_against and the rollout "
                            "correction) or take the input whole: __call__(self, inputs)")
        super().__init_subclass__(**kwargs)

    def __call__(self, inputs: PolicyLossInput) -> LossOutput:
        """``(per-token loss, statistics)``: the :meth:`surrogate` against the log-probs ``clip_against`` names,
        each token's loss times the rollout correction's weight."""
        per_token, statistics = self.surrogate(inputs.logprobs, inputs.anchor(self.clip_against),
                                               inputs.advantages, inputs.mask)
        if inputs.correction is not None:
            per_token = per_token * inputs.correction
        return LossOutput(per_token, statistics)

    def surrogate(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        """``(per-token loss, statistics)`` of the policy's ``logprobs`` against ``old_logprobs`` (the anchor's)
        with ``advantages``, on ``mask``."""
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
        clip_against: the ratio's denominator: ``proximal``, the trainer's log-probs at the start of the update
            (with the ``correction`` group this is AReaL's decoupled objective for stale rollouts:
            ``asynchronous.max_staleness``), or ``sampler``, the engine's (naive PPO-clip against the behaviour policy).
    """

    def __init__(self, clip_range: float = 0.2, clip_range_high: float | None = None,
                 ratio_level: RatioLevel = "token", clip_against: Anchor = "proximal") -> None:
        checks.non_negative("policy_loss.clip_range", clip_range)
        checks.non_negative("policy_loss.clip_range_high", clip_range_high, optional=True)
        checks.one_of("policy_loss.ratio_level", ratio_level, ("token", "sequence", "sequence_sum"))
        checks.one_of("policy_loss.clip_against", clip_against, ANCHORS)
        if clip_range_high is not None and clip_range_high < clip_range:
            raise ValueError(f"policy_loss: clip_range_high={clip_range_high} is below clip_range={clip_range}: the upper "
                             "bound of the clip would be tighter than the lower one; clip-higher (DAPO) raises it, "
                             "e.g. clip_range 0.2 with clip_range_high 0.28 (null = the same as clip_range)")
        self.clip_range = clip_range
        self.clip_range_high = clip_range_high
        self.ratio_level = ratio_level
        self.clip_against = clip_against

    def surrogate(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
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
        clip_against: the weight's denominator, ``proximal`` or ``sampler``, as :class:`Clip`'s.
    """

    def __init__(self, max_weight: float = 5.0, min_weight: float | None = None,
                 ratio_level: RatioLevel = "token", clip_against: Anchor = "proximal") -> None:
        checks.positive("policy_loss.max_weight", max_weight)
        checks.non_negative("policy_loss.min_weight", min_weight, optional=True)
        checks.one_of("policy_loss.ratio_level", ratio_level, ("token", "sequence", "sequence_sum"))
        checks.one_of("policy_loss.clip_against", clip_against, ANCHORS)
        if min_weight is not None and min_weight >= max_weight:
            raise ValueError(f"policy_loss: min_weight={min_weight} must be below max_weight={max_weight}")
        self.max_weight = max_weight
        self.min_weight = min_weight
        self.ratio_level = ratio_level
        self.clip_against = clip_against

    def surrogate(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> LossOutput:
        surrogate = cispo_surrogate(logprobs, old_logprobs, advantages, mask, self.max_weight, self.min_weight,
                                    self.ratio_level)
        return LossOutput(surrogate.loss, clip_statistics(surrogate, mask))
