"""The ``loss`` group of the policy-gradient modules: how the registered policy loss's per-token terms become one
loss over the optimizer step, and what is added to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from rlhf_lightning.algorithms.surrogate import LossAggregation
from rlhf_lightning.utils import checks


@dataclass(frozen=True)
class LossSettings:
    """The ``loss`` argument of the policy-gradient modules (PPO, GRPO, RLOO, REINFORCE++, on-policy distillation):
    a config sets some fields and keeps the defaults for the others (``loss: {aggregation: constant}``).

    Args:
        aggregation: ``token_mean`` over every token of the optimizer step (DAPO, verl, OpenRLHF, TRL's GRPO
            default); ``sequence_mean`` of per-response token means (the original GRPO); ``constant``: token sum
            divided by responses x ``sampling.max_new_tokens`` (Dr. GRPO).
        mask_truncated_completions: responses that never stop carry no loss (DAPO): a cut-off answer is no
            evidence for or against its tokens. Needs a ``sampling.stop_token``.
        ent_coef: weight of the entropy bonus (``- ent_coef x`` the entropy, per token).
        ptx_coef: weight of the pretraining loss (PPO-ptx) on the data module's ``ptx`` batches; 0 = off.
    """

    aggregation: LossAggregation = "token_mean"
    mask_truncated_completions: bool = False
    ent_coef: float = 0.0
    ptx_coef: float = 0.0

    def check(self, name: str = "loss") -> LossSettings:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        checks.one_of(f"{name}.aggregation", self.aggregation, get_args(LossAggregation))
        checks.non_negative(f"{name}.ent_coef", self.ent_coef)
        checks.non_negative(f"{name}.ptx_coef", self.ptx_coef)
        return self
