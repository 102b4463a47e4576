"""Nothing rankguard decides, sends or says grows with the square of the world size.

Pinned at 16,384 ranks against 4,096, side by side in one process: for each decision
(the hang verdict in its four classes, the verdict on ranks gone, the data-stall part of
the interval exchange, the checkpoint plan), the Python calls it makes
(``sys.setprofile``: deterministic) grow at most linearly (x4, bound x5; the square
would be x16), and so does its time (the best of three, bound x10, a backstop for work
inside one C call; a ``timing`` test, run alone), both as rank 0 decides (the cyclic
collector paused, ``cyclic_gc_paused``); what every rank reads from the store (its
status, each verdict, a missing-ranks verdict) and the words it logs stay the same size
whatever the world size (bound x1.5). docs/scale.md.
"""

from __future__ import annotations

import functools
import pickle
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from rankguard.callbacks.checkpoint.plan import RankMemory, plan_save
from rankguard.callbacks.core.ranks import rank_label
from rankguard.callbacks.core.side_channel import _Missing, cyclic_gc_paused
from rankguard.callbacks.data.stall import IntervalStats, stall_verdict
from rankguard.callbacks.hang import incident
from rankguard.callbacks.hang.collective_compare import GroupRecord, Issued, group_members
from rankguard.callbacks.hang.status import LEFT_LOOP, RankStatus
from rankguard.callbacks.hang.verdict import diagnose, gone

SMALL, LARGE = 4096, 16384
GROWTH = LARGE / SMALL  # 4: linear
CALLS_BOUND = 5.0  # linear is 4; the square would be 16
TIME_BOUND = 10.0
SIZE_BOUND = 1.5

TRAIN = "/job/train.py"
WAITS = "all_reduce, called from train.py:91 (train_step)"


@functools.cache
def _members(world: int) -> Sequence[int]:
    return group_members(range(world))


@functools.cache
def _record(world: int, count: int, odd: bool = False) -> tuple[GroupRecord, ...]:
    """The default group's record as the recorder keeps it: every rank a member."""
    where = "train.py:91 (train_step): dist.all_reduce(grads)"
    last = tuple(
        Issued(seq, "all_reduce", "float32", 1024 if seq % 2 else 1, where, "MainThread", 1e9)
        for seq in range(count - 7, count + 1)
    )
    if odd:  # the training thread issued one more, a metric its peers never issue
        last = (*last[1:], Issued(count + 1, "all_reduce", "float32", 4, where, "MainThread", 2e9))
        count += 1
    return (GroupRecord("0", _members(world), count, last),)


def _status(world: int, rank: int, case: str) -> RankStatus:
    """Rank ``rank``'s status in one of the cases, as its watchdog sends it."""
    victim = rank == world // 2
    step = 60 + rank % 2  # the ranks a batch apart, interleaved: the groups are scattered
    base: dict[str, Any] = {
        "phase": f"train batch {step}",
        "step": step,
        "idle_s": 0.4,
        "deadline_s": 30.0,
        "ceiling_s": 600.0,
        "host": f"node{rank // 8}",
        "pid": 1000 + rank,
        "user_frame": "train.py:88 (train_step): loss.backward()",
        "progress": 120,
        "record": _record(world, 120),
        "loop_thread": "MainThread",
    }
    if case == "stall":
        waiting = {"idle_s": 39.0, "blocked_in": WAITS, "waits_at": "all_reduce", "wait_s": 39.0}
        base.update({"idle_s": 41.0} if victim else {**waiting, "settled": True})
    elif case == "deadlock":  # half wait in a barrier the others never reach
        at = "barrier" if rank < world // 2 else "all_reduce"
        base.update(
            idle_s=20.0, blocked_in=f"{at}, called from train.py:9{len(at)} (x)", waits_at=at
        )
        base.update(wait_s=20.0, settled=True, direct=True, quiet=True)
    elif case == "ahead":  # every fit ended, half the ranks one collective ahead of the rest
        base.update(phase=f"left the training loop at step {step}", deadline_s=None, idle_s=20.0)
        base.update(waits_at=LEFT_LOOP, wait_s=20.0, settled=True, quiet=True)
        base.update(record=_record(world, 120 + rank % 2))
    elif case == "desync":  # one rank issued a collective the others never issue
        base.update(idle_s=20.0, quiet=True, record=_record(world, 120, odd=victim))
        base.update(blocked_in=WAITS, waits_at="all_reduce", wait_s=20.0, settled=True)
    return RankStatus(**base)


