"""Which passes one iteration of the on-policy loop runs: one plan, made once at setup from the settings.

An iteration may run, besides sampling and the reward sources: a policy pass without gradients for the rollout's
log-probs, a reference pass (adapters disabled), and the per-token KL between the two; or it may take the
rollout's log-probs from the update's first forward pass, made before the rewards with its gradients. Which of
these it runs depends on the update's shape (how many optimizer steps, and whether the first is one micro-batch of
the whole rollout) and on the KL (where it goes, whether it is charged or only measured).
:func:`plan_passes` decides it from :class:`PassSettings`, the one place that does; the loop reads the
:class:`PassPlan` it returns (``OnlineRL.pass_plan``).

The rollout's log-probs (``PassPlan.logprobs_pass``) come from:

- ``update``, the single optimizer step's own pass, detached, when nothing reads them before it;
- ``first_update_pass``, the first optimizer step's pass made before the rewards, when the update makes more steps
  or a KL is read before it, the first step is one micro-batch of the whole rollout and the loss takes that pass;
- ``rollout``, a pass of the rollout's own, when they are read before the update otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LogprobsPass = Literal["rollout", "first_update_pass", "update"]


@dataclass(frozen=True)
class PassSettings:
    """What decides an iteration's passes, read from a module's settings (``OnlineRL.pass_settings``)."""

    optimizer_steps: int
    """Optimizer steps per rollout before any target-KL stop (``epochs`` x ``num_minibatches``)."""

    whole_first_step: bool
    """The first optimizer step is one micro-batch of the whole rollout (``num_minibatches`` 1,
    ``gradient_accumulation`` 1, no ``micro_batch_tokens``)."""

    kl_in: Literal["reward", "loss"] | None = None
    """Where a KL penalty to the reference goes (``kl.added_to``): ``reward``, shaped into the rewards before the
    advantages, or ``loss``, a term of the loss; None for an algorithm without one (online DPO)."""

    kl_penalised: bool = False
    """A KL penalty is charged: ``kl.coef`` > 0 (an adaptive ``kl.target`` starts from one too)."""

    measure_kl: bool = False
    """The reference pass runs whatever the penalty, and the rollout's KL is measured: PPO logs ``objective/kl``
    and ``objective/kl_penalty`` at every ``kl.coef``, 0 included; online DPO's loss reads the reference."""

    reusable_first_pass: bool = False
    """The algorithm's loss can take its first optimizer step's policy pass made before the rewards
    (``PolicyGradient``'s can)."""


@dataclass(frozen=True)
class PassPlan:
    """Which passes every iteration of an on-policy module runs (:func:`plan_passes`)."""

    logprobs_pass: LogprobsPass
    """Which pass gives the rollout's log-probs under the policy at sampling time, and with them the statistics of
    the policy at sampling time (``policy/entropy``, ``objective/kl``): ``rollout``, a pass of its own without
    gradients after sampling; ``first_update_pass``, the first optimizer step's forward pass, made on the whole
    rollout before the rewards and kept with its graph for that step's backward (the policy has not moved before
    it: one policy pass per iteration fewer, the same numbers); ``update``, the single optimizer step's own pass,
    detached (nothing reads them before it)."""

    reference_logprobs: bool
    """Collection runs the reference pass (the base with adapters disabled)."""

    reward_kl: bool
    """Step 2 (shaping the rewards) computes the rollout's per-token KL to the reference (``ShapedRewards.kl``):
    the rewards charge it (``kl.added_to: reward`` with a coefficient), or the algorithm measures it before the update
    (PPO's ``objective/kl_penalty``)."""

    @property
    def rollout_logprobs(self) -> bool:
        """Collection runs a policy pass of its own for the rollout's log-probs."""
        return self.logprobs_pass == "rollout"

    @property
    def reuse_first_pass(self) -> bool:
        """The update's first forward pass, made before the rewards, gives the rollout's log-probs."""
        return self.logprobs_pass == "first_update_pass"

    @property
    def logprobs_before_update(self) -> bool:
        """The rollout's log-probs are known before the update (and so are the statistics of the policy at
        sampling time)."""
        return self.logprobs_pass != "update"


def plan_passes(settings: PassSettings) -> PassPlan:
    """The passes an iteration runs under ``settings``.

    The reference's log-probs are needed by a KL penalty or a measured KL. The rollout's log-probs are needed before
    the update when it makes more than one optimizer step (the later steps' old log-probs: the policy has moved),
    or when the KL is read outside the loss (in the rewards, or measured by an algorithm without a KL term in its
    loss); the first update pass gives them when that step is one micro-batch of the whole rollout and the loss
    takes it. Otherwise the single step's own pass gives them, detached.
    """
    s = settings
    reference = s.measure_kl or (s.kl_in is not None and s.kl_penalised)
    before_update = s.optimizer_steps > 1 or (reference and s.kl_in != "loss")
    if not before_update:
        logprobs_pass: LogprobsPass = "update"
    elif s.whole_first_step and s.reusable_first_pass:
        logprobs_pass = "first_update_pass"
    else:
        logprobs_pass = "rollout"
    charged = s.kl_in == "reward" and s.kl_penalised
    reward_kl = before_update and s.kl_in is not None and (charged or s.measure_kl)
    return PassPlan(logprobs_pass, reference, reward_kl)
