"""Reward sources that the reward server's tests serve (imported by the server process by their class path)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.sources import AdapterReward

NAN_MARKER = "score me as nan"
CRASH_MARKER = "crash the server"
SECRET_PATH = "/srv/secret/reward-model"  # what a crash's message holds, and an answer must not


class NaNOnMarker(AdapterReward):
    """The reward adapter's scores, but NaN for a completion that is exactly :data:`NAN_MARKER` (a reward model
    failing numerically on one row; sampled responses never read so), and a crash of the server itself for
    :data:`CRASH_MARKER`."""

    def score(self, inputs: RewardInputs) -> Tensor:
        if CRASH_MARKER in inputs.completions:  # a bug of the server's own, with internals in its message
            raise RuntimeError(f"cannot read {SECRET_PATH}/weights.bin")
        scores = super().score(inputs)
        marked = torch.tensor([completion == NAN_MARKER for completion in inputs.completions], device=scores.device)
        return torch.where(marked, math.nan, scores)
