"""The exact checker the addition tasks share, with TRL's reward-function signature."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def check_sums(name: str, prompts: Sequence[str], completions: Sequence[str], answer: Sequence[int] | None,
               parse_prompt: Callable[[str], tuple[int, int] | None],
               final_answer: Callable[[str], int | None], prompt_form: str) -> list[float]:
    """1.0 for each completion whose final answer (``final_answer``) is the sum, else 0.0. The sum is the
    ``answer`` column's, or else read from the prompt by ``parse_prompt``; a prompt it cannot read is an error
    naming ``name``, the row and the expected ``prompt_form``."""
    scores = []
    for row, completion in enumerate(completions):
        if answer is not None and answer[row] is not None:
            truth = int(answer[row])
        else:
            numbers = parse_prompt(prompts[row])
            if numbers is None:
                raise ValueError(f"{name}: row {row}: prompt {prompts[row]!r} is not {prompt_form!r} and no "
                                 "'answer' column was given")
            truth = sum(numbers)
        scores.append(float(final_answer(completion) == truth))
    return scores
