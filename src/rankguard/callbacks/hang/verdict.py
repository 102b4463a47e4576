"""The hang verdict: one pure function from every rank's status to healthy, slow, stall or proof.

The rule is written once, in docs/hang.md#the-verdict; ``tests/hang/test_verdict_cases.py``
pins it down case by case. The watchdog only gathers statuses, asks, and acts.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from rankguard.callbacks.core.events import SplitDecision
from rankguard.callbacks.core.ranks import group_ranks
from rankguard.callbacks.hang.cause import lead_with, split_cause
from rankguard.callbacks.hang.collective_compare import (
    Difference,
    GroupRecord,
    Issued,
    ahead,
    differences,
    first_difference,
    last_call,
    mismatch_warning,
    odd_rank,
)
from rankguard.callbacks.hang.collective_threads import describe_race, foreign, race
from rankguard.callbacks.hang.status import RankStatus, Runs, Verdict, in_runs, to_runs
from rankguard.callbacks.hang.verdict_text import (
    describe_deadlock,
    describe_desync,
    describe_frozen,
    gave_up_lines,
    grouped,
    next_step,
    point,
    record_lines,
    split_sentence,
    stop_of,
    stuck_lines,
    where_lines,
)

__all__ = [
    "Proof",
    "deadlock_key",
    "diagnose",
    "gone",
    "held_by_own_collective",
    "record_proof",
    "sent_apart",
]


#: How far apart the statuses of one exchange may be built and still be judged together
#: (seconds): ranks that exchange in step build theirs within milliseconds of each other
#: (a loaded host's scheduling, some hundreds); one sent an exchange early is seconds apart.
BUILT_WITHIN_S = 0.5


class Proof(NamedTuple):
    """A deadlock or desync seen at one exchange: proven when the next sees the same ``key``.

    ``decisive``: the records say more than where the ranks wait (two threads on one
    group, or unlike calls DDP or FSDP issued on every side): told before a deadlock from
    the stacks. Where the user's own collective is one side, the stacks name its line.
    """

    kind: str  # "deadlock" (where every rank waits), "desync" or "race" (what was issued)
    key: str
    summary: str
    details: tuple[str, ...]
    first: int
    decisive: bool = False


def diagnose(
    statuses: Mapping[int, RankStatus],
    incident: Runs = (),
    suspect: str | None = None,
    split_decisions: Mapping[str, SplitDecision] | None = None,
    rechecked: bool = False,
) -> Verdict:
    """The verdict on every rank's status (the ``decide`` of the status exchange, on rank 0).

    In order: a proof (a deadlock from where every rank's training thread waits,
    or a desync from what every rank issued), seen at two exchanges a second
    apart without progress (``suspect`` is the first one's fingerprint); else
    the ranks past their deadline that are not only waiting for others (slow,
    or a stall at the ceiling or where a check gave up waiting for them); else
    healthy. Collectives paired with unlike partners are told beside any class.

    A slow or stalled rank is named only beside statuses of the other ranks built when
    its own was: where one was built earlier (:func:`sent_apart`), the verdict is asked
    again at once (:attr:`Verdict.recheck`), once.

    Args:
        statuses: Every rank's status.
        incident: The stuck ranks of the open incident (``()`` when none): they
            stay its cause while they are past their deadline.
        suspect: :attr:`Verdict.suspect` of the previous exchange.
        split_decisions: The adapter's words for its decisions (stop decisions and their fixes).
        rechecked: Whether the previous exchange's verdict was a recheck: this one is
            acted on whatever its statuses' ages.

    Returns:
        A verdict whose summary reads e.g. ``"rank 1 stuck 61 s in eval batch
        3 of 'eval' (deadline 60 s); ranks 0,2,3 waiting 58 s in train batch 2001"``.
    """
    verdict = _judged(statuses, incident, suspect, split_decisions or {})
    if (
        rechecked
        or verdict.deadlock
        or not verdict.stuck
        or not sent_apart(statuses, verdict.stuck)
    ):
        return verdict
    # No suspicion either: a proof needs two sightings a second apart, and the next comes now.
    return replace(verdict, recheck=True, suspect=None)


def sent_apart(statuses: Mapping[int, RankStatus], stuck: Runs) -> list[int]:
    """The ranks, not in ``stuck``, whose status was built well before a stuck rank's.

    A rank that exchanged once more than the others sent its status early and waited
    for theirs: it may have stopped since (a process frozen, a node gone) while a rank
    waiting for it (at a collective, or at its next host sync on NCCL) went past its
    deadline. Only a status built when the stuck rank's was says the rank still answers.
    Times are :attr:`RankStatus.since_verdict_s`, the same origin on every rank; apart
    is more than :data:`BUILT_WITHIN_S`; a rank without one (its first exchange) is not
    compared.
    """
    named = (statuses[r] for first, last in stuck for r in range(first, last + 1) if r in statuses)
    built = [s.since_verdict_s for s in named if s.since_verdict_s is not None]
    if not built:
        return []
    latest = max(built)
    return [
        rank
        for rank, status in statuses.items()
        if not in_runs(rank, stuck)
        and status.since_verdict_s is not None
        and status.since_verdict_s < latest - BUILT_WITHIN_S
    ]


def _judged(
    statuses: Mapping[int, RankStatus],
    incident: Runs,
    suspect: str | None,
    split_decisions: Mapping[str, SplitDecision],
) -> Verdict:
    """:func:`diagnose`'s verdict, whenever each status was sent."""
    records = _records(statuses)
    verdict = _stalled(statuses, incident, split_decisions, records)
    if records:
        verdict = replace(verdict, mismatch=mismatch_warning(records))
    stack_key = deadlock_key(statuses)
    recorded = record_proof(statuses, records)
    keys = {key for key in (stack_key, recorded.key if recorded else None) if key}
    if not keys:
        return verdict
    if recorded is not None and recorded.decisive:
        stack_key = None  # the records name the calls: told before where the ranks wait
    if suspect not in keys:
        return replace(verdict, suspect=stack_key or recorded.key)  # type: ignore[union-attr]
    if stack_key is not None:  # the stack proof where it sees too: the record's lines added
        first = odd_rank_of(statuses, split_decisions)
        summary, details = describe_deadlock(statuses, first, split_decisions)
        proof = Proof("deadlock", stack_key, summary, (*details, *record_lines(records)), first)
    else:
        split = split_sentence(statuses, split_decisions)
        what = (f"What split them: {split}",) if split else ()
        proof = recorded._replace(details=(*what, *recorded.details))  # type: ignore[union-attr]
    cause = split_cause(statuses, split_decisions)  # what split them, from each rank's history
    if cause is not None:
        summary, details = lead_with(cause, proof.kind, proof.summary, proof.details)
        proof = proof._replace(summary=summary, details=details, first=cause.first)
    return replace(
        verdict,
        kind=proof.kind,
        stuck=to_runs(statuses),
        summary=proof.summary,
        details=(*proof.details, *where_lines(statuses)),
        first=proof.first,
        end=verdict.end or any(s.past_ceiling for s in statuses.values()),
    )


def _records(statuses: Mapping[int, RankStatus]) -> dict[int, tuple[GroupRecord, ...]]:
    """Every rank's record of collectives; empty unless every rank keeps one."""
    records = {r: s.record for r, s in statuses.items() if s.record}
    return records if len(records) == len(statuses) else {}


# -- slow and stalled ranks ------------------------------------------------------------------


def _stalled(
    statuses: Mapping[int, RankStatus],
    incident: Runs,
    split_decisions: Mapping[str, SplitDecision],
    records: Mapping[int, Sequence[GroupRecord]],
) -> Verdict:
    """Healthy, slow (past a calibrated deadline) or stall (past the ceiling, or given up on).

    Ranks past their deadline are stuck unless they are only blocked waiting
    for peers; when every rank past its deadline waits, the stuck ones are the
    ranks not waiting that made no progress for at least half as long (deadlines
    differ per phase). An open incident's stuck ranks stay its cause while they
    are past their deadline. Ranks another rank's check gave up waiting for are
    stuck, and end the incident at once. Where the ranks' records of collectives
    differ (a background thread's collective, say), the report says so: evidence,
    not the cause.
    """
    gave_up = sorted({s.gave_up for s in statuses.values() if s.gave_up is not None})
    missing = {r for _, ranks, _ in gave_up for r in ranks if r in statuses}
    overdue = {r: s for r, s in statuses.items() if s.overdue}
    stuck = {r: s for r, s in overdue.items() if in_runs(r, incident)}
    if missing:
        stuck = {r: statuses[r] for r in missing}
    elif not stuck:
        stuck = {r: s for r, s in overdue.items() if not s.blocked_in}
    if overdue and not stuck:
        since = min(s.idle_s for s in overdue.values()) / 2
        stuck = {
            r: s
            for r, s in statuses.items()
            if s.deadline_s is not None and not s.blocked_in and s.idle_s >= since
        } or overdue
    others = {r: s for r, s in statuses.items() if r not in stuck}
    summary, details = "", gave_up_lines(gave_up) + stuck_lines(stuck)
    if stuck:
        summary = "; ".join(
            grouped(stuck, "{who} stuck {idle:.0f} s in {phase} ({limits}{and_where})")
            + grouped(others, "{who} waiting {idle:.0f} s {in_phase}{where}")
        )
        split = split_sentence(statuses, split_decisions)
        details += (*where_lines(statuses), *([f"What split them: {split}"] if split else []))
        details += record_lines(records)
    first = max(stuck, key=lambda r: (stuck[r].idle_s, -r)) if stuck else None
    if stuck:
        details += (next_step(first, ()),)
    end = bool(missing) or any(s.past_ceiling for s in stuck.values())
    running = [s for s in statuses.values() if s.deadline_s is not None]
    return Verdict(
        stuck=to_runs(stuck),
        summary=summary,
        details=details,
        phases="; ".join(grouped(statuses, "{who} {in_phase}{where}")),
        done=to_runs(r for r, s in statuses.items() if s.deadline_s is None),
        slack_s=max((s.deadline_s - s.idle_s for s in running), default=math.inf),  # type: ignore[operator]
        first=first,
        end=end,
        ceiling_slack_s=max((s.ceiling - s.idle_s for s in running), default=math.inf),  # type: ignore[operator]
        kind=("stall" if end else "slow") if stuck else "healthy",
    )


# -- a deadlock proven from where every rank waits -------------------------------------------


def deadlock_key(statuses: Mapping[int, RankStatus]) -> str | None:
    """A fingerprint of a deadlock seen from where every rank waits, or ``None``.

    Every rank's training thread waits at a rendezvous (``waits_at``) for at
    least its settle time (``settled``), and not all at the same one (wait point
    and the user's frame): then no rank can ever go on. A rank whose fit ended
    counts as waiting elsewhere (every rank having left is a normal end). A rank
    in its own code (computing, loading, saving, sleeping) is at no rendezvous,
    so a slow rank never makes a deadlock.
    """
    if len(statuses) < 2 or not all(s.settled and s.waits_at for s in statuses.values()):
        return None
    if len({point(s) for s in statuses.values()}) < 2:
        return None
    state = repr(sorted((r, s.progress, point(s)) for r, s in statuses.items()))
    return hashlib.sha1(state.encode()).hexdigest()[:16]


def odd_rank_of(
    statuses: Mapping[int, RankStatus], split_decisions: Mapping[str, SplitDecision]
) -> int:
    """The rank to look at first in a deadlock: its wait point differs from the others' usual one.

    A rank that left the training loop while the others wait in it comes
    first, then one that set a stop decision while others did not. Else the
    smallest group of ranks sharing a wait point; among equal groups, one whose
    rendezvous the user's own code calls (``direct``) before one its rank had
    seen healthy (``usual``), and backward and rankguard's own exchanges, where
    ranks wait every step or epoch, last.
    """
    for alone in (lambda s: s.left, lambda s: stop_of(s, split_decisions) is not None):
        ranks = sorted(r for r, s in statuses.items() if alone(s))
        if ranks and len(ranks) < len(statuses):
            return ranks[0]
    groups = group_ranks({r: point(s) for r, s in statuses.items()})

    def score(group: tuple[list[int], str]) -> tuple[int, int, int, int, int]:
        ranks, _ = group
        sample = statuses[ranks[0]]
        routine = sample.waits_at in ("backward", "rankguard exchange")
        usual = all(statuses[r].usual for r in ranks)
        return (len(ranks), int(not sample.direct), int(usual), int(routine), ranks[0])

    return min(groups, key=score)[0][0]


# -- a desync proven from what every rank issued ---------------------------------------------


def held_by_own_collective(
    rank: int,
    status: RankStatus,
    records: Mapping[int, Sequence[GroupRecord]],
    counts: Sequence[Difference],
) -> bool:
    """Whether this rank's training thread issued a collective no peer issued (it waits on it).

    A collective the training thread issued (or one issued from C++, which the
    record cannot attribute: DDP's gradient all-reduce) that a member of its
    group never issued holds the thread at its next host sync or ``wait()``.
    One that only another thread of the rank issued (a bookkeeping or
    checkpoint thread) is evidence to report, not proof that the training
    thread waits behind it: it may be computing or sleeping in its own code.

    ``counts`` are the groups' count differences (:func:`differences`, computed
    once for every rank).
    """
    for diff in counts:
        if rank not in ahead(diff):
            continue
        low = min(diff.counts.values())
        own = {i.seq: i for rec in records[rank] if rec.name == diff.group for i in rec.last}
        unmatched = [own.get(seq) for seq in range(low + 1, diff.counts[rank] + 1)]
        if any(_training_threads(i, status.loop_thread) for i in unmatched):
            return True
    return False


def _training_threads(issued: Issued | None, loop_thread: str | None) -> bool:
    """Whether the training thread issued it, or the record cannot tell.

    Its own call, or DDP's or FSDP's for its step (from C++, or from autograd's threads).
    """
    if issued is None or loop_thread in (None, issued.thread):
        return True
    return issued.origin is not None and (not issued.thread or foreign(issued.thread))


def record_proof(
    statuses: Mapping[int, RankStatus], records: Mapping[int, Sequence[GroupRecord]]
) -> Proof | None:
    """A desync seen from the ranks' records of collectives, or ``None``.

    Every rank is quiet (no progress and no collective issued for its settle
    time, or settled at a rendezvous), some group's records differ, and either
    every rank waits for a collective that can never complete (its training
    thread issued one that a member of its group never issued, its stack waits
    at a rendezvous, or it left the loop), or at one count the last collective
    of a group is a different call on different ranks (they paired unlike
    calls). A slow rank issued nothing the others did not, so it never waits here.
    Where the unlike calls at one count came from two threads on different ranks,
    two threads issue on one group: a ``"race"``
    (:mod:`~rankguard.callbacks.hang.collective_threads`).
    """
    if len(records) < 2:
        return None
    quiet = all(s.quiet or bool(s.waits_at and s.settled) for s in statuses.values())
    if not quiet:
        return None
    diffs = differences(records)
    issued = sorted((r, sorted((g.name, g.count) for g in recs)) for r, recs in records.items())
    state = repr((issued, sorted((r, s.progress) for r, s in statuses.items())))
    key = "record:" + hashlib.sha1(state.encode()).hexdigest()[:16]
    stuck = all(bool(s.waits_at and s.settled) for s in statuses.values())
    raced = race(records, diffs, waiting=stuck)
    if raced is not None:  # two threads on one group, their calls paired unlike on the ranks
        loops = {r: s.loop_thread for r, s in statuses.items()}
        summary, details, first = describe_race(records, raced, loops)
        return Proof("race", key, summary, details, first, decisive=True)
    if not diffs:
        return None
    counts = [d for d in diffs if d.kind == "count"]
    paired = [d for d in diffs if d.kind == "call" and last_call(records, d)]
    waiting = all(
        bool(s.waits_at and (s.settled or s.quiet)) or held_by_own_collective(r, s, records, counts)
        for r, s in statuses.items()
    )
    if not (waiting and counts) and not paired:
        return None
    calls = [d for d in diffs if d.kind == "call"] if waiting and counts else paired
    proven: list[Difference] = counts + calls
    first = first_difference(proven)
    odd = odd_rank(first)
    summary, details = describe_desync(records, proven, first, odd)
    framework = first.kind == "call" and all(
        i is not None and i.origin is not None for i in first.issued.values()
    )  # DDP or FSDP issued every side: the stacks say no more than "backward", "broadcast"
    return Proof("desync", key, summary, details, odd, decisive=framework)


# -- ranks that stopped answering ------------------------------------------------------------


#: How a rank heard before the first verdict was last seen (its watchdog thread started).
STARTING = "starting up (its watchdog thread started; no status exchanged yet)"


def gone(
    missing: Iterable[int],
    *,
    rank: int,
    waited_s: float,
    last: Verdict | None,
    default_s: float,
    given_up: Iterable[int] = (),
    silent: tuple[float, float] = (math.inf, math.inf),
    heard: Collection[int] | None = None,
) -> Verdict | None:
    """The verdict on ranks that stopped answering on the side channel, or ``None`` (too early).

    A rank is named once it has been silent longer than any running rank
    could go without progress at the last verdict (``last.slack_s``), so a rank
    whose Python is only briefly busy is never named; once a rank heard at the
    last verdict (or in ``heard``) is silent ``silent[0]`` seconds, whatever phase it was in (its
    watchdog thread answers while its training is only slow); or at once where a
    check gave up waiting for it too. Ranks whose fit had ended (they close at their
    own pace) and this rank itself are never named. It ends the incident (stage 2)
    where a check gave up on it, the silence passed every ceiling, or ``silent[1]``.

    Args:
        missing: Ranks the side channel named as missing.
        rank: This rank.
        waited_s: Time since the last successful exchange, counted the same
            way on every rank (failed exchanges x their timeout).
        last: The last successful verdict, or ``None`` if there was none.
        default_s: Slack before any verdict (the first-step deadline).
        given_up: Ranks a rankguard check on this rank gave up waiting for.
        silent: The silences (seconds) after which a rank heard before is named and
            the incident ends (``deadlines.liveness``).
        heard: The ranks heard from before (their watchdog thread ran); ``None``: every
            rank once there was a verdict, none before.
    """
    missing = set(missing) - {rank}
    slack = default_s if last is None else last.slack_s
    done = () if last is None else last.done
    if heard is None:
        heard = missing if last is not None else ()
    silent_long = waited_s >= silent[0]
    frozen: list[int] = []
    if not in_runs(rank, done):
        frozen = sorted(
            r
            for r in missing
            if not in_runs(r, done) and (waited_s > slack or (silent_long and r in heard))
        )
    given = set(given_up) & missing
    frozen = frozen or sorted(given)
    if not frozen:
        return None
    ceiling_slack = default_s if last is None else last.ceiling_slack_s
    phases = last.phases if last is not None else (STARTING if silent_long else None)
    return Verdict(
        stuck=to_runs(frozen),
        summary=describe_frozen(frozen, waited_s, phases),
        details=(next_step(None, frozen),),
        phases=phases or "",
        done=done,
        slack_s=slack,
        first=frozen[0],
        end=bool(given & set(frozen)) or waited_s > ceiling_slack or waited_s >= silent[1],
        kind="gone",
    )
