"""The synthetic task's rows (see :mod:`rlhf_lightning.tasks.synthetic`): demonstrations and prompts from the
corpus writer, preference pairs labelled from the gold reward by Bradley-Terry sampling (:class:`SyntheticTask`), and
the same rows written as JSONL files."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_lightning.tasks.synthetic_gold import gold_reward
from rlhf_lightning.tasks.synthetic_grammar import SyntheticLanguage


@dataclass(frozen=True)
class SyntheticTask:
    """The embedded task's data, deterministic from ``seed``.

    Args:
        seed: seed for every row generated.
        label_accuracy: fraction of preference labels that agree with the gold order (Bradley-Terry noise).
        corruption_prob: chance that a response of a preference pair has a slip (see
            :meth:`SyntheticLanguage.corrupt`), so that raters also compare broken text, as they do when rating
            samples of imperfect models.
        echo_prob: chance that a response of a preference pair repeats a positive adjective (see
            :meth:`SyntheticLanguage.echo`).
        label_noise: instead of Bradley-Terry sampling, label each pair by the gold order and flip each label with
            this probability (0 = no noise; Coste et al. 2023's noisy setting: 0.25); None = Bradley-Terry sampling
            at ``label_accuracy``. The pairs themselves are the same either way.
        language: the generator's probabilities.
    """

    seed: int = 0
    label_accuracy: float = 0.85
    corruption_prob: float = 0.25
    echo_prob: float = 0.1
    label_noise: float | None = None
    language: SyntheticLanguage = SyntheticLanguage()

    def _rng(self, stream: str) -> random.Random:
        # Separate streams so that, e.g., the prompts do not change when the corpus size does.
        return random.Random(f"{self.seed}:{stream}")

    def sft_rows(self, n: int) -> list[dict]:
        """``n`` prompt/completion demonstrations from the generator."""
        rng = self._rng("sft")
        rows = []
        for _ in range(n):
            prompt = self.language.prompt(rng)
            rows.append({"prompt": prompt, "completion": " " + self.language.response(rng)})
        return rows

    def prompt_rows(self, n: int) -> list[dict]:
        """``n`` prompts for RL (subjects for the policy to continue)."""
        rng = self._rng("prompts")
        return [{"prompt": self.language.prompt(rng)} for _ in range(n)]

    def preference_rows(self, n: int) -> list[dict]:
        """``n`` preference pairs labelled by Bradley-Terry sampling from the gold reward (or by the gold order with
        ``label_noise``).

        Each row has ``prompt``, ``chosen``, ``rejected`` and the true scores ``gold_chosen`` and
        ``gold_rejected``. Pairs whose two responses have equal gold reward are not used: their gold order is
        undefined.
        """
        rng = self._rng("preferences")
        pairs = []
        while len(pairs) < n:
            prompt = self.language.prompt(rng)
            first, second = self._rated_response(rng), self._rated_response(rng)
            gold_first, gold_second = gold_reward(prompt, first), gold_reward(prompt, second)
            if gold_first != gold_second:
                pairs.append((prompt, first, second, gold_first, gold_second))
        temperature = bradley_terry_temperature(
            [abs(pair[3] - pair[4]) for pair in pairs], self.label_accuracy
        )
        rows = []
        for prompt, first, second, gold_first, gold_second in pairs:
            if self.label_noise is None:
                first_preferred = rng.random() < _sigmoid((gold_first - gold_second) / temperature)
            else:  # the gold order, flipped at random
                first_preferred = (gold_first > gold_second) != (rng.random() < self.label_noise)
            if not first_preferred:
                first, second, gold_first, gold_second = second, first, gold_second, gold_first
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": " " + first,
                    "rejected": " " + second,
                    "gold_chosen": gold_first,
                    "gold_rejected": gold_second,
                }
            )
        return rows

    def _rated_response(self, rng: random.Random) -> str:
        response = self.language.response(rng)
        if rng.random() < self.echo_prob:
            response = self.language.echo(response, rng)
        return self.language.corrupt(response, rng) if rng.random() < self.corruption_prob else response


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def bradley_terry_temperature(gaps: Sequence[float], label_accuracy: float) -> float:
    """The temperature at which Bradley-Terry labels agree with the gold order ``label_accuracy`` of the time.

    Solves ``mean(sigmoid(gap / T)) = label_accuracy`` for T by bisection (the mean falls as T grows).
    """
    if not 0.5 < label_accuracy < 1.0:
        raise ValueError(f"label_accuracy must be in (0.5, 1), got {label_accuracy}")
    if not gaps or min(gaps) <= 0:
        raise ValueError("gaps must be a non-empty list of positive gold-score differences")

    def agreement(temperature: float) -> float:
        return sum(_sigmoid(gap / temperature) for gap in gaps) / len(gaps)

    low, high = 1e-3, 1e3
    for _ in range(100):
        mid = math.sqrt(low * high)
        if agreement(mid) > label_accuracy:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)


def write_dataset_files(out_dir: str | Path, seed: int = 0, sft: int = 2000, preferences: int = 2000,
                        prompts: int = 500) -> dict[str, Path]:
    """Write the task's data as JSONL files (``sft.jsonl``, ``preferences.jsonl``, ``prompts.jsonl``).

    Handy to look at the formats, or to train on the task with the file loaders instead of ``dataset: synthetic``.
    """
    import json

    task = SyntheticTask(seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "sft": (out / "sft.jsonl", task.sft_rows(sft)),
        "preferences": (out / "preferences.jsonl", task.preference_rows(preferences)),
        "prompts": (out / "prompts.jsonl", task.prompt_rows(prompts)),
    }
    for path, rows in files.values():
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {name: path for name, (path, _) in files.items()}
