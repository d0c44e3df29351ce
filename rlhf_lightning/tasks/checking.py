"""The exact checker the addition tasks share, with TRL's reward-function signature, and how it reads a sum."""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

# A whole number as people write one: digits, or digits in groups of three with thousands separators ("154,616").
_WHOLE_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)")
WHOLE_NUMBER_PATTERN = _WHOLE_NUMBER.pattern


def read_whole_number(value: Any) -> int:
    """A sum as a data file may hold it: an integer (numpy's too), a float without a fraction (what parquet makes of
    an integer column with a gap), or text of digits, with commas between groups of three ("154,616" is 154616).
    Anything else is a ``ValueError`` saying what was expected."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's integers too
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _WHOLE_NUMBER.fullmatch(value.strip()):
        return int(value.strip().replace(",", ""))
    raise ValueError(f"expected a whole number such as 154616 or 154,616, got {value!r}")


def check_sums(name: str, prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any] | None,
               parse_prompt: Callable[[str], tuple[int, int] | None],
               final_answer: Callable[[str], int | None], prompt_form: str) -> list[float]:
    """1.0 for each completion whose final answer (``final_answer``) is the sum, else 0.0. The sum is the
    ``answer`` column's (read by :func:`read_whole_number`), or else read from the prompt by ``parse_prompt``; a
    value or prompt it cannot read is an error naming ``name``, the row and what was expected (the module checks
    every row's ``answer`` at setup, naming the file, see ``column_readers`` in
    :class:`~rlhf_lightning.rewards.sources.FunctionReward`)."""
    scores = []
    for row, completion in enumerate(completions):
        if answer is not None and answer[row] is not None:
            try:
                truth = read_whole_number(answer[row])
            except ValueError as error:
                raise ValueError(f"{name}: row {row}: column 'answer': {error}") from None
        else:
            numbers = parse_prompt(prompts[row])
            if numbers is None:
                raise ValueError(f"{name}: row {row}: prompt {prompts[row]!r} is not {prompt_form!r} and no "
                                 "'answer' column was given")
            truth = sum(numbers)
        scores.append(float(final_answer(completion) == truth))
    return scores


def reads_answer_column(function: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """Mark a checker as reading the ``answer`` column with :func:`read_whole_number`, so that a value it cannot
    read stops the run at setup, naming the file, row and column, rather than at the first rollout."""
    function.column_readers = {"answer": read_whole_number}
    return function
