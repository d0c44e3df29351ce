"""Every random stream of sampling, in one place.

A training iteration samples from the global stream seeded by ``(seed, "train", iteration, rank)``, so a resumed run
draws what the uninterrupted one would have; an evaluation batch samples from a stream of its own (training's is
left untouched); with ``seed_scope: prompt`` each response draws from a generator seeded by its prompt's row in
the dataset and its sample number, so responses do not depend on how prompts are split over ranks and batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor

SeedScope = Literal["rank", "prompt"]


def derive_seed(*parts: object) -> int:
    """A seed that depends only on ``parts`` (Python's ``hash`` of strings changes between processes)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


class Seeds:
    """The seeds of a module's sampling.

    Args:
        seed: the run's sampling seed.
        scope: ``rank``: one stream per iteration and rank; ``prompt``: one per response (see the module docstring).
    """

    def __init__(self, seed: int, scope: SeedScope = "rank") -> None:
        self.seed = seed
        self.scope = scope

    def start_iteration(self, iteration: int, rank: int) -> None:
        """Seed the global stream for training iteration ``iteration`` on ``rank`` (its sampling and shuffles)."""
        torch.manual_seed(derive_seed(self.seed, "train", iteration, rank))

    @contextmanager
    def evaluation(self, batch_idx: int, rank: int, device: torch.device,
                   purpose: str = "validation") -> Iterator[None]:
        """Evaluation batch ``batch_idx``'s fixed random stream for ``purpose`` (the single validation response, or
        pass@k's), training's left untouched."""
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(self.seed, purpose, batch_idx, rank))
            yield

    def rows(self, purpose: str, indices: Tensor | None, per_prompt: int = 1) -> list[int] | None:
        """With ``scope: prompt``, the seed of each response to the prompts numbered ``indices`` (their rows in
        the dataset), ``per_prompt`` responses each (consecutive rows); None (the global stream) with ``rank``."""
        if self.scope != "prompt":
            return None
        if indices is None or bool((indices < 0).any()):
            raise ValueError("seed_scope: prompt needs prompts numbered by their row in the dataset (the data "
                             "modules' batches carry them as `index`)")
        return [derive_seed(self.seed, purpose, int(index), sample)
                for index in indices.tolist() for sample in range(per_prompt)]

    def ahead(self, iteration: int, rank: int, indices: Tensor | None, prompts: int, per_prompt: int) -> list[int]:
        """The seed each response of training iteration ``iteration`` on ``rank`` is drawn with (its first turn's)
        when it is drawn ahead, on a producer thread (which must not read the global stream): the synchronous loop's
        own, so that an iteration drawn by the same policy draws the same tokens either way. ``seed_scope:
        prompt``: its row's first turn's (:meth:`rows`, :meth:`turn`); ``rank``: each prompt's responses share the
        seed the synchronous loop's server engine draws for the prompt's request from the iteration's stream."""
        rows = self.rows(f"train {iteration}", indices, per_prompt)
        if rows is not None:
            return self.turn(rows, 1)
        stream = torch.Generator().manual_seed(derive_seed(self.seed, "train", iteration, rank))
        return [int(seed) for seed in torch.randint(0, 2**62, (prompts,), generator=stream).tolist()
                for _ in range(per_prompt)]

    @staticmethod
    def turn(row_seeds: Sequence[int] | None, turn: int) -> list[int] | None:
        """The seeds of turn ``turn`` (1, 2, ...) of the episodes seeded ``row_seeds`` (None stays None)."""
        return None if row_seeds is None else [derive_seed(seed, "turn", turn) for seed in row_seeds]
