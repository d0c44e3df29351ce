"""An embedded task where the interaction matters: adding two large numbers with a calculator tool.

Five-digit operands are beyond what a small model adds reliably in its head, and the task's model writes no
worked steps, so the way to the right sum is the ``add`` tool. An episode, in the task's ChatML-style template::

    <|im_start|>user what is 48213 + 90377 ?<|im_end|>
    <|im_start|>assistant<tool_call>{"name": "add", "arguments": {"a": 48213, "b": 90377}}</tool_call><|im_end|>
    <|im_start|>tool 138590<|im_end|>
    <|im_start|>assistant answer 138590<|im_end|>

The supervised demonstrations use the tool imperfectly, as a careless annotator would: half call it and copy
its result, a quarter call it with one digit of an operand mistyped (and copy the wrong result), a quarter skip
it and answer from the head with one digit wrong. The reward (:func:`correct_answer`) checks the final answer, so
RL can teach the SFT policy to call the tool, copy the operands faithfully and copy the result.

The tokenizer is built here: one token per digit and per punctuation mark, the JSON keys and the few words as
single tokens, and the template's markers as special tokens; decoding joins tokens without spaces.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_lightning.tasks.chat_tokenizer import word_level_chat_tokenizer
from rlhf_lightning.tasks.checking import WHOLE_NUMBER_PATTERN, check_sums, reads_answer_column

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK, "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
WORDS = ('"name"', '"arguments"', '"add"', '"a"', '"b"', "user", "assistant", "tool", "system", "what", "is",
         "answer", "error", ": ", ", ")
CHARACTERS = tuple("0123456789") + tuple('{}+?-.:," ') + tuple("abcdefghijklmnopqrstuvwxyz")
# Each message on one line; an assistant's tool calls right after its header, as Qwen2.5's template renders them.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_start|>{{ m['role'] }}{% if m['content'] %} {{ m['content'] }}{% endif %}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for call in m['tool_calls'] -%}<tool_call>{{ call['function'] | tojson }}</tool_call>{%- endfor -%}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{% endif -%}"
)
_PROMPT = re.compile(r"what is (\d+) \+ (\d+) \?")
_ANSWER = re.compile(f"answer ({WHOLE_NUMBER_PATTERN})")


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def prompt_text(a: int, b: int) -> str:
    return f"what is {a} + {b} ?"


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    match = _PROMPT.search(prompt)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def final_answer(transcript: str) -> int | None:
    """The number after the last ``answer`` of a transcript (thousands separators read: ``answer 154,616``), or
    None."""
    answers = _ANSWER.findall(transcript)
    return int(answers[-1].replace(",", "")) if answers else None


@reads_answer_column
def correct_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[int] | None = None,
                   **_: object) -> list[float]:
    """1.0 when an episode's final answer is the sum, else 0.0 (TRL's reward-function signature; ``answer`` is
    the dataset's column of sums, an integer or text such as "154,616", else the sum is read from the prompt)."""
    return check_sums("correct_answer", prompts, completions, answer, parse_prompt, final_answer, "what is A + B ?")


correct_answer.answer_of = final_answer  # maj@k in validation votes on the answers it reads (PassAtK)


def _call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}


def _mistype(number: int, rng: random.Random) -> int:
    """``number`` with one digit changed (the leading one never to 0)."""
    text = list(str(number))
    position = rng.randrange(len(text))
    choices = [d for d in "0123456789" if d != text[position] and not (position == 0 and d == "0")]
    text[position] = rng.choice(choices)
    return int("".join(text))


@dataclass(frozen=True)
class CalculatorTask:
    """The task's data, deterministic from ``seed``.

    Args:
        seed: seed of every row generated.
        digits: digits of each operand.
        tool_rate: share of demonstrations that call the tool with the right operands.
        typo_rate: share that call it with one operand mistyped; the rest answer without the tool, one digit
            wrong.
    """

    seed: int = 0
    digits: int = 5
    tool_rate: float = 0.5
    typo_rate: float = 0.25

    def _rng(self, stream: str) -> random.Random:
        return random.Random(f"calculator:{self.seed}:{stream}")

    def _numbers(self, rng: random.Random) -> tuple[int, int]:
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        return rng.randint(low, high), rng.randint(low, high)

    def demonstration(self, a: int, b: int, rng: random.Random) -> list[dict]:
        """An episode as messages after the user's: one of the three behaviours, drawn by the rates."""
        draw = rng.random()
        if draw < self.tool_rate + self.typo_rate:
            x, y = (a, b) if draw < self.tool_rate else ((_mistype(a, rng), b) if rng.random() < 0.5
                                                         else (a, _mistype(b, rng)))
            return [{"role": "assistant", "content": "", "tool_calls": [_call(x, y)]},
                    {"role": "tool", "name": "add", "content": str(x + y)},
                    {"role": "assistant", "content": f"answer {x + y}"}]
        return [{"role": "assistant", "content": f"answer {_mistype(a + b, rng)}"}]

    def sft_rows(self, n: int) -> list[dict]:
        """``n`` demonstrations in TRL's conversational prompt-completion form."""
        rng = self._rng("sft")
        rows = []
        for _ in range(n):
            a, b = self._numbers(rng)
            rows.append({"prompt": [{"role": "user", "content": prompt_text(a, b)}],
                         "completion": self.demonstration(a, b, rng)})
        return rows

    def prompt_rows(self, n: int) -> list[dict]:
        """``n`` problems for RL, with the sum in an ``answer`` column (what :func:`correct_answer` reads)."""
        rng = self._rng("prompts")
        return [{"prompt": prompt_text(a, b), "answer": a + b} for a, b in (self._numbers(rng) for _ in range(n))]

    def preference_rows(self, n: int) -> list[dict]:
        """``n`` pairs: the right tool use chosen over an answer from the head."""
        rng = self._rng("preferences")
        rows = []
        for _ in range(n):
            a, b = self._numbers(rng)
            good = [{"role": "assistant", "content": "", "tool_calls": [_call(a, b)]},
                    {"role": "tool", "name": "add", "content": str(a + b)},
                    {"role": "assistant", "content": f"answer {a + b}"}]
            bad = [{"role": "assistant", "content": f"answer {_mistype(a + b, rng)}"}]
            rows.append({"prompt": [{"role": "user", "content": prompt_text(a, b)}], "chosen": good,
                         "rejected": bad})
        return rows


def build_tokenizer():
    """The task's tokenizer: digits and punctuation one token each, JSON keys and words whole, the template's
    markers special, left padding, and decoding that joins tokens as they were written."""
    return word_level_chat_tokenizer(SPECIAL_TOKENS, WORDS, CHARACTERS, CHAT_TEMPLATE, model_max_length=160)

