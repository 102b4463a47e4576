"""Pure decisions on the ranks' records of collectives: where they differ, and when that is proof.

Nothing here touches a thread, a file or a process group.
:mod:`rankguard.callbacks.hang.collectives` keeps each rank's record;
``docs/hang.md#desyncs-proven-from-what-each-rank-issued`` explains the rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from rankguard.callbacks.core.ranks import group_ranks, rank_label

__all__ = [
    "P2P_OPS",
    "SIZED_OPS",
    "UNDESCRIBED",
    "Difference",
    "GroupRecord",
    "Issued",
    "Mark",
    "ahead",
    "describe_difference",
    "describe_issued",
    "describe_records",
    "differences",
    "first_difference",
    "group_label",
    "group_members",
    "in_backward",
    "last_call",
    "members_json",
    "mismatch_warning",
    "odd_rank",
    "origin_text",
    "same_call",
]

#: Collectives whose size every rank passes alike (elements of the tensor or list it reduces,
#: broadcasts or gathers): a different size at the same count pairs unlike calls.
SIZED_OPS = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast_object_list",
        "all_gather_single",
        "reduce_scatter_single",
    }
)
#: Point-to-point calls: only two ranks of a group issue each, so counts differ by design.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
#: A collective the group counted that no wrapped ``torch.distributed`` function issued.
UNDESCRIBED = "issued outside Python's record (from C++, e.g. DDP's gradient all-reduce)"
#: The default group's name in reports.
DEFAULT_GROUP = "0"


class Issued(NamedTuple):
    """One collective a rank issued, as its record keeps it.

    Attributes:
        seq: Its number on its group (the group's count of collectives once it was issued).
        op: The ``torch.distributed`` function, e.g. ``"all_reduce"``.
        dtype: The element type of the tensor it carries (``"object"`` for object lists).
        numel: Elements of that tensor (entries of a list).
        where: The user's line that issued it, e.g. ``"train.py:88 (log): dist.all_reduce(t)"``.
        thread: The name of the thread that issued it.
        t: Unix time when it was issued.
        origin: What issued it where a framework did, with ``{at}`` for its phase, e.g.
            ``"gradient bucket 0 of {at}'s backward (DDP)"``; ``None`` for the user's own.
        phase: The phase it was issued in, e.g. ``"train batch 5"``, or ``None``.
    """

    seq: int
    op: str
    dtype: str
    numel: int
    where: str | None
    thread: str
    t: float
    origin: str | None = None
    phase: str | None = None


class GroupRecord(NamedTuple):
    """One rank's record of one process group.

    Attributes:
        name: The group's name (the same on every rank; ``"0"`` is the default group).
        ranks: Its members' global ranks (:func:`group_members`: a ``range`` where they
            are evenly spaced, else a tuple).
        count: Collectives issued on it so far (its sequence number: C++ callers such as
            DDP's gradient all-reduce count too).
        last: The last few issued from Python, oldest first.
    """

    name: str
    ranks: Sequence[int]
    count: int
    last: tuple[Issued, ...]


class Mark(NamedTuple):
    """The end of a DDP forward, as the ring keeps it: where its backward's buckets start.

    Attributes:
        start: The group's count when the forward began.
        end: The group's count when it returned.
        reduces: Whether a backward with gradient all-reduces follows (grad enabled, not
            inside ``no_sync()``).
        ddp: The DDP module's index in the names' ``ddp`` list (its buckets).
        phase: The phase the forward ran in, e.g. ``"train batch 5"``.
        thread: The thread that ran it.
        t: Unix time when it returned.
    """

    start: int
    end: int
    reduces: bool
    ddp: int
    phase: str | None
    thread: str
    t: float


def members_json(members: Sequence[int]) -> list[int] | dict[str, list[int]]:
    """A group's members as a record file keeps them (:func:`group_members` reads them back).

    A range as its three numbers: every rank's file would otherwise list every member of
    the default group (1.6 GB of files at 16,384 ranks, for ``rankguard report`` to read).
    """
    if isinstance(members, range):
        return {"range": [members.start, members.stop, members.step]}
    return list(members)


def group_members(ranks: Iterable[int] | dict) -> tuple[int, ...] | range:
    """A group's members as its record keeps them: a ``range`` where they are evenly spaced.

    Every status carries its rank's record, and rank 0 reads every rank's status: the
    default group's members as a tuple would make each status grow with the world
    size (48 KB at 16,384 ranks) and each exchange with its square. A range pickles
    in a few bytes whatever its length (a data- or tensor-parallel group's members
    are evenly spaced too); other groups stay a tuple. Two or fewer members stay a
    tuple (the same bytes either way).
    """
    if isinstance(ranks, dict):  # as a record file keeps a range (members_json)
        return range(*ranks["range"])
    if isinstance(ranks, range):
        return ranks
    members = tuple(ranks)
    if len(members) > 2:
        step = members[1] - members[0]
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(members)):
            return range(members[0], members[-1] + 1, step)
    return members


class Difference(NamedTuple):
    """The first collective of a group where the ranks' records differ.

    Attributes:
        group: The group's name.
        members: Its members' global ranks.
        seq: The first collective number that differs.
        kind: ``"count"`` (some members never issued it) or ``"call"`` (issued by
            all, but not the same call: op, type or size).
        counts: Each member's count.
        issued: Each member's collective number ``seq`` where its record holds it.
    """

    group: str
    members: tuple[int, ...]
    seq: int
    kind: str
    counts: Mapping[int, int]
    issued: Mapping[int, Issued | None]


def same_call(a: Issued, b: Issued) -> bool:
    """Whether two ranks' collectives at one number can pair: the same op, and size if sized.

    Where a framework issued both (:attr:`Issued.origin`), the same origin too: FSDP's
    all-gather of one layer for a backward and of another for a forward pair on gloo when
    their sizes match, but they are not the same call. A size not known on one side (a DDP
    bucket told before its rank's logger had the rebuilt sizes) never differs.
    """
    if a.op != b.op:
        return False
    if a.origin is not None and b.origin is not None and a.origin != b.origin:
        return False
    if a.op not in SIZED_OPS or a.numel < 0 or b.numel < 0:
        return True
    return (a.dtype, a.numel) == (b.dtype, b.numel)


def origin_text(issued: Issued) -> str | None:
    """What issued a framework's collective, in its phase; ``None`` for the user's own.

    E.g. ``"gradient bucket 0 of train batch 5's backward (DDP)"``.
    """
    if issued.origin is None:
        return None
    at = issued.phase
    return issued.origin.replace("{at}'s", f"{at}'s" if at else "a").replace("{at}", at or "?")


def _by_group(records: Mapping[int, Sequence[GroupRecord]]) -> dict[str, dict[int, GroupRecord]]:
    groups: dict[str, dict[int, GroupRecord]] = {}
    for rank, recs in records.items():
        for rec in recs:
            groups.setdefault(rec.name, {})[rank] = rec
    return groups


def _p2p(recs: Iterable[GroupRecord]) -> bool:
    return any(i.op in P2P_OPS for rec in recs for i in rec.last)


def differences(records: Mapping[int, Sequence[GroupRecord]]) -> list[Difference]:
    """Per group, the first collective where the ranks' records differ.

    A member that sends a record but none of this group never issued on it
    (count 0). Groups where point-to-point calls were seen are compared by
    their calls only (their counts differ by design).

    Args:
        records: Each rank's record (ranks without a recorder are left out).

    Returns:
        Per group at most one count difference and one call difference (at the first
        number every member holds), count differences first, then by group name.
    """
    found = []
    for name, recs in sorted(_by_group(records).items()):
        members = max((rec.ranks for rec in recs.values()), key=len)
        members = tuple(r for r in members if r in records) or tuple(sorted(recs))
        counts = {r: recs[r].count if r in recs else 0 for r in members}
        issued = {r: {i.seq: i for i in recs[r].last} if r in recs else {} for r in members}
        if len(set(counts.values())) > 1 and not _p2p(recs.values()):
            seq = min(counts.values()) + 1
            at = {r: issued[r].get(seq) for r in members}
            found.append(Difference(name, members, seq, "count", counts, at))
        for seq in sorted(set.intersection(*(set(i) for i in issued.values()))):
            calls = [issued[r][seq] for r in members]
            if not all(same_call(calls[0], c) for c in calls[1:]):
                at = {r: issued[r][seq] for r in members}
                found.append(Difference(name, members, seq, "call", counts, at))
                break
    found.sort(key=lambda d: (d.kind != "count", d.group))
    return found


def ahead(diff: Difference) -> list[int]:
    """Members that issued collective ``seq`` of a count difference: it waits for the rest."""
    low = min(diff.counts.values())
    return [r for r, c in diff.counts.items() if c > low]


def describe_issued(issued: Issued | None, previous_thread: str | None = None) -> str:
    """One collective in words, e.g. ``"all_reduce float32[4] at train.py:88 (log): ..."``."""
    if issued is None:
        return "not issued"
    count = f"{issued.numel:,}" if issued.numel >= 0 else "?"
    unsized = issued.op in ("barrier", "monitored_barrier") or issued.dtype == "-"
    size = "" if unsized else f" {issued.dtype}[{count}]"
    origin = origin_text(issued)
    where = (f", {origin}" if origin else "") + (f" at {issued.where}" if issued.where else "")
    thread = f", thread {issued.thread}" if issued.thread else ""
    if previous_thread and issued.thread and previous_thread != issued.thread:
        thread += f" (the group's previous collective came from thread {previous_thread})"
    return f"{issued.op}{size}{where}{thread}"


def group_label(diff: Difference) -> str:
    """The group of a difference in words, e.g. ``"group 1 (ranks 0,1)"``."""
    name = "the default group" if diff.group == DEFAULT_GROUP else f"group {diff.group}"
    return f"{name} (ranks {rank_label(diff.members).removeprefix('ranks ').removeprefix('rank ')})"


def _previous_thread(records: Mapping[int, Sequence[GroupRecord]], diff: Difference, rank: int):
    for rec in records.get(rank, ()):
        if rec.name == diff.group:
            before = [i for i in rec.last if i.seq < diff.seq]
            return before[-1].thread if before else None
    return None


def describe_difference(records: Mapping[int, Sequence[GroupRecord]], diff: Difference) -> str:
    """A group's counts per rank and its first differing collective per rank, in one line."""
    counts = "; ".join(
        f"{rank_label(ranks)} issued {count}" for ranks, count in group_ranks(dict(diff.counts))[:8]
    )
    calls = {
        r: describe_issued(i, _previous_thread(records, diff, r))
        if i is not None or diff.counts[r] < diff.seq
        else UNDESCRIBED
        for r, i in diff.issued.items()
    }
    at = "; ".join(f"{rank_label(ranks)}: {call}" for ranks, call in group_ranks(calls)[:8])
    return f"{group_label(diff)}: {counts}; collective #{diff.seq}: {at}"


def in_backward(issued: Issued | None) -> bool:
    """Whether a framework issued it in a backward (DDP's buckets, FSDP's backward hooks)."""
    return issued is not None and issued.origin is not None and "'s backward" in issued.origin


def odd_rank(diff: Difference) -> int:
    """The rank whose record differs: the fewest alike; among equals the earliest issue.

    Between a call a framework issued in a backward and one issued in a forward (a rank
    that skipped a backward, or ran a forward more), the forward's side is the odd one.
    """
    if diff.kind == "count":
        front = ahead(diff)
        issued = set(front)  # a set: the members are the whole world's at its size
        behind = [r for r in diff.members if r not in issued]
        side = front if len(front) <= len(behind) else behind
    else:
        calls = {r: (i.op, i.dtype, i.numel, i.origin) for r, i in diff.issued.items() if i}
        groups = group_ranks(calls)
        side = min(groups, key=lambda g: (len(g[0]), in_backward(diff.issued.get(g[0][0]))))[0]
    return min(side, key=lambda r: (diff.issued[r].t if diff.issued.get(r) else float("inf"), r))


def first_difference(diffs: Sequence[Difference]) -> Difference:
    """The difference that split the ranks: the one whose odd collective was issued first."""

    def issued_at(diff: Difference) -> float:
        call = diff.issued.get(odd_rank(diff))
        return call.t if call is not None else float("inf")

    return min(diffs, key=lambda d: (issued_at(d), d.group))


def last_call(records: Mapping[int, Sequence[GroupRecord]], diff: Difference) -> bool:
    """Whether a call difference's group ends in unlike calls (in flight, paired unlike).

    Every member issued the same count, and their last collectives differ: ``diff``'s
    or a later one.
    """
    counts = set(diff.counts.values())
    if len(counts) != 1:
        return False
    (count,) = counts
    if count == diff.seq:
        return True
    lasts = [
        next((i for i in rec.last if i.seq == count), None)
        for rank, recs in records.items()
        if rank in diff.counts
        for rec in recs
        if rec.name == diff.group
    ]
    if len(lasts) != len(diff.counts) or any(i is None for i in lasts):
        return False
    return not all(same_call(lasts[0], i) for i in lasts[1:])  # type: ignore[arg-type]


def mismatch_warning(records: Mapping[int, Sequence[GroupRecord]]) -> tuple[str, str] | None:
    """Ranks that paired unlike collectives at one count while the job runs, or ``None``.

    Gloo pairs the calls with whatever partner issued the same number; NCCL with
    equal sizes reduces garbage: neither hangs. Only numbers every member's record
    holds are compared.

    Returns:
        A key (group and number, to tell it once) and the message.
    """
    calls = [d for d in differences(records) if d.kind == "call"]
    if not calls:
        return None
    diff = calls[0]
    odd = odd_rank(diff)
    text = (
        "collectives issued at the same count differ between ranks, so they were paired with "
        f"the wrong partner: {describe_difference(records, diff)}. Fix the code path of rank "
        f"{odd}: the ranks must issue the same collectives in the same order (on gloo a "
        "different size aborts the job, on NCCL equal sizes reduce the wrong values)."
    )
    return f"{diff.group}#{diff.seq}", text


def describe_records(records: Mapping[int, Sequence[GroupRecord]], last: int = 4) -> str:
    """Each rank's last collectives per group and the first point where ranks differ.

    What ``rankguard report DIR`` prints from the record files a rank leaves
    behind, even one killed by SIGKILL or aborted by SIGABRT.
    """
    lines = ["Collectives each rank issued last (its record file), per process group:"]
    for rank, recs in sorted(records.items()):
        for rec in recs:
            if not rec.last:
                continue
            name = "default group" if rec.name == DEFAULT_GROUP else f"group {rec.name}"
            lines.append(f"  rank {rank}, {name}: {rec.count} issued; the last:")
            previous = None
            for call in rec.last[-last:]:
                lines.append(f"    #{call.seq} {describe_issued(call, previous)}")
                previous = call.thread
    diffs = differences(records)
    if len(records) < 2:
        lines.append("Only one rank's record: nothing to compare.")
    elif not diffs:
        lines.append("The ranks' records agree where they overlap.")
    for diff in diffs:
        lines.append(f"First difference: {describe_difference(records, diff)}")
    return "\n".join(lines) + "\n"
