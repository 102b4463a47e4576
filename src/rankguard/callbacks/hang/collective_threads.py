"""Two threads of a rank issuing collectives on one process group: its own verdict, pure.

A background save (``dcp.async_save``'s thread, a staged copy) and the training thread
each issue collectives on the same group; nothing orders them, so one rank issues the
barrier first and another the save's gather: the ranks pair unlike calls and hang. The
ranks' records show it: at one number, calls from different threads on different ranks.
A rank's bookkeeping thread whose collective a peer never issued, while its training
thread computes, is a stall, not this (``verdict.held_by_own_collective``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.collective_compare import (
    Difference,
    GroupRecord,
    Issued,
    describe_issued,
    group_label,
)
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE

__all__ = ["describe_race", "foreign", "race"]

#: At most this many of a group's collectives are listed per rank.
_LISTED = 4


def foreign(thread: str) -> bool:
    """Whether a thread is one Python did not start (autograd's, where DDP and FSDP issue).

    Python names such a thread ``Dummy-N`` (``threading._DummyThread``) once it runs
    Python code; its collectives are the training thread's backward, not a race.
    """
    return thread.startswith("Dummy-")


def race(
    records: Mapping[int, Sequence[GroupRecord]],
    diffs: Sequence[Difference],
    waiting: bool = False,
) -> Difference | None:
    """Where two threads' collectives on one group interleaved differently, or ``None``.

    A rank holds one number of a group twice, from two threads (both took the group's
    next number before either issued: they raced), on a group whose records differ or
    while every rank's training thread waits at a rendezvous (``waiting``); or, on a group
    whose records differ, at a number every member holds the calls came from different
    threads on different ranks. Only Python's own threads count: calls from one thread
    (the training thread's own desync), from autograd's threads, or from a thread not
    known (the flight recorder's) are not a race.
    """
    differing = {d.group: d for d in diffs}
    for name, recs in sorted(_groups(records).items()):
        diff = differing.get(name)
        if diff is None and not waiting:
            continue
        members = tuple(sorted(recs))
        by_seq = {r: _by_seq(recs[r].last) for r in members}  # each record read once
        for seq in sorted({seq for calls in by_seq.values() for seq in calls}):
            at = {r: by_seq[r].get(seq, []) for r in members}
            threads = {i.thread for calls in at.values() for i in calls}
            if len(threads) < 2 or any(foreign(t) or not t for t in threads):
                continue
            twice = any(len({i.thread for i in calls}) > 1 for calls in at.values())
            if twice or (diff is not None and all(at.values())):
                issued = {r: calls[-1] if calls else None for r, calls in at.items()}
                counts = {r: recs[r].count for r in members}
                return Difference(name, members, seq, "call", counts, issued)
    return None


def _by_seq(last: Sequence[Issued]) -> dict[int, list[Issued]]:
    """A record's last calls by their number (a number held twice: two threads raced)."""
    calls: dict[int, list[Issued]] = {}
    for issued in last:
        calls.setdefault(issued.seq, []).append(issued)
    return calls


def _groups(records: Mapping[int, Sequence[GroupRecord]]) -> dict[str, dict[int, GroupRecord]]:
    groups: dict[str, dict[int, GroupRecord]] = {}
    for rank, recs in records.items():
        for rec in recs:
            groups.setdefault(rec.name, {})[rank] = rec
    return groups


def _by_thread(records: Mapping[int, Sequence[GroupRecord]], diff: Difference, rank: int) -> str:
    """A rank's last collectives on the group from the one before ``diff``'s, oldest first."""
    calls: list[Issued] = []
    for rec in records.get(rank, ()):
        if rec.name == diff.group:
            calls = [i for i in rec.last if i.seq >= diff.seq - 1][:_LISTED]
    said, previous = [], None
    for i in calls:
        said.append(f"#{i.seq} {describe_issued(i, previous)}")
        previous = i.thread
    return "; ".join(said) or "none held"


def describe_race(
    records: Mapping[int, Sequence[GroupRecord]],
    diff: Difference,
    loop_threads: Mapping[int, str | None],
) -> tuple[str, tuple[str, ...], int]:
    """The summary, detail lines and rank to read first of two threads on one group.

    ``loop_threads``: each rank's training thread; the rank to read first is the lowest
    whose differing call another thread issued.
    """
    calls = {r: i for r, i in diff.issued.items() if i is not None}
    at_seq = {
        r: [i for rec in records.get(r, ()) if rec.name == diff.group for i in rec.last
            if i.seq == diff.seq]
        for r in diff.members
    }  # fmt: skip
    loops = set(loop_threads.values())
    seen = {i.thread for held in at_seq.values() for i in held}
    threads = sorted(seen, key=lambda t: (t not in loops, t))  # the training thread first
    words = {r: " and ".join(describe_issued(i) for i in held) for r, held in at_seq.items()}
    at = "; ".join(
        f"{rank_label(ranks)}: {said or 'not issued'}" for ranks, said in group_ranks(words)[:8]
    )
    summary = (
        f"two threads issued collectives on {group_label(diff)} in a different order on "
        f"different ranks: threads {', '.join(threads)}; collective #{diff.seq}: {at}"
    )
    details = tuple(
        f"Rank {r}'s last collectives on {group_label(diff)}: {_by_thread(records, diff, r)}"
        for r in sorted(at_seq)[:8]
    )
    others = [r for r, i in sorted(calls.items()) if i.thread != loop_threads.get(r)]
    first = others[0] if others else min(calls)
    details += (
        f"Next: one thread per process group. Give the background work its own group "
        f'(`dcp.async_save(..., process_group=dist.new_group(backend="gloo"))` for a '
        f"background save), or wait for it (the previous save's `future.result()`) before "
        f"the training thread's next collective on {group_label(diff)}: threads "
        f"{', '.join(threads)} both issue on it, and nothing orders them alike on every "
        f"rank. A restart would replay it: exit code {DEADLOCK_EXIT_CODE}, do not restart.",
    )
    return summary, details, first
