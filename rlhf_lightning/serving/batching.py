"""Concurrent requests scored together: a queue gathers the rows of the requests that arrive while it waits, up
to ``max_batch_size`` rows or ``max_wait`` seconds after the first, and a worker thread scores them one batch at a
time (the event loop keeps taking requests meanwhile)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlhf_lightning.serving.scoring import RewardService, Rows


@dataclass
class Job:
    rows: Rows
    done: asyncio.Future


class Batcher:
    """Batches of up to ``max_batch_size`` rows from the requests waiting, scored by ``service``.

    A request larger than a batch is scored in several; requests with different data columns, or laid out by
    their clients in other widths, are never joined.
    When a joined batch fails, each of its requests is scored alone, so that an error names rows of the request
    that caused it and the others get their scores.
    """

    def __init__(self, service: RewardService, max_batch_size: int, max_wait: float) -> None:
        self.service, self.max_batch_size, self.max_wait = service, max_batch_size, max_wait
        self.queue: asyncio.Queue[Job] = asyncio.Queue()

    async def score(self, rows: Rows) -> list[float]:
        """The scores of one request's ``rows``, once its batch has been scored."""
        job = Job(rows, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.done

    async def run(self) -> None:
        """Gather and score batches until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while sum(len(job.rows) for job in jobs) < self.max_batch_size and loop.time() < deadline:
                try:
                    jobs.append(await asyncio.wait_for(self.queue.get(), deadline - loop.time()))
                except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                    break
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.rows.shape, []).append(job)
            for group in groups.values():
                await self.score_group(group)

    async def score_group(self, jobs: list[Job]) -> None:
        try:
            scores = await asyncio.to_thread(self.score_rows, Rows.join([job.rows for job in jobs]))
        except Exception as error:  # noqa: BLE001 - the error goes to the requests, not out of the worker
            if len(jobs) == 1:
                self.finish(jobs[0], error=error)
                return
            for job in jobs:
                await self.score_group([job])
            return
        start = 0
        for job in jobs:
            self.finish(job, scores[start:start + len(job.rows)])
            start += len(job.rows)

    def score_rows(self, rows: Rows) -> list[float]:
        return [score for start in range(0, len(rows), self.max_batch_size)
                for score in self.service.score(rows.slice(start, start + self.max_batch_size))]

    def finish(self, job: Job, scores: list[float] | None = None, error: Exception | None = None) -> None:
        if job.done.cancelled():  # the client went away
            return
        if error is not None:
            job.done.set_exception(error)
            return
        self.service.served["requests"] += 1
        self.service.served["rows"] += len(job.rows)
        job.done.set_result(scores)
