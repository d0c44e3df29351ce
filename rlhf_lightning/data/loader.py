"""A training loader that Lightning can checkpoint mid-epoch and resume exactly."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableLoader:
    """Shuffled batches, deterministic from ``(seed, epoch)``, that resume mid-epoch from a checkpoint.

    Lightning stores ``state_dict()`` in its checkpoints and hands it back on resume, and it does not prefetch
    from loaders with a length, so the state counts exactly the batches already trained on. Under DDP each rank
    takes its own shard of every epoch's permutation (the tail that does not divide evenly is dropped, so all
    ranks run the same number of steps). Not a ``DataLoader`` subclass, so Lightning leaves the sharding to us.
    An epoch is as long as Lightning takes it (``limit``, the trainer's ``limit_train_batches``): when its last
    batch is handed out the state already points at the next epoch, so an epoch cut short by the limit is followed
    by a whole new one, while a run stopped mid-epoch by ``max_steps`` (or preemption) resumes where it stopped
    (see :meth:`set_epoch`). :meth:`ahead` hands out a coming batch early, and ``iter()`` hands out that same
    object when its turn comes: each batch is read and collated once (:class:`EpochReading`).

    Kept rather than torchdata's ``StatefulDataLoader`` with torch's ``DistributedSampler``, which would shard the
    same way (one permutation per epoch, ``rank::world``, the tail dropped) and resume too: this is about 200 lines
    and no further dependency, and Lightning passes it its epoch and state without re-instantiating it to inject
    a sampler (it leaves iterables that are not ``DataLoader``s alone), so which rows each rank trains on, hence
    the one-process / N-rank equivalence, stays in this file.

    Args:
        dataset: any indexable collection of examples.
        batch_size: examples per batch on each rank.
        collate_fn: turns a list of examples into a batch.
        shuffle: reshuffle every epoch.
        drop_last: drop the last, smaller batch of each epoch.
        seed: seed of the shuffling.
        num_workers: worker processes for collation.
        limit: the trainer's ``limit_train_batches``: an int caps the batches of an epoch, a float takes that
            fraction of them (as Lightning counts).
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        limit: int | float = 1.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.num_workers = num_workers
        self.limit = limit
        self.epoch = 0
        self.batches_done = 0
        self.lightning_ahead = 0
        self._readings: dict[int, EpochReading] = {}  # epoch -> its batches being read (see ahead)
        if len(self) == 0:
            raise ValueError(
                f"{len(dataset)} examples make no batch of {batch_size} per rank; lower the batch size"
            )

    def _epoch_batches(self) -> list[list[int]]:
        rank, world = _rank_and_world()
        n = len(self.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(n))
        mine = order[: n // world * world][rank::world]
        batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches[: self._batches_taken(len(batches))]

    def _batches_taken(self, length: int) -> int:
        # Lightning's own count (its data connector): an int caps, a float is a fraction rounded down.
        if isinstance(self.limit, int):
            return min(length, self.limit)
        return int(length * self.limit)

    def __len__(self) -> int:
        _, world = _rank_and_world()
        per_rank = len(self.dataset) // world
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self.batches_done >= len(self._epoch_batches()):  # resumed from a checkpoint taken at an epoch's end
            self.epoch, self.batches_done = self.epoch + 1, 0
        reading = self._reading(self.epoch, self.batches_done)
        for batch in reading:
            # Counted before the yield: a checkpoint taken while this batch trains must not replay it, and one
            # taken while the epoch's last batch trains resumes at the next epoch.
            self.batches_done += 1
            if self.batches_done == reading.end:
                self.epoch, self.batches_done = self.epoch + 1, 0
            yield batch

    def _reading(self, epoch: int, start: int) -> EpochReading:
        """The reading of ``epoch``'s batches from batch ``start`` on: the one :meth:`ahead` began, if it is there,
        so that a batch read ahead is the very batch handed out (read and collated once); readings of earlier
        epochs are let go."""
        self._readings = {kept: reading for kept, reading in self._readings.items() if kept >= epoch}
        reading = self._readings.get(epoch)
        if reading is None or reading.position != start:
            reading = self._readings[epoch] = EpochReading(self._batches_of(epoch), start, self._collated)
        return reading

    def _collated(self, batches: list[list[int]]) -> Iterator[Any]:
        return iter(DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                               num_workers=self.num_workers))

    def ahead(self, count: int) -> Any:
        """The batch ``count`` places after the last one handed out (1: the next), without moving: into the next
        epoch when this one ends first (an asynchronous run draws rollouts of iterations ahead of the one that
        trains). The batch is read once: ``iter()`` hands out this same object when its turn comes."""
        if count < 1:
            raise ValueError(f"ahead({count}): count the batches after the last one handed out, from 1")
        epoch, index = self.epoch, self.batches_done + count - 1
        while index >= (length := len(self._batches_of(epoch))):
            index -= length
            epoch += 1
        return self._reading(epoch, self.batches_done if epoch == self.epoch else 0).peek(index)

    def _batches_of(self, epoch: int) -> list[list[int]]:
        current, self.epoch = self.epoch, epoch
        try:
            return self._epoch_batches()
        finally:
            self.epoch = current

    @property
    def sampler(self) -> ResumableLoader:
        """Itself: Lightning calls ``sampler.set_epoch`` on every training loader when an epoch starts."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Lightning's epoch ``epoch`` starts. Lightning does not hand back the state of a checkpoint written at an
        epoch's end, so a loader at an epoch boundary takes its epoch from here. But Lightning counts an epoch that
        ``max_steps`` (or a signal) cut short as ended: a loader restored mid-epoch continues it and keeps how far
        Lightning's count runs ahead of its own."""
        if self.batches_done == 0:
            self.epoch = epoch - self.lightning_ahead
        else:
            self.lightning_ahead = epoch - self.epoch

    def state_dict(self) -> dict[str, int]:
        """Where the loader is: the epoch and the batches of it already handed out."""
        return {"epoch": self.epoch, "batches_done": self.batches_done, "seed": self.seed,
                "lightning_ahead": self.lightning_ahead}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` on the next ``iter()``."""
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
        self._readings = {}
        self.lightning_ahead = state.get("lightning_ahead", 0)  # absent from checkpoints of earlier versions


class EpochReading:
    """One epoch's batches read in order from batch ``start``, each collated once, with the batches read ahead of
    the last one handed out kept until they are handed out.

    Args:
        batches: the epoch's batches (rows of the dataset).
        start: the first batch to read.
        collated: the collated batches of a list of batches, in order (a ``DataLoader`` over them).
    """

    def __init__(self, batches: list[list[int]], start: int,
                 collated: Callable[[list[list[int]]], Iterator[Any]]) -> None:
        self.end = len(batches)
        self.position = start  # the batch the next ``next()`` hands out
        self._source = collated(batches[start:])
        self._read: deque[Any] = deque()  # read ahead: batches position, position + 1, ...

    def peek(self, index: int) -> Any:
        """Batch ``index`` of the epoch (at or after :attr:`position`), read now if it was not yet."""
        while len(self._read) <= index - self.position:
            self._read.append(next(self._source))
        return self._read[index - self.position]

    def __iter__(self) -> EpochReading:
        return self

    def __next__(self) -> Any:
        if self.position >= self.end:
            raise StopIteration
        batch = self._read.popleft() if self._read else next(self._source)
        self.position += 1
        return batch
