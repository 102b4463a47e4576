"""Desyncs proven from what each rank issued: the pure comparison of recorded sequences."""

from __future__ import annotations

from rankguard.callbacks.hang.collective_compare import (
    GroupRecord,
    Issued,
    differences,
    mismatch_warning,
)
from rankguard.callbacks.hang.status import RankStatus
from rankguard.callbacks.hang.verdict import diagnose, record_proof

LOG = "train.py:88 (log_metrics): dist.all_reduce(t, group=side, async_op=True)"
STEP = "train.py:120 (step): dist.all_reduce(grad)"


def _call(seq, op="all_reduce", numel=1, where=LOG, thread="MainThread", t=None, dtype="float32"):
    return Issued(seq, op, dtype, numel, where, thread, 100.0 + seq if t is None else t)


def _group(name, count, calls=None, ranks=(0, 1)):
    calls = calls if calls is not None else [_call(s) for s in range(max(1, count - 3), count + 1)]
    return GroupRecord(name, ranks, count, tuple(calls))


def _all(value, ranks=(0, 1)):
    return dict.fromkeys(ranks, value)


def _prove(records, waiting=None, quiet=True, threads=None):
    """The record's proof where each rank is quiet or not, its stack waiting or not."""
    waiting = waiting or _all(False, tuple(records))
    statuses = {
        r: RankStatus(
            "train batch 5",
            5,
            4.0,
            30.0,
            "h",
            1,
            waits_at="all_reduce" if waiting[r] else None,
            settled=waiting[r],
            quiet=quiet,
            loop_thread=(threads or {}).get(r, "MainThread"),
        )
        for r in records
    }
    return record_proof(statuses, records)


def test_equal_records_differ_nowhere_and_prove_nothing():
    records = {r: (_group("0", 40), _group("1", 12)) for r in (0, 1)}
    assert differences(records) == []
    assert _prove(records) is None
    assert mismatch_warning(records) is None


def test_one_extra_collective_on_one_rank_is_the_first_difference_with_its_line():
    extra = _call(13, t=200.0)
    records = {
        0: (_group("0", 5), _group("1", 13, [_call(12), extra])),
        1: (_group("0", 6, [_call(6, numel=4, where=STEP, t=201.0)]), _group("1", 12)),
    }
    diffs = {d.group: d for d in differences(records)}
    assert (diffs["1"].kind, diffs["1"].seq, dict(diffs["1"].counts)) == (
        "count",
        13,
        {0: 13, 1: 12},
    )
    assert diffs["1"].issued == {0: extra, 1: None}
    desync = _prove(records)  # rank 0 waits in Work.wait(), rank 1 in the next all_reduce
    assert desync is not None and desync.first == 0  # its extra came first (t=200 < 201)
    assert desync.summary.startswith(
        "desync, every rank waits for a collective another never issued: rank 0 issued "
        "collective #13 of group 1 (ranks 0,1), all_reduce float32[1] at " + LOG
    ), desync.summary
    assert "which rank 1 never issued" in desync.summary
    text = "\n".join(desync.details)
    assert "group 1 (ranks 0,1): rank 0 issued 13; rank 1 issued 12; collective #13" in text
    assert "the default group (ranks 0,1): rank 0 issued 5; rank 1 issued 6" in text
    assert "Next: fix the code path that issued rank 0's all_reduce" in text


def test_a_rank_behind_that_issued_nothing_extra_is_slow_not_a_desync():
    # Rank 1 is 10 s behind in a checkpoint write: rank 0 issued one more and waits for it.
    records = {0: (_group("0", 41),), 1: (_group("0", 40),)}
    assert _prove(records) is None  # rank 1 waits for nothing: it will come
    # ... and rank-0-only logging between collectives: rank 1 waits, rank 0 is busy.
    records = {0: (_group("0", 40),), 1: (_group("0", 41),)}
    assert _prove(records) is None
    # Ranks still issuing (not quiet) are never a proof, whatever the counts.
    skewed = {0: (_group("0", 41), _group("1", 3)), 1: (_group("0", 40), _group("1", 4))}
    assert _prove(skewed, quiet=False) is None
    assert _prove(skewed) is not None  # both quiet, each waits for the other: proven


def test_a_rank_behind_whose_stack_waits_at_a_rendezvous_completes_the_proof():
    records = {0: (_group("0", 41),), 1: (_group("0", 40),)}  # rank 1 in a rankguard exchange
    assert _prove(records, waiting={0: False, 1: True}) is not None


def test_same_count_different_op_or_size_is_a_call_difference():
    records = {
        0: (_group("0", 7, [_call(6), _call(7, numel=4)]),),
        1: (_group("0", 7, [_call(6), _call(7, numel=1)]),),
    }
    (diff,) = differences(records)
    assert (diff.kind, diff.seq) == ("call", 7)
    desync = _prove(records)  # both quiet at the same count: they paired unlike calls
    assert desync is not None and "collective #7 of the default group" in desync.summary
    key, text = mismatch_warning(records)
    assert key == "0#7" and "paired with the wrong partner" in text and "float32[4]" in text
    op = {0: (_group("0", 2, [_call(2, op="broadcast")]),), 1: (_group("0", 2, [_call(2)]),)}
    assert differences(op)[0].kind == "call"
    # Sizes that differ by design (all_to_all_single's splits) are not a difference.
    a2a = {r: (_group("0", 2, [_call(2, op="all_to_all_single", numel=r + 1)]),) for r in (0, 1)}
    assert differences(a2a) == []


