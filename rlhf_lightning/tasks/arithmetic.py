"""An embedded verifiable-reward task: adding two numbers with a worked, digit-by-digit answer.

Rewards here are checked, not learned (GRPO's home ground, DeepSeekMath): the reward function is an exact checker
of the final answer. Everything is built from a seed, offline, with a tokenizer the task builds (one token per
digit, so a small model can learn the carries)::

    prompt:   add 4 7 + 3 8
    response: 7 + 8 = 1 5 , 4 + 3 + 1 = 8 , answer 8 5

The response works from the last digit to the first: each step adds two digits and the carry, writes their sum,
and carries its tens; ``answer`` then gives the sum's digits. The supervised demonstrations have a realistic error
rate: in ``error_rate`` of them one step's sum is off by one or two, and the steps after it and the answer follow
from the slip, as a careless student's would. A model fine-tuned on them makes such slips too; a reward that checks
the answer can teach it to stop.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_lightning.tasks.checking import check_sums, reads_answer_column
from rlhf_lightning.tasks.synthetic_grammar import CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, UNK

DIGITS = tuple(str(d) for d in range(10))
WORDS = ("add", "+", "=", ",", "answer")
VOCABULARY = SPECIAL_TOKENS + DIGITS + WORDS
_PROMPT = re.compile(r"^\s*add ((?:\d )+)\+ ((?:\d ?)+)\s*$")


def digits(number: int) -> str:
    """``47 -> "4 7"``: one token per digit."""
    return " ".join(str(number))


def prompt_text(a: int, b: int) -> str:
    return f"add {digits(a)} + {digits(b)}"


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    """The two numbers of a prompt written by :func:`prompt_text`, or None."""
    match = _PROMPT.match(prompt)
    if match is None:
        return None
    return int(match.group(1).replace(" ", "")), int(match.group(2).replace(" ", ""))


def worked_answer(a: int, b: int, slip: tuple[int, int] | None = None) -> tuple[str, int]:
    """The worked response for ``a + b`` and the answer it arrives at.

    ``slip = (step, delta)`` adds ``delta`` to the sum written at step ``step`` (0 = the last digit); the carry and
    the answer follow from the wrong sum.
    """
    left, right = str(a)[::-1], str(b)[::-1]
    steps, answer_digits, carry = [], [], 0
    for i in range(max(len(left), len(right))):
        x = int(left[i]) if i < len(left) else 0
        y = int(right[i]) if i < len(right) else 0
        total = x + y + carry
        if slip is not None and slip[0] == i:
            total = min(max(total + slip[1], 0), 19)
        terms = f"{x} + {y}" + (" + 1" if carry else "")
        steps.append(f"{terms} = {digits(total)}")
        answer_digits.append(total % 10)
        carry = total // 10
    if carry:
        answer_digits.append(carry)
    answer = int("".join(str(d) for d in reversed(answer_digits)))
    return " , ".join(steps) + f" , answer {digits(answer)}", answer


STEP_SEPARATOR = ","  # the worked responses' steps are joined by " , "


def split_steps(response: str) -> list[str]:
    """The steps of a worked response: its column sums and its ``answer``, split at the separator."""
    return [step.strip() for step in response.split(STEP_SEPARATOR)]


def step_labels(a: int, b: int, steps: Sequence[str]) -> list[bool]:
    """Whether each step of a worked answer to ``a + b`` is right, by Math-Shepherd's rule (Wang et al. 2024): a
    step is good when the right answer can still be reached from it. Every digit a step writes is a digit of the
    answer, so one wrong step makes the answer wrong: a step is good when it and every step before it are the right
    steps, and every step from the first slip on is bad (PRM800K, Lightman et al. 2023, labels no step after the
    first bad one; the prefix rule gives those steps the label its rollouts would: bad)."""
    right = split_steps(worked_answer(a, b)[0])
    labels, good = [], True
    for index, step in enumerate(steps):
        good = good and index < len(right) and step.strip() == right[index]
        labels.append(good)
    return labels


def final_answer(completion: str) -> int | None:
    """The number after the last ``answer`` of a completion, or None when there is none."""
    words = completion.split()
    if "answer" not in words:
        return None
    tail = words[len(words) - 1 - words[::-1].index("answer") + 1:]
    number = "".join(tail)
    return int(number) if number.isdigit() else None


@reads_answer_column
def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[int] | None = None,
                **_: object) -> list[float]:
    """The checker, with TRL's reward-function signature: 1.0 when a completion's final answer equals the sum,
    else 0.0. ``answer`` is the dataset's column of true sums; without it the sum is read from the prompt."""
    return check_sums("exact_match", prompts, completions, answer, parse_prompt, final_answer, "add A + B")


