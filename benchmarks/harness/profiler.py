"""torch.profiler over one iteration of a side: the table of top operators that ``--profile`` prints."""

from __future__ import annotations

import torch


class IterationProfiler:
    """torch.profiler over iteration ``iteration`` of a side (0-based, warm-up included; None: no profile):
    ``begin(index)`` as each iteration begins, ``stop()`` as it ends, which prints the top operators by their own
    CPU time (the table ``--profile`` shows)."""

    def __init__(self, iteration: int | None) -> None:
        self.iteration = iteration
        self.profiler = None

    def begin(self, index: int) -> None:
        """Start profiling if iteration ``index`` is the one profiled."""
        if index == self.iteration:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def stop(self, rows: int = 25) -> None:
        """End the profile, if one runs, and print its top ``rows`` operators."""
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        print(self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
        self.profiler = None