def test_several_groups_are_compared_each_and_the_first_issued_is_named():
    records = {
        0: (_group("0", 10), _group("1", 5), _group("2", 9, [_call(9, t=50.0)])),
        1: (_group("0", 11, [_call(11, where=STEP, t=60.0)]), _group("1", 5), _group("2", 8)),
    }
    groups = [(d.group, d.seq) for d in differences(records)]
    assert groups == [("0", 11), ("2", 9)]
    assert _prove(records).first == 0  # group 2's extra was issued first
    # A group a rank never used is count 0 there.
    missing = {0: (_group("0", 3), _group("3", 1, [_call(1)])), 1: (_group("0", 3),)}
    (diff,) = differences(missing)
    assert (diff.group, dict(diff.counts)) == ("3", {0: 1, 1: 0})


def test_point_to_point_groups_are_never_compared_by_count():
    p2p = [_call(3, op="send")]
    records = {0: (_group("0", 3, p2p),), 1: (_group("0", 2, [_call(2, op="recv")]),)}
    assert differences(records) == []


def test_a_collective_from_another_thread_than_the_groups_previous_one_is_named():
    records = {
        0: (_group("1", 6, [_call(5), _call(6, thread="bookkeeping", t=10.0)]),),
        1: (_group("1", 6, [_call(5), _call(6, numel=3)]),),
    }
    desync = _prove(records)
    text = "\n".join(desync.details)
    assert (
        "thread bookkeeping (the group's previous collective came from thread MainThread)" in text
    )


def _status(record, progress=5, quiet=True, waits_at=None):
    return RankStatus(
        phase="train batch 5",
        step=5,
        idle_s=2.0,
        deadline_s=30.0,
        host="h",
        pid=1,
        user_frame="train.py:29 (job): work.wait()",
        waits_at=waits_at,
        settled=waits_at is not None,
        progress=progress,
        record=record,
        quiet=quiet,
    )


def test_the_watchdog_proves_it_at_two_exchanges_without_progress_like_a_stack_deadlock():
    records = {
        0: (_group("0", 5), _group("1", 13, [_call(13, t=1.0)])),
        1: (_group("0", 6, [_call(6, where=STEP, t=2.0)]), _group("1", 12)),
    }
    statuses = {r: _status(rec) for r, rec in records.items()}
    first = diagnose(statuses)
    assert not first.deadlock and first.suspect is not None
    second = diagnose(statuses, suspect=first.suspect)
    assert second.deadlock and second.first == 0
    assert second.summary.startswith("desync, every rank waits for a collective")
    moved = {**statuses, 1: _status(records[1], progress=6)}
    assert not diagnose(moved, suspect=first.suspect).deadlock
    busy = {**statuses, 1: _status(records[1], quiet=False)}
    assert diagnose(busy).suspect is None  # a rank still issuing: nothing to suspect


def test_stack_proof_and_record_agree_on_the_rank_that_issued_the_odd_collective():
    # Rank 0 alone calls all_reduce on a side group (gloo: its thread waits in it).
    records = {
        0: (_group("0", 20), _group("1", 4, [_call(4, t=1.0)])),
        1: (_group("0", 21, [_call(21, where=STEP, t=2.0)]), _group("1", 3)),
    }
    statuses = {
        0: _status(records[0], waits_at="all_reduce"),
        1: _status(records[1], waits_at="backward"),
    }
    statuses[0] = RankStatus(**{**vars(statuses[0]), "direct": True})
    first = diagnose(statuses)
    verdict = diagnose(statuses, suspect=first.suspect)
    assert verdict.deadlock and verdict.first == 0
    assert verdict.summary.startswith("deadlock, every rank waits at a rendezvous")  # stack's
    assert any(line.startswith("Collectives issued: group 1") for line in verdict.details)
    assert _prove(records).first == 0  # the record names the same rank


def test_unlike_calls_at_one_count_while_the_job_runs_are_a_mismatch_of_the_verdict():
    import pytest

    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    records = {
        0: (_group("1", 9, [_call(8), _call(9, numel=4)]),),
        1: (_group("1", 10, [_call(8), _call(9, numel=1), _call(10)]),),
    }
    running = {r: _status(rec, quiet=False) for r, rec in records.items()}
    verdict = diagnose(running)
    assert not verdict.deadlock and verdict.suspect is None  # still running: no proof
    key, text = verdict.mismatch
    assert key == "1#9" and "collective #9: rank 0: all_reduce float32[4]" in text, text
    same = {r: _status((_group("1", 9),), quiet=False) for r in (0, 1)}
    assert diagnose(same).mismatch is None
    assert HangWatchdog(collective_mismatch="abort").collective_mismatch == "abort"
    with pytest.raises(ValueError, match="collective_mismatch"):
        HangWatchdog(collective_mismatch="raise")


def test_a_collective_counted_but_not_described_names_only_the_ranks_that_never_issued_it():
    # FSDP2's all-gather on rank 1 alone, counted by the group but issued outside the
    # functions the record wraps: rank 1 issued #7, rank 0 never did.
    records = {
        0: (_group("0", 6, [_call(5), _call(6)]),),
        1: (_group("0", 7, [_call(5), _call(6)]),),
    }
    desync = _prove(records, waiting={0: True, 1: True})
    assert desync is not None and desync.first == 1
    assert desync.summary.endswith(
        "rank 1 issued collective #7 of the default group (ranks 0,1), issued outside "
        "Python's record (from C++, e.g. DDP's gradient all-reduce), which rank 0 never issued"
    ), desync.summary