exact_match.answer_of = final_answer  # maj@k in validation votes on the answers it reads (PassAtK)


@dataclass(frozen=True)
class ArithmeticTask:
    """The task's data, deterministic from ``seed``.

    Args:
        seed: seed of every row generated.
        max_digits: the numbers have 1 to ``max_digits`` digits.
        error_rate: share of the supervised demonstrations (and of the rejected responses of preference pairs)
            with one slip in a step.
    """

    seed: int = 0
    max_digits: int = 3
    error_rate: float = 0.3

    def _rng(self, stream: str) -> random.Random:
        return random.Random(f"arithmetic:{self.seed}:{stream}")

    def _numbers(self, rng: random.Random) -> tuple[int, int]:
        def number() -> int:
            length = rng.randint(1, self.max_digits)
            return rng.randint(10 ** (length - 1) if length > 1 else 0, 10**length - 1)

        return number(), number()

    def _slip(self, a: int, b: int, rng: random.Random) -> tuple[int, int]:
        steps = max(len(str(a)), len(str(b)))
        return rng.randrange(steps), rng.choice((-2, -1, 1, 2))

    def sft_rows(self, n: int) -> list[dict]:
        """``n`` worked demonstrations, ``error_rate`` of them with a slip."""
        rng = self._rng("sft")
        rows = []
        for _ in range(n):
            a, b = self._numbers(rng)
            slip = self._slip(a, b, rng) if rng.random() < self.error_rate else None
            rows.append({"prompt": prompt_text(a, b), "completion": " " + worked_answer(a, b, slip)[0]})
        return rows

    def prompt_rows(self, n: int) -> list[dict]:
        """``n`` problems for RL, with the true sum in an ``answer`` column (what the checker reads)."""
        rng = self._rng("prompts")
        rows = []
        for _ in range(n):
            a, b = self._numbers(rng)
            rows.append({"prompt": prompt_text(a, b), "answer": a + b})
        return rows

    def stepwise_rows(self, n: int) -> list[dict]:
        """``n`` worked answers in TRL's stepwise form for a process reward model: ``prompt``, ``completions`` (the
        steps) and ``labels`` (each step checked, :func:`step_labels`); half of them with a slip, so that bad
        steps are not rare."""
        rng = self._rng("stepwise")
        rows = []
        for _ in range(n):
            a, b = self._numbers(rng)
            slip = self._slip(a, b, rng) if rng.random() < 0.5 else None
            steps = split_steps(worked_answer(a, b, slip)[0])
            rows.append({"prompt": prompt_text(a, b), "completions": steps, "labels": step_labels(a, b, steps)})
        return rows

    def preference_rows(self, n: int) -> list[dict]:
        """``n`` pairs: the correct worked answer chosen over one with a slip (gold 1 against 0)."""
        rng = self._rng("preferences")
        rows = []
        while len(rows) < n:
            a, b = self._numbers(rng)
            wrong, wrong_answer = worked_answer(a, b, self._slip(a, b, rng))
            if wrong_answer == a + b:
                continue  # a slip cancelled by clipping: not a wrong answer
            rows.append({"prompt": prompt_text(a, b), "chosen": " " + worked_answer(a, b)[0],
                         "rejected": " " + wrong, "gold_chosen": 1.0, "gold_rejected": 0.0})
        return rows


def build_tokenizer():
    """A word-level tokenizer of the task's vocabulary (digits, ``add + = , answer``), built locally, with a
    dedicated ``<pad>``, ``<eos>``, left padding and the embedded tasks' chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(VOCABULARY)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                        padding_side="left", model_max_length=128,
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
