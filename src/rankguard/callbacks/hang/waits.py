"""Where the training loop waits, for how long, and whether to exchange statuses early.

Pure: :class:`WaitTracker` reads stacks and counts the watchdog samples, with their times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from rankguard.callbacks.hang.deadlines import Settle
from rankguard.callbacks.hang.stacks import rendezvous, user_frame

__all__ = ["MAX_USUAL", "EarlyExchange", "SeenWait", "Wait", "WaitTracker"]

#: A stack as ``(file, line, function)`` frames, innermost first.
Frames = Sequence[tuple[str, int, str]]
#: Wait points seen healthy, kept per rank (to tell the usual one from the odd one).
MAX_USUAL = 64


class Wait(NamedTuple):
    """The rendezvous the training loop waits at (read by the watchdog thread)."""

    key: str  # the wait point and the user frame that called it
    since: float  # time.perf_counter() when first seen
    progress: int  # heartbeats so far when first seen: a new one is a new wait


class SeenWait(NamedTuple):
    """The wait of the last status, and the heartbeats so far then (is it a usual one?)."""

    key: str | None
    progress: int


class EarlyExchange(NamedTuple):
    """The wait an early status exchange was last asked for, and when."""

    wait: Wait | tuple | None  # a rendezvous, or ("record", quiet since)
    at: float  # time.perf_counter()


class WaitTracker:
    """How long the loop has waited at one rendezvous, and issued nothing.

    Args:
        libraries: The library paths a user frame is not in (``library_paths()``).

    Attributes:
        wait: The rendezvous the loop waits at, or ``None``.
        quiet: ``(progress and counts of collectives, first seen at)``: unchanged since then.
        usual: Wait points the loop came out of (healthy ones), at most :data:`MAX_USUAL`.
    """

    def __init__(self, libraries: Any) -> None:
        self.libraries = libraries
        self.wait: Wait | None = None
        self.quiet: tuple[Any, float] = (None, 0.0)
        self.usual: set[str] = set()
        self._pending = SeenWait(None, 0)
        self._probed: EarlyExchange | None = None

    def sample(
        self, stack: Frames, now: float, progress: int, counts: Any
    ) -> tuple[str | None, float]:
        """Reads a sample of the loop: its rendezvous (or ``None``) and how long it waited there.

        Args:
            stack: The loop's frames, innermost first.
            now: The sample's time (the step log's clock).
            progress: Heartbeats so far: a new one starts a new wait.
            counts: This rank's counts of collectives issued (``()`` without a record).
        """
        state = (progress, counts)
        if state != self.quiet[0]:
            self.quiet = (state, now)
        point = rendezvous(stack)
        if point is None:
            self.wait = None
            return None, 0.0
        key = f"{point} at {user_frame(stack, self.libraries, source=False)}"
        wait = self.wait
        if wait is None or wait.key != key or wait.progress != progress:
            wait = self.wait = Wait(key, now, progress)
        return point, now - wait.since

    def is_usual(self, progress: int) -> bool:
        """Whether the wait now is one the loop came out of before (at each status).

        The wait of the previous status is usual once the loop made progress since.
        """
        key = self.wait.key if self.wait else None
        pending, self._pending = self._pending, SeenWait(key, progress)
        if pending.key and progress > pending.progress and len(self.usual) < MAX_USUAL:
            self.usual.add(pending.key)  # a wait the loop came out of: a healthy one
        return key in self.usual

    def quiet_s(self, now: float) -> float:
        """How long the loop has made no progress and issued no collective (as sampled)."""
        return now - self.quiet[1]

    def exchange_early(
        self, point: str | None, wait_s: float, quiet_s: float | None, settle: Settle, now: float
    ) -> bool:
        """Whether to exchange statuses now, before the period ends: the loop settled.

        It settled once it waited at one rendezvous for ``settle.stack_s``, or its
        record (``quiet_s``, ``None`` without one) was quiet for ``settle.record_s``:
        that record may prove a desync no stack shows (NCCL, async collectives wait
        later, at a host sync). A wait already exchanged is not exchanged again before
        another settle time has passed.
        """
        if point is not None and wait_s >= settle.stack_s:
            marker, again_s = self.wait, settle.stack_s
        elif quiet_s is not None and quiet_s >= settle.record_s:
            marker, again_s = ("record", self.quiet[1]), settle.record_s
        else:
            return False
        probed = self._probed
        if probed is not None and probed.wait == marker and now - probed.at < again_s:
            return False
        self._probed = EarlyExchange(marker, now)
        return True
