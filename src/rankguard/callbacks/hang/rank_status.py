"""This rank's status for the exchange, built from plain facts the watchdog gathered.

Pure: :func:`rank_status` is the one place a :class:`RankStatus` is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from rankguard.callbacks.hang.deadlines import Settle
from rankguard.callbacks.hang.history import Phases
from rankguard.callbacks.hang.kinds import Phase
from rankguard.callbacks.hang.phases import Beat, Decision
from rankguard.callbacks.hang.stacks import blocked_in, called_from_user, user_frame
from rankguard.callbacks.hang.status import LEFT_LOOP, GaveUp, RankStatus
from rankguard.callbacks.hang.verdict_text import left_at, phase_label

__all__ = ["rank_status"]


def rank_status(
    beat: Beat,
    stack: Sequence[tuple[str, int, str]],
    waits_at: str | None,
    wait_s: float,
    *,
    now: float,
    deadlines: Mapping[str, float],
    ceilings: Mapping[str, float],
    settle: Settle,
    libraries: Iterable[str],
    host: str,
    pid: int,
    gave_up: GaveUp | None,
    progress: int,
    usual: bool,
    decisions: Mapping[str, Decision],
    record: tuple,
    quiet_s: float,
    loop_thread: str | None = None,
    phases: Phases | None = None,
    since_verdict_s: float | None = None,
) -> RankStatus:
    """This rank's status: its phase, idle time, deadlines, where its loop waits, its record.

    A wait counts as settled past ``settle.stack_s``, a record as quiet past
    ``settle.record_s``. After fit end (``beat.kind == "done"``) the rank left the
    training loop and never comes back to a rendezvous in it: its status says so,
    settled, which with another rank waiting at one is a proven deadlock.

    Args:
        beat: The last heartbeat.
        stack: The training loop's frames, innermost first.
        waits_at: The rendezvous the loop waits at, or ``None``.
        wait_s: How long it has waited there.
        now: The time now (the step log's clock).
        deadlines: The deadline per phase kind now.
        ceilings: The ceiling per phase kind.
        settle: The settle times.
        libraries: Library paths (a user frame is in none).
        host: This host's name.
        pid: This process's id.
        gave_up: An exchange this rank gave up waiting in, or ``None``.
        progress: Heartbeats read so far.
        usual: Whether the wait is one the loop came out of before.
        decisions: The decisions that can split the ranks, by name.
        record: The collectives this rank issued, per group (``()`` without a record).
        quiet_s: How long this rank made no progress and issued no collective.
        loop_thread: The name of the thread that runs the training loop.
        phases: What this rank ran lately, batch by batch.
        since_verdict_s: Seconds since this rank received the last exchange's verdict,
            or ``None`` before the first.
    """
    event, step, batch_index, loader, since, kind = beat
    done = kind == Phase.DONE
    status = RankStatus(
        phase=phase_label(event, step, batch_index, loader),
        step=step,
        idle_s=round(now - since, 3),
        deadline_s=None if done else deadlines[kind],
        host=host,
        pid=pid,
        blocked_in=blocked_in(stack),
        ceiling_s=None if done else ceilings[kind],
        gave_up=gave_up,
        user_frame=user_frame(stack, libraries),
        waits_at=waits_at,
        wait_s=round(wait_s, 3),
        settled=waits_at is not None and wait_s >= settle.stack_s,
        progress=progress,
        usual=usual,
        direct=waits_at is not None and called_from_user(stack, libraries),
        decisions=tuple((n, v, s) for n, (v, s) in sorted(decisions.items())),
        record=record,
        quiet=quiet_s >= settle.record_s,
        loop_thread=loop_thread,
        phases=phases,
        since_verdict_s=None if since_verdict_s is None else round(since_verdict_s, 3),
    )
    if not done:
        return status
    # Fit ended here: this rank left the training loop and never comes back to a
    # rendezvous in it; while another rank waits at one, that is a proven deadlock.
    left = replace(status, waits_at=LEFT_LOOP, wait_s=status.idle_s, settled=True)
    return replace(left, phase=left_at(left), direct=False, usual=False)
