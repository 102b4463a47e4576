"""What each rank's watchdog sends at a status exchange, and the verdict the deciding rank returns.

Plain values only: :mod:`rankguard.callbacks.hang.verdict` decides from them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rankguard.callbacks.hang.collective_compare import GroupRecord
from rankguard.callbacks.hang.history import Phases
from rankguard.callbacks.hang.kinds import Phase

__all__ = [
    "DEADLOCK_EXIT_CODE",
    "EXIT_CODES",
    "EXIT_MEANINGS",
    "HANG_EXIT_CODE",
    "KINDS",
    "LEFT_LOOP",
    "GaveUp",
    "RankStatus",
    "Runs",
    "Verdict",
    "in_runs",
    "to_runs",
]

#: Exit code of every rank on a proven deadlock or desync: the code path differs between
#: ranks, so a restart replays it; 70 is EX_SOFTWARE ("fix the code").
DEADLOCK_EXIT_CODE = 70
#: Exit code of every rank that ends a stall or a lost rank (``action="abort"``); 75 is
#: EX_TEMPFAIL ("restart me").
HANG_EXIT_CODE = 75

#: Phase kinds, each with its own deadline. ``done`` (after fit end) has none.
KINDS = tuple(Phase)

#: The wait point of a rank whose fit ended (``waits_at``): it left the training loop and
#: can never reach a rendezvous the others wait at in it.
LEFT_LOOP = "left the training loop"

#: Every end rankguard causes and its exit code (``None``: training goes on): the one
#: table production reads (the verdict's classes, then the families of a rank's fault).
EXIT_CODES: dict[str, int | None] = {
    "healthy": None,
    "slow": None,  # a rank past its calibrated deadline: reported, training goes on
    "stall": HANG_EXIT_CODE,  # at the ceiling, or a check gave up waiting: restart
    "gone": HANG_EXIT_CODE,  # a rank stopped answering or its process ended: restart
    "deadlock": DEADLOCK_EXIT_CODE,  # proven from where every rank waits
    "desync": DEADLOCK_EXIT_CODE,  # proven from what every rank issued
    "race": DEADLOCK_EXIT_CODE,  # two threads of a rank on one process group, proven
    "code": DEADLOCK_EXIT_CODE,  # a rank raised ValueError, AssertionError...: fix it
    "transient": HANG_EXIT_CODE,  # out of memory, CUDA/NCCL, storage, a dead loader worker
    "communication": HANG_EXIT_CODE,  # a collective or store failed: a peer's fault
    "interrupted": HANG_EXIT_CODE,  # KeyboardInterrupt, SystemExit on a signal
    "preempted": HANG_EXIT_CODE,  # a stop signal every rank stopped on, at one step: restart
    "left": DEADLOCK_EXIT_CODE,  # a rank's fit ended early while the others trained: fix it
}
#: What each end of :data:`EXIT_CODES` is, in the README's exit-code table (same keys).
EXIT_MEANINGS: dict[str, str] = {
    "healthy": "",
    "slow": "",
    "stall": "a rank stalled past its phase's ceiling, or a rankguard check gave up on it",
    "gone": "a rank stopped answering: frozen, killed, a lost node",
    "deadlock": "a proven deadlock: every rank waits at a rendezvous the others never reach",
    "desync": "a proven desync: a rank waits for a collective its peers never issued",
    "race": "two threads of a rank issued collectives on one process group, in another "
    "order than on another rank (a background save and the training thread)",
    "code": "a rank raised a code fault (`ValueError`, `AssertionError`, ...)",
    "transient": "a rank raised a transient fault (out of memory, CUDA or NCCL, storage, a "
    "loader worker that died)",
    "communication": "a rank's collective or store failed (a peer's fault first)",
    "interrupted": "a rank was interrupted (`KeyboardInterrupt`, `SystemExit`)",
    "preempted": "a preemption signal every rank stopped on, after one agreed step",
    "left": "a rank's fit ended early, without an error, while the others still trained",
}

Runs = tuple[tuple[int, int], ...]
#: An exchange a rank gave up waiting in: (exchange name, the ranks missing, its timeout).
GaveUp = tuple[str, tuple[int, ...], float]


def to_runs(ranks: Iterable[int]) -> Runs:
    """Compresses ranks into sorted ``(first, last)`` runs."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return tuple(runs)


