"""Response lengths a real run has, the same on every side: which token of each response is its EOS.

``equal`` (the default, today's tables): the stop token is off on every side and every response is
``response_length`` tokens. The other modes turn the stop token on and plan, for rollout ``i`` of a process (its
``i``-th call to the sampler, warm-up included) and each of its rows in order, the position of the row's EOS from a
draw seeded by ``(seed, i)``; every side forces that EOS with the same logits processor
(:class:`ForcedStops`), so every side samples responses of exactly the same lengths, row by row:

- ``task``: the embedded arithmetic task's responses (its worked answers with EOS, as its GRPO run's policy writes
  them after SFT, 9 to 31 tokens of its ``sampling.max_new_tokens`` 48), as a fraction of 48, scaled to
  ``response_length``;
- ``long-tail``: a lognormal length with median ``response_length / 4`` and sigma 1 (mean about 0.41 x
  ``response_length``); about 8 % of the draws pass ``response_length``: those responses never stop and are cut
  there, as a real run's truncated ones.

A planned stop past ``response_length`` means the row never draws EOS (``response_length`` tokens, truncated).
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any

import torch

from .settings import Settings

LENGTHS = ("equal", "task", "long-tail")
TASK_MAX_NEW_TOKENS = 48  # configs/arithmetic_grpo.yaml: the task's responses are planned as a fraction of it
TASK_SAMPLES = 4096  # demonstrations whose lengths make the task's distribution
LONG_TAIL_SIGMA = 1.0


def eos_id(settings: Settings) -> int:
    """The benchmark tokenizer's EOS id (the last word; ``harness.fixtures.build_tokenizer``)."""
    return settings.vocab_words - 1


@functools.cache
def task_lengths() -> tuple[int, ...]:
    """Tokens of the arithmetic task's worked answers, EOS included (the SFT demonstrations a GRPO run starts
    from: the policy's responses have their lengths)."""
    from rlhf_lightning.tasks.arithmetic import ArithmeticTask

    return tuple(len(row["completion"].split()) + 1 for row in ArithmeticTask().sft_rows(TASK_SAMPLES))


def planned_stops(settings: Settings, rollout: int) -> list[int] | None:
    """The 1-based position of each row's EOS in rollout ``rollout`` (``settings.rollout_rows`` rows, in the
    sampler's order); a position past ``response_length`` = the row never stops. None under ``equal``."""
    if settings.lengths == "equal":
        return None
    rows, budget = settings.rollout_rows, settings.response_length
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + rollout)
    if settings.lengths == "task":
        lengths = task_lengths()
        picks = torch.randint(0, len(lengths), (rows,), generator=generator).tolist()
        return [max(1, round(lengths[pick] * budget / TASK_MAX_NEW_TOKENS)) for pick in picks]
    if settings.lengths == "long-tail":
        normal = torch.randn(rows, generator=generator, dtype=torch.float64)
        median = budget / 4
        return [max(1, min(budget + 1, math.ceil(median * math.exp(LONG_TAIL_SIGMA * z)))) for z in normal.tolist()]
    raise ValueError(f"unknown lengths {settings.lengths!r}; choose from {', '.join(LENGTHS)}")


def planned_lengths(settings: Settings, rollout: int) -> list[int]:
    """Tokens of each row of rollout ``rollout`` (its EOS included; ``response_length`` for a row that never
    stops, and for every row under ``equal``)."""
    stops = planned_stops(settings, rollout)
    if stops is None:
        return [settings.response_length] * settings.rollout_rows
    return [min(stop, settings.response_length) for stop in stops]


