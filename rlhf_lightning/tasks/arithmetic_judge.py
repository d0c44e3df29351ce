"""The arithmetic task's judge data: a worked answer and the true sum in, a verdict token out.

A judge adapter trained on these rows (``configs/arithmetic_judge_sft.yaml``) reads a problem, a response and the
reference sum (the ``reference`` column: its digits, one token each) through :data:`JUDGE_TEMPLATE` and answers
``1`` when the response's final answer is the sum, ``0`` otherwise: the exact checker's verdict, learnt. Every
word is in the arithmetic tokenizer's fixed vocabulary (a word outside it would be ``<unk>``), so the verdicts are
the digit tokens ``1`` and ``0``::

    prompt:     add 4 7 + 3 8 7 + 8 = 1 5 , 4 + 3 + 1 = 8 , answer 8 5 , answer 8 5 =
    completion: 1

The responses are those a fine-tuned policy writes: half correct, half with a slip (the wrong answers the checker
refuses), and some cut short before their answer (refused too), as a response that runs out of tokens is. In
:data:`EASY_NEGATIVES` of the rows the final answer is then replaced by a random number of the sum's length (an
"easy negative": usually far from the sum): with the policy's near-miss slips alone, a judge this small learned
nothing in 1000 steps; with them, it learns to compare the answer with the reference (docs/judges.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlhf_lightning.tasks.arithmetic import (
    ArithmeticTask,
    build_tokenizer,
    digits,
    final_answer,
    prompt_text,
    worked_answer,
)

# The template of the judge rows and of JudgeReward in configs/arithmetic_grpo_judge.yaml (the same string).
JUDGE_TEMPLATE = "{prompt} {response} , answer {reference} ="
VERDICTS = {"1": 1.0, "0": 0.0}
CUT_SHORT = 0.1  # share of responses cut before their answer
EASY_NEGATIVES = 0.4  # share of rows whose final answer is replaced by a random number of the sum's length

__all__ = ["EASY_NEGATIVES", "JUDGE_TEMPLATE", "VERDICTS", "ArithmeticJudgeTask", "build_tokenizer"]


@dataclass(frozen=True)
class ArithmeticJudgeTask(ArithmeticTask):
    """The arithmetic task whose supervised rows teach a judge (see the module docstring); its prompts are the
    arithmetic task's, with the sum's digits in a ``reference`` column beside ``answer`` (what the judge reads)."""

    def prompt_rows(self, n: int) -> list[dict]:
        """The arithmetic task's ``n`` problems, each with a ``reference`` column: ``"8 5"`` for 85."""
        return [{**row, "reference": digits(row["answer"])} for row in super().prompt_rows(n)]

    def sft_rows(self, n: int) -> list[dict]:
        """``n`` judge rows: the rendered :data:`JUDGE_TEMPLATE` as prompt, the checker's verdict as completion."""
        rng = random.Random(f"arithmetic_judge:{self.seed}:sft")
        rows = []
        for _ in range(n):
            a, b = self._numbers(rng)
            response, _ = worked_answer(a, b, self._slip(a, b, rng) if rng.random() < 0.5 else None)
            if rng.random() < CUT_SHORT:
                words = response.split()
                response = " ".join(words[:rng.randrange(1, len(words) - 1)])
            if rng.random() < EASY_NEGATIVES and "answer" in response:
                width = len(str(a + b))
                guess = rng.randrange(10 ** (width - 1) if width > 1 else 0, 10 ** width)
                response = response.rsplit("answer", 1)[0] + "answer " + digits(guess)
            verdict = "1" if final_answer(response) == a + b else "0"
            prompt = JUDGE_TEMPLATE.format(prompt=prompt_text(a, b), response=response, reference=digits(a + b))
            rows.append({"prompt": prompt, "completion": " " + verdict})
        return rows