def in_runs(rank: int, runs: Runs) -> bool:
    """Whether ``rank`` lies in one of ``runs``."""
    return any(first <= rank <= last for first, last in runs)


@dataclass(frozen=True)
class RankStatus:
    """What one rank's watchdog thread sends at each exchange.

    Where the rank's *training thread* is: at a rendezvous it cannot leave
    alone (``waits_at``: a collective, a barrier, backward, a rankguard
    exchange; :data:`LEFT_LOOP` once its fit ended), blocked in other
    cross-rank code (``blocked_in``), or else in its own code (computing,
    sleeping, or at a host sync the stack cannot tell apart).

    Attributes:
        phase: Where the main thread is, e.g. ``"eval batch 3 of 'eval'"``.
        step: Global train step at the last heartbeat.
        idle_s: Seconds since the last heartbeat (progress).
        deadline_s: The deadline of the current phase (calibrated, at most the
            ceiling), or ``None`` (fit ended): past it, the rank is reported.
        host: Host name.
        pid: Process id.
        blocked_in: The cross-rank call the training loop is blocked in, with
            its call site (:func:`~rankguard.callbacks.hang.stacks.blocked_in`), or ``None``.
        ceiling_s: The phase's configured (or NCCL-fitted) deadline: past it,
            the incident ends (abort); ``None`` means the same as ``deadline_s``.
        gave_up: A rankguard exchange this rank stopped waiting in because some
            ranks never came, or ``None``: those ranks are stuck, now.
        user_frame: The innermost frame of the user's own code in the training
            loop, with its source line, or ``None``.
        waits_at: The rendezvous the training loop waits at
            (:func:`~rankguard.callbacks.hang.stacks.rendezvous`), or ``None``;
            :data:`LEFT_LOOP` once fit ended.
        wait_s: How long it has been seen waiting there (sampled).
        settled: Whether ``wait_s`` is past this rank's settle time: a wait
            this long is no longer a collective on its way.
        progress: Heartbeats so far (unchanged between two samples: no progress).
        usual: Whether this rank had seen its wait point before, healthy.
        direct: Whether the user's own code calls the rendezvous (not a framework).
        decisions: ``(name, value, step)`` of the decisions that can split the
            ranks (a stop decision, the metric names synced in a step, ``save``),
            as last reported.
        record: The collectives this rank issued, per process group (see
            :mod:`~rankguard.callbacks.hang.collectives`); ``()`` without a record.
        quiet: Whether it made no progress and issued no collective for its settle time.
        loop_thread: The name of the thread that runs the training loop (the record
            names the thread of each collective), or ``None`` where unknown.
        phases: What the rank ran lately, batch by batch (its backward passes, optimizer
            steps, what ran after each batch), or ``None`` where unknown: the verdict
            compares them to say what split the ranks.
        since_verdict_s: Seconds from the last exchange's verdict, as this rank received
            it, to this status (the same instant on every rank, within the store's round
            trip), or ``None`` before the first. Statuses of one exchange built at
            different times (a rank that exchanged once more than the others, and sent
            this one early) are told apart by it.
    """

    phase: str
    step: int
    idle_s: float
    deadline_s: float | None
    host: str
    pid: int
    blocked_in: str | None = None
    ceiling_s: float | None = None
    gave_up: GaveUp | None = None
    user_frame: str | None = None
    waits_at: str | None = None
    wait_s: float = 0.0
    settled: bool = False
    progress: int = 0
    usual: bool = False
    direct: bool = False
    decisions: tuple[tuple[str, Any, int | None], ...] = ()
    record: tuple[GroupRecord, ...] = ()
    quiet: bool = False
    loop_thread: str | None = None
    phases: Phases | None = None
    since_verdict_s: float | None = None

    @property
    def overdue(self) -> bool:
        """Whether the rank is past its deadline."""
        return self.deadline_s is not None and self.idle_s > self.deadline_s

    @property
    def ceiling(self) -> float | None:
        """The phase's ceiling (its deadline when none was given)."""
        return self.deadline_s if self.ceiling_s is None else self.ceiling_s

    @property
    def past_ceiling(self) -> bool:
        """Whether the rank is past its phase's ceiling."""
        ceiling = self.ceiling
        return ceiling is not None and self.idle_s > ceiling

    @property
    def left(self) -> bool:
        """Whether this rank's fit ended: it left the training loop."""
        return self.waits_at == LEFT_LOOP

    def limits(self) -> str:
        """``"deadline 4 s"``, or ``"deadline 30 s, calibrated; ceiling 600 s"``."""
        if self.deadline_s is None:
            return "deadline none"
        if self.ceiling is None or self.ceiling == self.deadline_s:
            return f"deadline {self.deadline_s:g} s"
        return f"deadline {self.deadline_s:g} s, calibrated; ceiling {self.ceiling:g} s"