class ForcedStops:
    """A logits processor (transformers' ``(input_ids, scores) -> scores``, also as one of our decoder's warpers)
    that makes row ``r`` draw EOS exactly as its ``stops[r]``-th token: before it EOS cannot be drawn, at it only
    EOS can. One instance serves one sampling call; it counts its calls (one per drawn token), so it needs no
    ``input_ids`` (our decoder passes None)."""

    def __init__(self, stops: list[int], eos: int) -> None:
        self.stops = torch.tensor(stops)
        self.eos = eos
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # the 1-based position of the token drawn from these scores
        stops = self.stops.to(scores.device)
        if stops.shape[0] != scores.shape[0]:
            raise RuntimeError(f"forced stops planned for {stops.shape[0]} rows, the sampler drew {scores.shape[0]}")
        blocked = torch.full_like(scores, -math.inf)
        only_eos = blocked.index_fill(1, torch.tensor([self.eos], device=scores.device), 0.0)
        no_eos = scores.index_fill(1, torch.tensor([self.eos], device=scores.device), -math.inf)
        return torch.where((stops == self.calls)[:, None], only_eos,
                           torch.where((stops > self.calls)[:, None], no_eos, scores))


class StopPlan:
    """The forced stops of one process's rollouts, taken in order (:meth:`next_processor`), and the lengths each
    rollout realised (:meth:`record`), which a side reports."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rollouts = 0
        self.realised: list[list[int]] = []

    def next_processor(self) -> ForcedStops:
        """The processor of the next rollout (under ``equal`` none is made: the stop token is off)."""
        stops = planned_stops(self.settings, self.rollouts)
        if stops is None:
            raise RuntimeError("no stops are planned under --lengths equal")
        self.rollouts += 1
        return ForcedStops(stops, eos_id(self.settings))

    def record(self, responses: torch.Tensor) -> None:
        """Record the lengths of a rollout's ``[rows, R]`` sampled responses: up to and including the first EOS,
        all ``R`` columns where there is none."""
        eos = responses == eos_id(self.settings)
        width = responses.shape[1]
        lengths = torch.where(eos.any(-1), eos.int().argmax(-1) + 1, width)
        self.realised.append(lengths.tolist())


def force_stops_in_generate(model, plan: StopPlan) -> None:
    """Make transformers' ``model.generate`` (this instance's: a peft model's ``generate`` reaches it too) force the
    next rollout's stops of ``plan`` in each call, after every other logits processor, and record the lengths it
    sampled: how the TRL sides, which call ``generate`` themselves, get the same responses' lengths as ours."""
    from transformers import LogitsProcessorList

    original = model.generate

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any):
        given = kwargs.pop("logits_processor", None) or []
        output = original(*args, logits_processor=LogitsProcessorList([*given, plan.next_processor()]), **kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        plan.record(sequences[:, kwargs["input_ids"].shape[1]:])
        return output

    model.generate = generate


def lengths_summary(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per side that reported its responses' lengths: their mean and max over every rollout of its processes."""
    result = {}
    for side, entry in summary.items():
        if "lengths" in entry:
            flat = [length for rollout in entry["lengths"] for length in rollout]
            result[side] = {"mean": round(float(statistics.mean(flat)), 3), "max": max(flat)}
    return result


def same_lengths(summary: dict[str, dict[str, Any]], settings: Settings) -> bool | None:
    """Whether every side that reported lengths realised exactly the planned ones, rollout by rollout and row by
    row (None where no side reported any)."""
    reported = [entry["lengths"] for entry in summary.values() if "lengths" in entry]
    if not reported:
        return None
    planned = [planned_lengths(settings, rollout) for rollout in range(settings.warmup + settings.iterations)]
    return all(lengths == planned for lengths in reported)


def print_flops_caveat(settings: Settings) -> None:
    """Under ``--lengths`` other than ``equal``: the analytic FLOPs count every response at ``response_length``."""
    if settings.lengths != "equal":
        print(f"  (the analytic FLOPs count every response at --response-length {settings.response_length}: an "
              "upper bound of the work here, so the achieved fraction is too)")


def print_lengths(summary: dict[str, dict[str, Any]], settings: Settings) -> None:
    """One line per side: the realised mean and max response length, then whether they are the planned ones."""
    lengths = lengths_summary(summary)
    if not lengths:
        return
    print(f"\nresponse lengths (--lengths {settings.lengths}, tokens with EOS, every rollout):")
    for side, entry in lengths.items():
        print(f"  {side:<22} mean {entry['mean']:>7.2f} max {entry['max']:>4}")
    print(f"  the same planned lengths on every side, row by row: {same_lengths(summary, settings)}")
