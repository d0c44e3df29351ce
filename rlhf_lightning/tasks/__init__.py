"""The embedded tasks, built from a seed with no download: ``synthetic`` (a small language with a hidden gold
reward) and ``arithmetic`` (additions with a checkable answer). ``dataset: <name>`` in a data module generates
the task's rows and ``tokenizer: <name>`` in a base model builds its tokenizer."""

from __future__ import annotations

from typing import Any

TASKS = ("synthetic", "arithmetic")


def make_task(name: str, seed: int) -> Any:
    """The task ``name`` with ``seed``: an object with ``sft_rows``, ``prompt_rows`` and ``preference_rows``."""
    if name == "synthetic":
        from rlhf_lightning.tasks.synthetic import SyntheticTask

        return SyntheticTask(seed=seed)
    if name == "arithmetic":
        from rlhf_lightning.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=seed)
    raise ValueError(f"no embedded task {name!r}; the tasks are {', '.join(TASKS)}")


def build_task_tokenizer(name: str):
    """The tokenizer of task ``name``."""
    if name == "synthetic":
        from rlhf_lightning.tasks.synthetic import build_tokenizer
    elif name == "arithmetic":
        from rlhf_lightning.tasks.arithmetic import build_tokenizer
    else:
        raise ValueError(f"no embedded task {name!r}; the tasks are {', '.join(TASKS)}")
    return build_tokenizer()
