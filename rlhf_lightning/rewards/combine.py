"""How the scores of a run's reward sources combine into one score per response."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_lightning.models.shared_base import SharedBase
from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.sources import RewardSource
from rlhf_lightning.utils import checks


@dataclass(frozen=True)
class RewardShaping:
    """The ``reward_shaping`` argument: how the scores of the reward sources become the score a response trains on.
    A config sets some fields and keeps the others' defaults (``reward_shaping: {missing_eos_penalty: 1.0}``).

    Args:
        weights: weight of each reward source (``reward`` a list), their scores summed with them; null = 1 each.
        normalize: standardise each reward model's scores with its validation mean and std (saved by the reward
            stage) before they are summed.
        missing_eos_penalty: subtracted from the score of a response that never emits the stop token; null = off.
        clip: clip scores to [-clip, clip]; null = off.
    """

    weights: list[float] | None = None
    normalize: bool = False
    missing_eos_penalty: float | None = None
    clip: float | None = None

    def check(self, name: str = "reward_shaping") -> RewardShaping:
        """Raise a one-line error naming ``name.field`` for a value out of range."""
        checks.non_negative(f"{name}.missing_eos_penalty", self.missing_eos_penalty, optional=True)
        checks.positive(f"{name}.clip", self.clip, optional=True)
        for index, weight in enumerate(self.weights or []):
            checks.finite(f"{name}.weights[{index}]", weight)
        return self


class RewardSet:
    """The reward sources of a run and how their scores combine: each source scores separately (``[B, S]``, NaN
    where a source does not apply); :meth:`response_scores` normalises them with each source's saved statistics,
    sums them with weights, penalises responses that never stop and clips.

    Args:
        sources: the reward sources.
        shaping: their weights, normalisation, missing-EOS penalty and clip (:class:`RewardShaping`).
    """

    def __init__(self, sources: Sequence[RewardSource],
                 shaping: RewardShaping = RewardShaping()) -> None:  # noqa: B008 (frozen, never mutated)
        if not sources:
            raise ValueError("reward: no reward source given (an empty list); give at least one, e.g. "
                             "{class_path: rlhf_lightning.AdapterReward, init_args: {path: ...}}")
        self.sources = list(sources)
        self.shaping = shaping
        self.weights = [1.0] * len(self.sources) if shaping.weights is None else [float(w) for w in shaping.weights]
        if len(self.weights) != len(self.sources):
            raise ValueError(f"reward_shaping.weights has {len(self.weights)} entries for {len(self.sources)} reward "
                             "sources")

    @property
    def names(self) -> list[str]:
        return [source.name for source in self.sources]

    def setup(self, base: SharedBase, tokenizer: PreTrainedTokenizerBase) -> None:
        """Set every source up; with ``normalize``, check that each one knows its mean and std."""
        for source in self.sources:
            source.setup(base, tokenizer)
        lacking = [source.name for source in self.sources if source.statistics is None]
        if self.shaping.normalize and lacking:
            raise ValueError(f"reward_shaping.normalize needs each reward source's mean/std (reward_stats.json), which "
                             f"{lacking} lack")

    def score(self, inputs: RewardInputs) -> Tensor:
        """Scores ``[B, S]`` of every source (NaN where a source does not apply); a source that scores steps gives
        their reduction."""
        return self.score_steps(inputs)[0]

    def score_steps(self, inputs: RewardInputs) -> tuple[Tensor, Tensor | None]:
        """``(scores [B, S], step rewards [B, R] or None)``: :meth:`score`'s, and the weighted sum of the step scores
        of the sources that score steps (``scores_steps``), each at its step's last response token (None without
        such a source). Each source runs once."""
        # A source of one's own may score on another device (a CPU verifier, an API): scores join the rollout's.
        device = inputs.input_ids.device
        columns, steps = [], None
        for source, weight in zip(self.sources, self.weights, strict=True):
            if source.scores_steps:
                step_scores, ends = (t.to(device) for t in source.step_scores(inputs))
                columns.append(source.reduce(step_scores, ends).float())
                steps = weight * step_scores if steps is None else steps + weight * step_scores
            else:
                columns.append(source.score(inputs).float().to(device))
        return torch.stack(columns, -1), steps

    def normalize(self, scores: Tensor) -> Tensor:
        """``[B, S]`` scores standardised with each source's validation mean and std."""
        mean = scores.new_tensor([source.statistics[0] for source in self.sources])
        std = scores.new_tensor([max(source.statistics[1], 1e-8) for source in self.sources])
        return (scores - mean) / std

    def combine(self, scores: Tensor, without_steps: bool = False) -> Tensor:
        """The weighted sum ``[B]`` of the sources' scores ``[B, S]``, NaN ("not applicable") counting as absent;
        ``without_steps`` leaves out the sources that score steps (their scores are trained on as step rewards).

        A row that no source applies to is an error naming the row: training on it would be training on nothing.
        """
        applicable = ~torch.isnan(scores)
        none = ~applicable.any(-1)
        if none.any():
            raise ValueError(f"no reward source applies to rows {none.nonzero().flatten().tolist()} "
                             f"(every one of {self.names} returned None)")
        weights = scores.new_tensor([0.0 if without_steps and source.scores_steps else weight
                                     for source, weight in zip(self.sources, self.weights, strict=True)])
        return torch.where(applicable, scores * weights, 0.0).sum(-1)

    def response_scores(self, scores: Tensor, is_stopped: Tensor, without_steps: bool = False) -> Tensor:
        """The score ``[B]`` each response is trained on, from the sources' ``[B, S]``: normalised (``normalize``),
        weighted and summed (without the step-scoring sources' with ``without_steps``), less
        ``missing_eos_penalty`` where the response never stopped (``is_stopped`` ``[B]``), clipped."""
        shaping = self.shaping
        combined = self.combine(self.normalize(scores) if shaping.normalize else scores, without_steps)
        if shaping.missing_eos_penalty is not None:
            combined = combined - shaping.missing_eos_penalty * (~is_stopped).float()
        if shaping.clip is not None:
            combined = combined.clamp(-shaping.clip, shaping.clip)
        return combined

    def response_values(self) -> dict[str, Tensor]:
        """Every source's values per response of its latest score (an ensemble's ``reward_disagreement``)."""
        return {key: value for source in self.sources for key, value in source.response_values().items()}

    @torch.no_grad()
    def statistics(self, scores: Tensor) -> dict[str, Tensor]:
        """Mean and std of each source's scores over the responses it applies to: ``score/<name>[_std]``."""
        stats = {}
        for column, name in zip(scores.unbind(-1), self.names, strict=True):
            applicable = column[~column.isnan()]
            stats[f"score/{name}"] = applicable.mean() if applicable.numel() else column.new_zeros(())
            stats[f"score/{name}_std"] = applicable.std() if applicable.numel() > 1 else column.new_zeros(())
        return stats


