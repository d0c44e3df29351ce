"""How a judge's answer becomes a score: a number in a range, a label, or the probabilities of label tokens."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal

ParserName = Literal["number", "labels", "logprob"]
PARSERS = ("number", "labels", "logprob")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def check_parser(parser: str, low: float, high: float, labels: dict[str, float] | None) -> None:
    """One line for parser settings that cannot work."""
    if parser not in PARSERS:
        raise ValueError(f"JudgeReward parser: expected one of {', '.join(PARSERS)}, got {parser!r}")
    if parser == "number":
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ValueError(f"JudgeReward parser number: low ({low:g}) must be below high ({high:g}), both finite")
        return
    if not labels:
        raise ValueError(f"JudgeReward parser {parser}: labels is empty; give a label -> score map, e.g. "
                         "{yes: 1.0, no: 0.0}")
    bad = [label for label, score in labels.items() if not label.strip() or not math.isfinite(float(score))]
    if bad:
        raise ValueError(f"JudgeReward labels: label {bad[0]!r} -> {labels[bad[0]]!r}: expected a non-blank label "
                         "and a finite score")
    if parser == "logprob" and len(labels) < 2:
        raise ValueError(f"JudgeReward parser logprob: labels has {len(labels)} entry; the probabilities are "
                         "normalised over the labels, so give at least two")


def parse_number(answer: str, low: float, high: float) -> float | None:
    """The first number of ``answer`` mapped from ``[low, high]`` to ``[0, 1]``; None when there is none or it is
    outside the range."""
    found = NUMBER.search(answer)
    if found is None:
        return None
    value = float(found.group())
    if not low <= value <= high:
        return None
    return (value - low) / (high - low)


def parse_label(answer: str, labels: dict[str, float]) -> float | None:
    """The score of the label ``answer`` starts with, as a whole word (``no`` does not match ``not sure``; case and
    surrounding blanks ignored; the longest label wins when several match); None when it starts with none."""
    text = answer.strip().lower()
    for label in sorted(labels, key=len, reverse=True):
        if re.match(re.escape(label.strip().lower()) + r"(?!\w)", text):
            return float(labels[label])
    return None


def expected_score(probabilities: Sequence[float], scores: Sequence[float]) -> float | None:
    """The labels' scores averaged with their probabilities renormalised over the labels (P(yes) over yes/no
    for ``{yes: 1, no: 0}``); None when the labels have no probability at all."""
    total = sum(probabilities)
    if not total > 0:
        return None
    return sum(p * s for p, s in zip(probabilities, scores, strict=True)) / total


def lowest_score(parser: str, labels: dict[str, float] | None) -> float:
    """The lowest score the parser gives: 0 (the range's low) for ``number``, the smallest label score else."""
    return 0.0 if parser == "number" else min(float(score) for score in labels.values())
