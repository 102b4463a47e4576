"""Each rank's record of collectives: torch's private reaches, and 2 real gloo ranks.

A rank-dependent number of async metric reductions on a side group (waited for later,
in another function) is proven a desync from the records and ends every rank with 70;
a rank killed by SIGKILL or aborted by gloo leaves its record for ``rankguard report``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import pytest
import torch

from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.hang.collective_files import flight_recorder, read_files
from rankguard.callbacks.hang.collectives import CollectiveRecorder
from rankguard.callbacks.hang.stacks import library_paths
from rankguard.report import run as report
from tests.mp import run_ranks


def test_flight_recorder_without_a_process_group_is_an_answer():
    entries, why = flight_recorder()  # no process group here: an answer, never an error
    assert entries == [] and why


# -- a rank-dependent number of async metric reductions on a side group ---------------------


def reduce_metrics(names, group):
    """OLMo-core-style: one async all_reduce per metric this rank recorded."""
    import torch.distributed as dist

    return [dist.all_reduce(torch.ones(1), group=group, async_op=True) for _ in names]


def wait_for(works):
    for work in works:
        work.wait()  # NCCL would block later still, at a host sync


def _metrics_job(rank, world_size, report_dir, extra_on):
    import torch.distributed as dist

    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    side = dist.new_group(backend="gloo")
    watchdog = HangWatchdog(report_dir=report_dir, timeout_s=60, deadlock_after_s=1.5)
    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    watchdog.on_fit_start(EventFacts())
    try:
        for step in range(6):
            watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
            dist.all_reduce(torch.ones(4))  # the step's gradient all-reduce (backward)
            names = ["loss", "acc"] + (["z_loss"] if rank == extra_on and step == 4 else [])
            if step == 4 and rank == 0 and extra_on == 0:
                with open(os.path.join(report_dir, "split"), "w") as f:
                    f.write(str(time.time()))
            works = reduce_metrics(names, side)  # recorded after backward, reduced async
            dist.all_reduce(torch.ones(1))  # the optimizer step's grad-norm all-reduce
            # The flush at the step's end. Rank 1 gets here only once rank 0 issued the
            # grad-norm all-reduce, so after its extra reduction: rank 1's next gradient
            # all-reduce, the other collective one rank alone issues, always comes later.
            wait_for(works)
            watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step + 1))
        watchdog.on_fit_end(EventFacts(step=6))
    finally:
        # Error-then-close, as every adapter's driver does (``abandon``): once the verdict is
        # out, rank 1 exits first (rank 0 leaves the store last) and gloo raises "Connection
        # closed by peer" in rank 0's ``work.wait()``; closing joins the watchdog thread,
        # which ends the process with the verdict's code.
        watchdog.close()
    return watchdog.incidents


@pytest.mark.slow
def test_async_metric_reductions_on_one_rank_more_are_a_desync_proven_from_the_records(tmp_path):
    from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE

    outcomes = run_ranks(_metrics_job, 2, str(tmp_path), 0, timeout_s=60)
    ended = time.time()
    assert [o.exitcode for o in outcomes] == [DEADLOCK_EXIT_CODE] * 2, outcomes
    split = float((tmp_path / "split").read_text())
    assert ended - split < 20  # seconds after the split (a few on a quiet machine)
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith(
        "desync, every rank waits for a collective another never issued: "
        "rank 0 issued collective #11 of group 1 (ranks 0,1), all_reduce "
        "float32[1] at test_collectives.py:"
    ), summary
    assert ": return [dist.all_reduce(torch.ones(1), group=group, async_op=True) for " in summary
    assert "group 1 (ranks 0,1): rank 0 issued 11; rank 1 issued 10" in summary
    assert "Next: fix the code path that issued rank 0's all_reduce" in summary
    assert "rank 0: your code at test_collectives.py:" in summary and "work.wait()" in summary


def write_checkpoint(seconds):
    time.sleep(seconds)  # a slow filesystem: no collective, no progress


def log_on_rank0(seconds):
    time.sleep(seconds)


def _skewed_job(rank, world_size, report_dir):
    """Healthy skew: rank 1 far behind in a checkpoint write while rank 0 waits for its
    async reductions; then rank-0-only logging between two collectives."""
    import torch.distributed as dist

    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    side = dist.new_group(backend="gloo")
    watchdog = HangWatchdog(report_dir=report_dir, timeout_s=60, deadlock_after_s=1.5)
    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    watchdog.on_fit_start(EventFacts())
    for step in range(3):
        watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        if step == 1 and rank == 1:
            write_checkpoint(5.0)  # > 3 x the settle time, rank 0 waits in Work.wait()
        wait_for(reduce_metrics(["loss", "acc"], side))
        if step == 2 and rank == 0:
            log_on_rank0(5.0)  # rank 1 waits in the all_reduce below
        dist.all_reduce(torch.ones(4))
        watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step + 1))
    watchdog.on_fit_end(EventFacts(step=3))
    watchdog.close()
    return watchdog.incidents


@pytest.mark.slow
def test_a_rank_behind_in_a_checkpoint_write_or_logging_alone_is_never_a_desync(tmp_path):
    outcomes = run_ranks(_skewed_job, 2, str(tmp_path), timeout_s=60)
    assert [(o.error, o.value) for o in outcomes] == [(None, 0), (None, 0)], outcomes
    assert not (tmp_path / "summary.txt").exists()


def test_the_same_reductions_on_every_rank_are_silent_and_leave_no_file(tmp_path):
    outcomes = run_ranks(_metrics_job, 2, str(tmp_path), -1, timeout_s=60)
    assert [(o.error, o.value) for o in outcomes] == [(None, 0), (None, 0)], outcomes
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- evidence that survives the fault --------------------------------------------------------


def _killed(rank, world_size, report_dir, how):
    import torch.distributed as dist

    side = dist.new_group(backend="gloo")
    recorder = CollectiveRecorder(report_dir, rank, library_paths())
    assert recorder.install()
    for _ in range(3):
        dist.all_reduce(torch.ones(2), group=side)
    if how == "kill":
        if rank == 1:
            reduce_metrics(["extra"], side)  # issued, never matched
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: no handler runs
    dist.all_reduce(torch.ones(4096 if rank == 0 else 1), group=side)  # gloo aborts
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_or_aborted_leaves_its_record_and_report_names_the_difference(
    tmp_path, capsys
):
    killed, aborted = tmp_path / "killed", tmp_path / "aborted"
    outcomes = run_ranks(_killed, 2, str(killed), "kill", timeout_s=30)
    assert -signal.SIGKILL in [o.exitcode for o in outcomes], outcomes
    records = read_files(killed)
    assert sorted(records) == [0, 1]
    assert report(argparse.Namespace(directory=killed)) == 0
    out = capsys.readouterr().out
    assert "rank 1, group 1: 4 issued; the last:" in out, out
    assert (
        "First difference: group 1 (ranks 0,1): rank 0 issued 3; rank 1 issued 4; collective "
        "#4: rank 0: not issued; rank 1: all_reduce float32[1] at test_collectives.py:"
    ) in out, out

    outcomes = run_ranks(_killed, 2, str(aborted), "abort", timeout_s=30)
    aborts = [o.rank for o in outcomes if o.exitcode == -signal.SIGABRT]
    assert aborts, outcomes  # gloo::EnforceNotMet: op.preamble.length <= op.nbytes
    assert report(argparse.Namespace(directory=aborted)) == 0
    out = capsys.readouterr().out
    assert "First difference: group 1 (ranks 0,1): ranks 0,1 issued 4; collective #4: " in out
    assert "rank 0: all_reduce float32[4,096]" in out and "rank 1: all_reduce float32[1]" in out
    assert f"rank{aborts[0]} died of a fatal signal (Fatal Python error: Aborted)" in out, out


def _issued_between_the_reads(rank, world_size, report_dir):
    """A broadcast issued while the watchdog thread reads the ring (the training thread
    runs on): every number the snapshot counts must be a call it holds."""
    import torch.distributed as dist

    from rankguard.callbacks.hang import collectives

    recorder = CollectiveRecorder(report_dir, rank, library_paths())
    assert recorder.install()
    dist.all_reduce(torch.ones(2))
    read_ring = collectives.read_ring

    def read_then_issue(ring):
        slots = read_ring(ring)
        dist.broadcast(torch.zeros(1, dtype=torch.int64), src=0)
        return slots

    collectives.read_ring = read_then_issue
    try:
        [record] = recorder.snapshot()
    finally:
        collectives.read_ring = read_ring
    return record.count, [(c.seq, c.op) for c in record.last]


def test_a_collective_issued_while_a_status_reads_the_record_is_counted_or_told_never_half(
    tmp_path,
):
    outcomes = run_ranks(_issued_between_the_reads, 2, str(tmp_path), timeout_s=60)
    for o in outcomes:
        assert o.error is None, o
        count, calls = o.value
        assert [seq for seq, _ in calls if seq <= count] == list(range(1, count + 1)), o.value


def test_a_status_reads_only_each_groups_newest_slots_in_the_order_written():
    from rankguard.callbacks.hang.collective_files import DDP_FORWARD_OP, newest_per_group

    # (seq, numel, t, thread, group, op, ...): group 0 issued 5, group 1 issued 2, interleaved.
    order = [(1, 0), (2, 0), (1, 1), (3, 0), (4, 0), (2, 1), (5, 0)]
    rows = [(s, 1, 0.0, 0, g, 0) for s, g in order]
    kept = newest_per_group(rows, 2)
    assert [(r[4], r[0]) for r in kept] == [(1, 1), (0, 4), (1, 2), (0, 5)]
    assert newest_per_group(rows, 8) == rows
    # A DDP forward's marks are kept apart: they never push a group's collectives out.
    marks = [(s, 0, 0.0, 0, 0, DDP_FORWARD_OP) for s in (2, 4, 5)]
    kept = newest_per_group([*rows, *marks], 2, marks=1)
    expected = [(1, 1, 0), (0, 4, 0), (1, 2, 0), (0, 5, 0), (0, 5, DDP_FORWARD_OP)]
    assert [(r[4], r[0], r[5]) for r in kept] == expected
