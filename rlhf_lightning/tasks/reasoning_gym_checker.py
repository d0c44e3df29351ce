"""The checker of reasoning-gym rows: each task's own ``score_answer`` on the answer read from a response the way
reasoning-gym's documentation says (the last ``<answer>...</answer>`` span, its ``extract_answer``), with TRL's
reward-function signature, so it serves as a reward function and as the gold reward of validation (pass@k, maj@k
and accuracy per task). The rows are :mod:`rlhf_lightning.tasks.reasoning_gym_rows`'s."""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

from rlhf_lightning.tasks.reasoning_gym_rows import DEFAULT_ANSWER_TAG, reasoning_gym

log = logging.getLogger(__name__)


class ReasoningGymChecker:
    """Scores responses to reasoning-gym rows with each row's task's own checker (``score_answer``, 0 to 1).

    Called with TRL's keywords and the rows' columns: ``checker(prompts=..., completions=..., entry=..., **_)``,
    ``entry`` being reasoning-gym's entry of each row (the data modules of :mod:`rlhf_lightning.data.reasoning_gym_data`
    give it as a column). A response without an answer scores what the task's checker gives ``None`` (0 for every
    task).

    Args:
        answer_tag: the answer is the text of the last ``<answer_tag>...</answer_tag>`` span, stripped (reasoning-gym's
            ``extract_answer``, the format its system prompts ask for); null = the whole response, stripped.
        on_checker_error: what a checker that raises on an answer does: ``zero`` scores that answer 0, counts it
            (:attr:`errors`; logged as ``objective/reasoning_gym/checker_errors`` by
            ``ReasoningGymReward``) and goes on; ``stop`` stops the run with one line naming the task, row and answer.
    """

    def __init__(self, answer_tag: str | None = DEFAULT_ANSWER_TAG,
                 on_checker_error: Literal["zero", "stop"] = "zero") -> None:
        if on_checker_error not in ("zero", "stop"):
            raise ValueError(f"on_checker_error: expected 'zero' or 'stop', got {on_checker_error!r}")
        if answer_tag is not None and (not isinstance(answer_tag, str) or not answer_tag.strip()
                                       or any(c in answer_tag for c in "<>/ ")):
            raise ValueError(f"answer_tag: expected a tag name such as 'answer' (no <, >, / or space), or null for "
                             f"the whole response, got {answer_tag!r}")
        self.answer_tag = answer_tag
        self.on_checker_error = on_checker_error
        self.errors = 0  # answers whose checker raised, since the last take_errors()
        self._checkers: dict[str, Any] = {}
        self._warned = False
        self.__name__ = "reasoning_gym"  # what FunctionReward's messages and metrics call it

    def answer_of(self, completion: str) -> str | None:
        """The answer a response gives (``None``: none), by :attr:`answer_tag`; maj@k votes on it."""
        if self.answer_tag is None:
            return completion.strip()
        extract = importlib.import_module("reasoning_gym.utils").extract_answer
        return extract(completion, tag_name=self.answer_tag, strip=True)

    def checker(self, task: str) -> Any:
        """Task ``task``'s ``score_answer`` (its dataset built once with default settings, as reasoning-gym's
        ``get_score_answer_fn`` does; the checkers read everything else from the entry)."""
        if task not in self._checkers:
            reasoning_gym()
            self._checkers[task] = importlib.import_module("reasoning_gym.factory").get_score_answer_fn(task)
        return self._checkers[task]

    def take_errors(self) -> int:
        """The answers whose checker raised since the last call, and start counting again."""
        errors, self.errors = self.errors, 0
        return errors

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], entry: Sequence[dict] | None = None,
                 task: Sequence[str] | None = None, **_: object) -> list[float]:
        if entry is None:
            raise ValueError("reasoning_gym checker: the rows have no 'entry' column (reasoning-gym's entry of each "
                             "row); serve them with rlhf_lightning.data.reasoning_gym_data's data modules")
        tasks = task if task is not None else [None] * len(completions)
        return [self.score(completion, row_entry, row, row_task) for row, (completion, row_entry, row_task)
                in enumerate(zip(completions, entry, tasks, strict=True))]

    def score(self, completion: str, entry: dict, row: int = 0, task: str | None = None) -> float:
        """One response's score by the checker of its row's ``task`` (else the task its entry's metadata names)."""
        task = task or (entry.get("metadata") or {}).get("source_dataset")
        if task is None:
            raise ValueError(f"reasoning_gym checker: row {row}: no 'task' column and the entry names no task "
                             "(metadata.source_dataset)")
        answer = self.answer_of(completion)
        try:
            score = float(self.checker(task)(answer, entry))
        except Exception as error:  # any checker's failure on a model's answer: the answer is wrong, not the run
            where = f"reasoning-gym task {task!r}'s checker raised on row {row}, answer {answer!r}"
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            if self.on_checker_error == "stop":
                raise ValueError(f"{where} ({reason}); set on_checker_error: zero to score such answers 0 and go "
                                 "on") from None
            if not self._warned:  # once: the count is logged every iteration
                self._warned = True
                log.warning("%s (%s): scored 0, counted in objective/reasoning_gym/checker_errors", where, reason)
            self.errors += 1
            return 0.0
        return score if math.isfinite(score) else 0.0