def _statuses(world: int, case: str) -> dict[int, RankStatus]:
    return {rank: _status(world, rank, case) for rank in range(world)}


def _calls(fn: Callable[[], Any]) -> tuple[int, Any]:
    """The Python and C calls ``fn()`` makes, and what it returned (as rank 0 decides)."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    with cyclic_gc_paused():
        sys.setprofile(profile)
        try:
            value = fn()
        finally:
            sys.setprofile(None)
    return count, value


def _seconds(fn: Callable[[], Any]) -> float:
    """``fn()``'s time as rank 0 decides (the collector paused: ``cyclic_gc_paused``).

    Called again until 50 ms passed: a decision of a few ms is measured past the noise.
    """
    with cyclic_gc_paused():
        calls, started = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - started < 0.05:
            fn()
            calls += 1
        return (time.perf_counter() - started) / calls


def _words(verdict: Any) -> int:
    return len(verdict.summary) + sum(map(len, verdict.details)) + len(verdict.phases)


def _decide(world: int, case: str) -> Callable[[], Any]:
    """The decision of ``case`` at ``world`` ranks, as rank 0 makes it (a proof: its 2nd look)."""
    statuses = _statuses(world, case)
    suspect = diagnose(statuses).suspect
    if case in ("deadlock", "desync"):
        assert suspect is not None, case
    return lambda: diagnose(statuses, suspect=suspect)


def _gone(world: int) -> Callable[[], Any]:
    last = diagnose(_statuses(world, "healthy"))
    missing = list(range(world // 2, world // 2 + 8))
    return lambda: gone(missing, rank=0, waited_s=120.0, last=last, default_s=1800.0)


def _stall_stats(world: int, starved: Callable[[int], bool]) -> dict[int, IntervalStats]:
    """Every rank's data-wait interval; the ``starved`` ranks waited 80% of 50 steps in a row."""
    return {
        rank: IntervalStats(
            wait_s=4.0 + rank % 7 * 0.01 if starved(rank) else 0.1,
            step_s=5.0,
            steps=50,
            longest_run=20 * starved(rank),
            fit_steps=200,
            fit_slow=100 * starved(rank),
        )
        for rank in range(world)
    }


def _stall(world: int) -> Callable[[], Any]:
    stats = _stall_stats(world, lambda rank: rank == world // 2)
    return lambda: stall_verdict(stats, window=10, threshold=0.5)


def _stall_everywhere(world: int) -> Callable[[], Any]:
    """Every rank's loader starves (one short configuration on every rank)."""
    stats = _stall_stats(world, lambda rank: True)
    return lambda: stall_verdict(stats, window=10, threshold=0.5)


def _plan(world: int) -> Callable[[], Any]:
    def memory(rank: int) -> RankMemory:  # 8 ranks a node, each with its own memory reading
        return RankMemory(f"node{rank // 8}", rank % 8, 2**30, False, 2**41 - rank, "MemAvailable")

    per_rank = {rank: memory(rank) for rank in range(world)}
    return lambda: plan_save(per_rank)


DECISIONS: dict[str, Callable[[int], Callable[[], Any]]] = {
    "healthy": lambda w: _decide(w, "healthy"),
    "stall": lambda w: _decide(w, "stall"),
    "deadlock": lambda w: _decide(w, "deadlock"),
    "desync": lambda w: _decide(w, "desync"),
    "ranks ahead": lambda w: _decide(w, "ahead"),
    "gone": _gone,
    "data stall": _stall,
    "data stall on every rank": _stall_everywhere,
    "checkpoint plan": _plan,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DECISIONS))
