"""reasoning-gym's procedural tasks as data: prompts for RL (:class:`ReasoningGymPromptDataModule`) and the tasks'
reference answers as demonstrations for SFT (:class:`ReasoningGymSFTDataModule`), generated from task names (one,
or a weighted mix), their settings, a size and a seed (:mod:`rlhf_lightning.tasks.reasoning_gym_rows`)."""

from __future__ import annotations

from typing import Any

from rlhf_lightning.data.demonstrations import SFTDataModule
from rlhf_lightning.data.prompts import PromptDataModule
from rlhf_lightning.data.sources import Record
from rlhf_lightning.tasks.reasoning_gym_rows import (
    DEFAULT_ANSWER_TAG,
    DEFAULT_SYSTEM_PROMPT,
    GymTask,
    answer_text,
    generate_rows,
    system_prompt_text,
    task_list,
)
from rlhf_lightning.utils import checks

REASONING_GYM = "reasoning_gym"  # the data modules' ``dataset``: rows made here, not read


class ReasoningGymRows:
    """What both reasoning-gym data modules do (a base of each, before the stage's data module): generate the
    training rows (``size``) and the held-out rows (``val_size``, from generators of their own, disjoint from the
    training entries) in ``setup``, render each question as a prompt, and keep what the checker reads in the
    ``task``, ``answer`` and ``entry`` columns."""

    def _init_rows(self, tasks: Any, size: int, val_size: int, system_prompt: str | None,
                   answer_tag: str | None) -> None:
        checks.at_least("size", size)
        checks.at_least("val_size", val_size, minimum=0)
        self.tasks: list[GymTask] = task_list(tasks)  # checked now: an unknown name stops before any weights load
        self.size = size
        self.val_size = val_size
        self.system_prompt = checks.optional_str(system_prompt)
        self.answer_tag = checks.optional_str(answer_tag)

    def _read(self, dataset: str, split: str) -> list[Record]:
        if dataset != REASONING_GYM:
            return super()._read(dataset, split)
        return self._records(generate_rows(self.tasks, self.size, self.seed), "train")

    def _hold_out(self, records: list[Record]) -> tuple[list[Record], list[Record]]:
        if not self.val_size:
            return records, []
        return records, self._records(generate_rows(self.tasks, self.val_size, self.seed, held_out=True), "held-out")

    def prompt_of(self, question: str) -> str | list[dict[str, str]]:
        """The question as a prompt: messages (the system prompt, the question) where the tokenizer has a chat
        template, else text (the system prompt and the question, a blank line apart)."""
        system = system_prompt_text(self.system_prompt)
        if self.tokenizer is not None and self.tokenizer.chat_template is not None:
            return [*([{"role": "system", "content": system}] if system else []),
                    {"role": "user", "content": question}]
        return f"{system}\n\n{question}" if system else question

    def _records(self, rows: list[dict[str, Any]], stream: str) -> list[Record]:
        return [Record(f"reasoning_gym[{stream}] row {index + 1} ({row['task']})", self.row(row))
                for index, row in enumerate(rows)]

    def row(self, generated: dict[str, Any]) -> dict[str, Any]:
        """The stage's row of a generated one (see :func:`~rlhf_lightning.tasks.reasoning_gym_rows.generate_rows`)."""
        raise NotImplementedError



class ReasoningGymPromptDataModule(ReasoningGymRows, PromptDataModule):
    """Prompts of reasoning-gym tasks for RL, with ``task``, ``answer`` (the reference) and ``entry`` (what the
    task's checker reads) columns for the reward (``rlhf_lightning.rewards.reasoning_gym_reward.ReasoningGymReward``) and
    the gold reward (``rlhf_lightning.tasks.reasoning_gym_checker.ReasoningGymChecker``: held-out accuracy per task,
    ``<stage>/val/gold/<task>``). Rows are generated identically on every rank and after a resume.

    Args:
        tasks: the reasoning-gym task (a name) or the mix of tasks (a list of names, or of ``{name, weight,
            config}``: ``weight`` its share of the rows, ``config`` its generator settings), e.g. ``[{name:
            leg_counting, config: {min_animals: 1, max_animals: 2}}, {name: chain_sum, weight: 2}]``.
        size: training rows generated from ``seed``.
        val_size: held-out rows, from the tasks' generators seeded apart from the training rows' (``seed + 2**31``),
            so no training entry is among them; 0 = none (or ``val_dataset``: a file).
        system_prompt: the system prompt: a name of reasoning-gym's (``default``: think, then the answer between
            ``<answer>`` tags; ``direct``, ``simple``, ``DeepSeekZero``, ``chain_of_draft``), other text as it is, or
            null for none.
        answer_tag: how the reference answers are written (SFT) and read: between ``<answer_tag>`` tags; null =
            bare. Keep it equal to the reward's and gold reward's ``answer_tag``.
    """

    def __init__(self, tasks: str | list[str | GymTask], size: int = 1000, val_size: int = 100,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, answer_tag: str | None = DEFAULT_ANSWER_TAG,
                 **kwargs: Any) -> None:
        super().__init__(dataset=REASONING_GYM, synthetic_rows=size, val_fraction=0.0, **kwargs)
        self._init_rows(tasks, size, val_size, system_prompt, answer_tag)

    def row(self, generated: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": self.prompt_of(generated["question"]), "task": generated["task"],
                "answer": generated["answer"], "entry": generated["entry"]}


class ReasoningGymSFTDataModule(ReasoningGymRows, SFTDataModule):
    """reasoning-gym tasks' questions answered by their reference answers (``<answer>42</answer>``), to warm a model
    up before RL on the same tasks. Rows are generated identically on every rank and after a resume.

    Args:
        tasks: the reasoning-gym task (a name) or the mix of tasks (a list of names, or of ``{name, weight,
            config}``: ``weight`` its share of the rows, ``config`` its generator settings), e.g. ``[{name:
            leg_counting, config: {min_animals: 1, max_animals: 2}}, {name: chain_sum, weight: 2}]``.
        size: training rows generated from ``seed``.
        val_size: held-out rows, from the tasks' generators seeded apart from the training rows' (``seed + 2**31``),
            so no training entry is among them; 0 = none (or ``val_dataset``: a file).
        system_prompt: the system prompt: a name of reasoning-gym's (``default``: think, then the answer between
            ``<answer>`` tags; ``direct``, ``simple``, ``DeepSeekZero``, ``chain_of_draft``), other text as it is, or
            null for none.
        answer_tag: how the reference answers are written (SFT) and read: between ``<answer_tag>`` tags; null =
            bare. Keep it equal to the reward's and gold reward's ``answer_tag``.
    """

    def __init__(self, tasks: str | list[str | GymTask], size: int = 1000, val_size: int = 100,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, answer_tag: str | None = DEFAULT_ANSWER_TAG,
                 **kwargs: Any) -> None:
        super().__init__(dataset=REASONING_GYM, synthetic_rows=size, val_fraction=0.0, **kwargs)
        self._init_rows(tasks, size, val_size, system_prompt, answer_tag)

    def row(self, generated: dict[str, Any]) -> dict[str, Any]:
        prompt = self.prompt_of(generated["question"])
        completion = answer_text(generated["answer"], self.answer_tag)
        if isinstance(prompt, list):
            return {"prompt": prompt, "completion": [{"role": "assistant", "content": completion}]}
        return {"prompt": prompt, "completion": " " + completion}