@dataclass(frozen=True)
class Verdict:
    """The deciding rank's verdict, the same on every rank; its size does not grow per rank.

    Attributes:
        stuck: The ranks it names as the cause, as ``(first, last)`` runs (every
            rank for a proven deadlock or desync).
        summary: One line: the cause and what the others are doing (empty when healthy).
        details: One line per stuck rank (at most 16), with host and pid, then
            where each group of ranks is and what split them.
        phases: Every rank's phase, grouped (the last known state, kept for
            reporting ranks that stop answering).
        done: Ranks whose fit has ended, as runs.
        slack_s: The longest any running rank may still go without progress
            before passing its deadline (``inf`` when no rank has a deadline).
        first: The rank to read first (it stopped first, or its code path is
            the odd one), or ``None``.
        end: Whether the incident ends now (stage 2): a stuck rank is past its
            ceiling, or a rank gave up waiting for it in another check's exchange.
        ceiling_slack_s: As ``slack_s``, up to the ceilings.
        kind: The class: ``"healthy"``, ``"slow"`` (past a calibrated deadline,
            within the ceiling), ``"stall"`` (past the ceiling, or a check gave up
            waiting), ``"deadlock"``, ``"desync"`` or ``"race"`` (two threads on one
            process group; proven: exit :data:`DEADLOCK_EXIT_CODE`); ``"gone"`` is
            :func:`~rankguard.callbacks.hang.verdict.gone`'s.
        suspect: The fingerprint of a proof seen once, to confirm at the next
            exchange (which then comes at once), or ``None``.
        mismatch: Collectives paired with the wrong partner while the job runs
            (a key to tell it once, and the message), or ``None``.
        recheck: Whether a rank's status was built well before a named rank's (it
            says nothing of that rank since): not acted on, asked again at once.
    """

    stuck: Runs
    summary: str
    details: tuple[str, ...]
    phases: str
    done: Runs
    slack_s: float
    first: int | None = None
    end: bool = False
    ceiling_slack_s: float = math.inf
    kind: str = "healthy"
    suspect: str | None = None
    mismatch: tuple[str, str] | None = None
    recheck: bool = False

    @property
    def deadlock(self) -> bool:
        """Whether it is proven (a deadlock, a desync, a race): the job ends now with 70."""
        return self.kind in ("deadlock", "desync", "race")

    @property
    def exit_code(self) -> int | None:
        """The exit code this class ends the job with, or ``None`` while it goes on.

        ``"slow"`` goes on; it becomes ``"stall"`` (75) when ``end`` is set.
        """
        return EXIT_CODES[self.kind]
