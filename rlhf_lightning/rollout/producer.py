"""The rollout producer: the rollouts of later iterations drawn on a thread of their own while the trainer updates.

A job is one iteration's rollout, drawn by an adapter version the engine holds for it (a handle); jobs run one
after the other in the order submitted (each is many requests at once, which the server batches). The trainer
takes a job's rollout when its iteration comes. Never stuck, nothing lost: a wait has a timeout and ends in one line
naming what it waited for; a job that failed stops the fit with its cause at the next check (every iteration), not
when its own iteration comes; a job never drops a prompt (the rollout answers every prompt of its batch).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.rollout.engines import PolicyVersion
from rlhf_lightning.rollout.rollouts import Rollout


class ProducerError(RuntimeError):
    """The producer failed, or a wait for it timed out: the fit stops with this line."""


@dataclass(frozen=True)
class Job:
    """One iteration's rollout, drawn ahead: which policy drew it and for which prompts."""

    iteration: int  # the training iteration (0-based) that trains on it
    drawn_by: int  # the iteration whose starting policy drew it
    source: PolicyVersion  # that policy's adapter version, held by the engine until the job ends
    rows: tuple[int, ...]  # the prompts' rows in the dataset (-1: not numbered)
    seeds: tuple[int, ...]  # one per response

    def describe(self) -> str:
        return f"iteration {self.iteration + 1}'s rollout (drawn by the policy of iteration {self.drawn_by + 1}, " \
               f"adapter version {self.version})"

    @property
    def version(self) -> int:
        """The adapter version that draws it (the optimizer steps taken before it)."""
        return self.source.version


class RolloutProducer:
    """Draws submitted jobs on one background thread, in order.

    Args:
        draw: what a job runs, on the producer's thread: the rollout of a job's prompts (it must not touch the
            trainer's model, nor the global random stream).
        done: called on the producer's thread when a job ends, however (it releases the job's adapter version).
        timeout: seconds :meth:`take` waits for a job before the fit stops.
        where: what draws (a server's address), for the messages: called when one is written.
    """

    def __init__(self, draw: Callable[[Job, dict[str, Any]], Rollout], done: Callable[[Job], None], timeout: float,
                 where: Callable[[], str]) -> None:
        self.draw, self.done, self.timeout, self.where = draw, done, timeout, where
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-producer")
        self.jobs: dict[int, tuple[Job, concurrent.futures.Future]] = {}

    def submit(self, job: Job, prompts: dict[str, Any]) -> None:
        """Draw ``job``'s rollout of ``prompts`` after the jobs submitted before it."""
        if job.iteration in self.jobs:
            raise ProducerError(f"{job.describe()} was submitted twice")
        self.jobs[job.iteration] = (job, self.pool.submit(self._run, job, prompts))

    def _run(self, job: Job, prompts: dict[str, Any]) -> Rollout:
        try:
            return self.draw(job, prompts)
        finally:
            self.done(job)

    @property
    def pending(self) -> list[Job]:
        """The jobs submitted and not yet taken, in iteration order."""
        return [job for _, (job, _) in sorted(self.jobs.items())]

    def check(self) -> None:
        """Stop with the cause of a job that failed, whichever iteration it was for."""
        for job, future in self.jobs.values():
            if future.done() and future.exception() is not None:
                self._failed(job, future.exception())

    def take(self, iteration: int) -> tuple[Job, Rollout]:
        """The job of ``iteration`` and its rollout, once drawn: waits at most ``timeout`` seconds."""
        if iteration not in self.jobs:
            raise ProducerError(f"no rollout was submitted for iteration {iteration + 1} (submitted: "
                                f"{[job.iteration + 1 for job in self.pending]})")
        job, future = self.jobs[iteration]
        try:
            rollout = future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise ProducerError(
                f"waited {self.timeout:g} s for {job.describe()} from {self.where()}, and it is still being drawn: "
                "is the server stuck or overloaded (its log)? asynchronous.rollout_timeout raises the wait") from None
        except Exception as error:  # noqa: BLE001 (any failure of the producer stops the fit with its cause)
            self._failed(job, error)
        del self.jobs[iteration]
        return job, rollout

    def _failed(self, job: Job, error: BaseException) -> None:
        raise ProducerError(f"the rollout producer failed drawing {job.describe()} from {self.where()}: "
                            f"{type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Drop the jobs not yet started (each one's version released, as a job that ends); a job being drawn ends
        on its own (every request has a timeout)."""
        for job, future in self.jobs.values():
            if future.cancel():
                self.done(job)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.jobs.clear()