def test_each_decision_grows_linearly_and_its_verdict_not_at_all(name):
    small, large = DECISIONS[name](SMALL), DECISIONS[name](LARGE)
    (calls_small, verdict_small), (calls_large, verdict_large) = _calls(small), _calls(large)
    assert calls_large / calls_small < CALLS_BOUND, (calls_small, calls_large)
    # Every rank reads the verdict: its bytes do not grow with the world size.
    size_small, size_large = len(pickle.dumps(verdict_small)), len(pickle.dumps(verdict_large))
    assert size_large / size_small < SIZE_BOUND, (size_small, size_large)
    if hasattr(verdict_large, "summary"):  # and every rank logs its words
        assert _words(verdict_large) / _words(verdict_small) < SIZE_BOUND
    if hasattr(verdict_large, "table"):
        assert len(verdict_large.table()) / len(verdict_small.table()) < SIZE_BOUND


@pytest.mark.slow
@pytest.mark.timing  # a figure: run alone (make test's timing session), not beside a worker
@pytest.mark.parametrize("name", list(DECISIONS))
def test_each_decisions_time_grows_at_most_linearly(name):
    small, large = DECISIONS[name](SMALL), DECISIONS[name](LARGE)
    small_s, large_s = [], []
    for _ in range(3):  # side by side: what loads the machine loads both
        small_s.append(_seconds(small))
        large_s.append(_seconds(large))
    assert min(large_s) / min(small_s) < TIME_BOUND, (small_s, large_s)


def test_what_each_rank_sends_and_reads_does_not_grow_with_the_world_size():
    for case in ("healthy", "stall", "desync"):
        sizes = [len(pickle.dumps(_status(w, w // 2, case))) for w in (SMALL, LARGE)]
        assert sizes[1] / sizes[0] < 1.1, (case, sizes)  # its status
    every_other = [len(pickle.dumps(_Missing(list(range(0, w, 2))))) for w in (SMALL, LARGE)]
    nodes = [len(pickle.dumps(_Missing(list(range(w // 2, w))))) for w in (SMALL, LARGE)]
    assert nodes[1] < 100 and every_other[1] / every_other[0] < 4.5  # runs: whole nodes, cheap
    labels = [len(rank_label(range(0, w, 2))) for w in (SMALL, LARGE)]
    assert labels[1] / labels[0] < SIZE_BOUND and labels[1] < 120, labels


def test_the_report_of_a_stall_at_16384_ranks_is_a_few_lines():
    verdict = diagnose(_statuses(LARGE, "stall"))
    assert verdict.kind == "slow" and verdict.stuck == ((LARGE // 2, LARGE // 2),)
    policy = incident.Policy("abort", "ceiling", "abort", "warn")
    state = incident.State(False, False)
    steps = incident.after_verdict(verdict, state, policy, leader=True, told=set())
    report = next(s for s in steps if isinstance(s, incident.Report))
    text = incident.summary_text(report, "")
    assert len(text) < 6000 and len(text.splitlines()) < 60, text


def test_a_data_stall_on_every_one_of_16384_ranks_is_said_in_a_few_lines():
    from rankguard.callbacks.data.stall import describe_stall

    verdict = _stall_everywhere(LARGE)()
    text = describe_stall(verdict, threshold=0.5, window=10)
    assert text.startswith("Data loading cannot keep up on every rank (ranks 0-16383):"), text
    assert len(text) < 2000 and len(re.findall(r"rank \d+: waited", text)) == 3, text
    assert "16,381 more stalled ranks (all stalled ranks: a median 0.08 s per batch)" in text, text
    assert "other ranks" not in text and "every rank's own loader is short" in text, text
