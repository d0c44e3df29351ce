"""Reward sources that the reward server's tests serve (imported by the server process by their class path)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.sources import AdapterReward

NAN_MARKER = "score me as nan"


class NaNOnMarker(AdapterReward):
    """The reward adapter's scores, but NaN for a completion that is exactly :data:`NAN_MARKER` (a reward model
    failing numerically on one row; sampled responses never read so)."""

    def score(self, inputs: RewardInputs) -> Tensor:
        scores = super().score(inputs)
        marked = torch.tensor([completion == NAN_MARKER for completion in inputs.completions], device=scores.device)
        return torch.where(marked, math.nan, scores)
