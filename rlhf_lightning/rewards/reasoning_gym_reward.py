"""The reward of reasoning-gym rows: each task's own checker on the answer a response gives
(:class:`~rlhf_lightning.tasks.reasoning_gym_checker.ReasoningGymChecker`), as a reward source that counts the
answers a checker raised on (``objective/reasoning_gym/checker_errors``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from rlhf_lightning.rewards.inputs import RewardInputs
from rlhf_lightning.rewards.sources import FunctionReward
from rlhf_lightning.tasks.reasoning_gym_checker import ReasoningGymChecker
from rlhf_lightning.tasks.reasoning_gym_rows import DEFAULT_ANSWER_TAG

NEEDED_COLUMNS = ("entry",)


class ReasoningGymReward(FunctionReward):
    """The score of each response by its reasoning-gym task's own checker (``score_answer``, 0 to 1), on the rows of
    ``rlhf_lightning.data.reasoning_gym_data.ReasoningGymPromptDataModule`` (their ``entry`` column is what the checker
    reads). The answers whose checker raised are counted in ``objective/reasoning_gym/checker_errors`` each iteration.

    Args:
        answer_tag: the answer is the text of the last ``<answer_tag>...</answer_tag>`` span (reasoning-gym's
            ``extract_answer``); null = the whole response, stripped. Keep it equal to the data's ``answer_tag``.
        on_checker_error: a checker that raises on an answer: ``zero`` scores that answer 0, counts it and goes on;
            ``stop`` stops the run with one line naming the task, row and answer.
    """

    def __init__(self, answer_tag: str | None = DEFAULT_ANSWER_TAG,
                 on_checker_error: Literal["zero", "stop"] = "zero") -> None:
        super().__init__(ReasoningGymChecker(answer_tag, on_checker_error))
        self.last_errors = (0, 0)  # (answers whose checker raised, answers) of the latest score call

    @property
    def name(self) -> str:
        return "reasoning_gym"

    def check_columns(self, columns: Sequence[str]) -> None:
        """The prompt data must carry reasoning-gym's entries (the ``entry`` column)."""
        missing = [name for name in NEEDED_COLUMNS if name not in columns]
        if missing:
            raise ValueError(f"reward ReasoningGymReward needs the column 'entry' (reasoning-gym's entry of each row), "
                             f"which the prompt data lacks (its columns: {', '.join(columns) or 'only prompt'}); use "
                             "data: rlhf_lightning.data.reasoning_gym_data.ReasoningGymPromptDataModule")

    def score(self, inputs: RewardInputs) -> Tensor:
        self.fn.take_errors()  # count this call's answers only (validation scores through here too)
        scores = super().score(inputs)
        self.last_errors = (self.fn.take_errors(), len(inputs.completions))
        return scores

    def batch_metrics(self) -> dict[str, Tensor]:
        """``reasoning_gym/checker_errors`` and ``reasoning_gym/checker_error_rate``: the answers of the latest
        :meth:`score` call whose checker raised (each scored 0), and their share."""
        errors, rows = self.last_errors
        return {f"{self.name}/checker_errors": torch.tensor(float(errors)),
                f"{self.name}/checker_error_rate": torch.tensor(errors / max(rows, 1))}
