"""What a rank whose collective failed says about the others, from the reports they left in the run folder (the
two-rank runs through the command line are in ``tests/contracts/test_distributed_equivalence.py``; these are the cases of more ranks)."""

from __future__ import annotations

import os
import time

from rlhf_lightning.cli.rank_failures import collective_text, peer_failure_line, read_reports, write_report

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.0.0.7]:41237. This is typically caused by a remote worker crashing. Check the logs of the remote worker")


def test_of_four_ranks_the_one_that_left_no_report_is_named_and_an_earlier_runs_report_is_ignored(tmp_path):
    write_report(tmp_path, 2, "ValueError: a previous run's error")
    os.utime(tmp_path / "rank-2.json", (1.0, 1.0))  # written long before this run started
    started = time.time() - 1
    for alive in (0, 1):
        write_report(tmp_path, alive, None)
    reports = read_reports(tmp_path, since=started)
    assert reports == {0: None, 1: None}
    assert peer_failure_line(reports, {}, 0, 4, collective_text(RuntimeError(GLOO))) == (
        "ranks 2, 3 are gone without an error report (killed, e.g. by kill -9 or the out-of-memory killer, or the "
        "machine lost); this rank's collective failed: Connection closed by peer [10.0.0.7]:41237")
    write_report(tmp_path, 3, "KeyError: row 7 has no 'prompt'")
    assert peer_failure_line(read_reports(tmp_path, since=started), {}, 0, 4, "") == (
        "rank 3 failed: KeyError: row 7 has no 'prompt'")


def test_ranks_this_process_launched_are_named_by_how_they_ended():
    assert peer_failure_line({}, {1: None, 2: -9, 3: 2}, 0, 4, "") == (
        "rank 2 was killed by SIGKILL; rank 3 exited with status 2, without an error report")
    assert peer_failure_line({1: None, 2: None, 3: None}, {}, 0, 4, "Broken pipe") == (
        "a collective failed and no rank reported an error: Broken pipe")
