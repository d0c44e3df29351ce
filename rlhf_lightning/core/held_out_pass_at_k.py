"""pass@k and maj@k on held-out prompts: the setting, and the values of ``n`` responses per prompt that the gold
reward (a verifier) has judged."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_lightning.algorithms.pass_at_k import maj_at_k, pass_at_k
from rlhf_lightning.utils import checks


@dataclass
class PassAtK:
    """pass@k and maj@k in validation, for tasks with a verifier as ``gold_reward`` (e.g. the arithmetic task's
    ``exact_match``): ``samples`` more responses to each held-out prompt, drawn from a stream of their own (the
    single response the other validation metrics read is unchanged), judged by the gold reward.

    Args:
        samples: responses per held-out prompt, ``n``; 1 = off.
        k: the ``k`` of pass@k and maj@k (each at most ``samples``); null = 1, the powers of 2 below ``samples``,
            and ``samples``.
        correct_at: a response is correct when its gold reward is at least this (the checkers give 1.0 to a right
            answer, 0.0 to a wrong one).
    """

    samples: int = 1
    k: list[int] | None = None
    correct_at: float = 1.0

    def check(self, name: str = "pass_at_k") -> PassAtK:
        """Raise a one-line error naming ``name.<field>`` for a value out of range."""
        checks.at_least(f"{name}.samples", self.samples)
        checks.finite(f"{name}.correct_at", self.correct_at)
        for k in self.k or []:
            if not 1 <= k <= self.samples:
                raise ValueError(f"{name}.k: {k} is outside 1..{self.samples} ({name}.samples, the responses per "
                                 "prompt that pass@k and maj@k are estimated from)")
        return self

    @property
    def enabled(self) -> bool:
        return self.samples > 1

    @property
    def ks(self) -> list[int]:
        """The ``k`` of pass@k and maj@k, in increasing order."""
        if self.k:
            return sorted(set(self.k))
        powers = [2 ** i for i in range(self.samples.bit_length()) if 2 ** i < self.samples]
        return [*powers, self.samples]

    def metric_names(self, with_majority: bool) -> list[str]:
        """``pass@k`` for every ``k``, and ``maj@k`` for every ``k > 1`` with an answer reader (maj@1 is pass@1)."""
        return [f"pass@{k}" for k in self.ks] + ([f"maj@{k}" for k in self.ks if k > 1] if with_majority else [])


def answer_reader(gold_reward: Callable[..., Any] | None) -> Callable[[str], Any] | None:
    """How to read a response's final answer for maj@k: the gold reward's ``answer_of`` attribute
    (``fn(response) -> hashable | None``), as the embedded tasks' checkers carry it; None without one."""
    return getattr(gold_reward, "answer_of", None)


def pass_at_k_values(setting: PassAtK, gold: Sequence[float], completions: Sequence[str],
                     answer_of: Callable[[str], Any] | None) -> dict[str, Tensor]:
    """Per held-out prompt ``[P]``: pass@k for every ``k`` of ``setting``, and maj@k when ``answer_of`` reads the
    answers; ``gold`` and ``completions`` hold ``setting.samples`` consecutive responses per prompt."""
    n = setting.samples
    scores = torch.tensor([float(g) for g in gold])
    correct = (scores >= setting.correct_at).view(-1, n)
    if not correct.any() and not bool(((scores == 0) | (scores == 1)).all()):
        # A real-valued score, not a checker's 0/1, that never reaches correct_at: every pass@k would read 0.
        warnings.warn(f"pass_at_k: no held-out response's gold reward reached pass_at_k.correct_at "
                      f"({setting.correct_at:g}), and the gold reward is not a checker's 0 or 1: pass@k counts "
                      "responses a verifier judges correct; set correct_at to the score that counts as correct, or "
                      "turn pass_at_k off (samples: 1)", UserWarning, stacklevel=2)
    values = {f"pass@{k}": pass_at_k(correct, k) for k in setting.ks}
    if answer_of is not None:
        answers = [answer_of(text) for text in completions]
        per_prompt = [answers[start:start + n] for start in range(0, len(answers), n)]
        values.update({f"maj@{k}": maj_at_k(per_prompt, correct, k) for k in setting.ks if k > 1})
    return values


# Saved in checkpoints with the module's hyper-parameters, which resume reads with torch.load(weights_only=True).
torch.serialization.add_safe_globals([PassAtK])
