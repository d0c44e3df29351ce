"""The cores pytest-xdist's workers share (the README's test command runs ``pytest -n 2``): each worker, and every
process it starts, gets its share as torch threads. With torch's default of one thread per core in each, the OpenMP
threads of two workers waited on each other and the whole suite took as long at ``-n 2`` as in one process (1166 s
against 1163 s on the 2-core CPU VM; 654 s with a share each)."""

from __future__ import annotations

import os
from collections.abc import Mapping


def threads_per_worker(environ: Mapping[str, str], cores: int) -> int | None:
    """The torch threads for one xdist worker on ``cores`` cores (``cores // workers``, at least one), or None where
    there is nothing to share: one process, or ``OMP_NUM_THREADS`` already chosen by whoever started pytest."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores // workers)


def share_the_cores() -> None:
    """Set this worker's share before torch is imported (``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``, which the
    processes it starts inherit); nothing outside xdist or where the user chose."""
    threads = threads_per_worker(os.environ, len(os.sched_getaffinity(0)))
    if threads is not None:
        os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
