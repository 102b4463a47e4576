"""Whether this process's store answers slowly, as its own requests measured it.

A guard's verdict that is not in at the batch where every rank acts on it has two
causes: the ranks or their threads are late (a loaded machine, a payload still
building, a peer that posts later), or the store itself answers slowly (a congested
host). In the first, every rank waiting is what makes them all act at the same batch;
in the second, a rank waiting would hold training for each of an exchange's round
trips (``Guard.verdict_late`` waits long in the first, briefly in the second).

A request that waits for a key (``get``, ``multi_get``, ``wait``) takes as long as a peer
takes to write it, so it says nothing of the store; ``set`` is not answered. The
others (``add``, ``check``, ``delete_key``, ``compare_set``, ``num_keys``) are answered
at once by a healthy store: every thread's client (``side_channel._ThreadClient``)
times them here. The watchdog's fault-board polls and the exchanges' deletes make such
requests every few seconds.
"""

from __future__ import annotations

import threading
from time import monotonic

__all__ = ["SLOW_REQUEST_S", "TIMED_REQUESTS", "StoreHealth", "store_health"]

#: A request the store answers at once that takes longer than this says it is slow (a
#: healthy store answers in well under a millisecond; a loaded machine's thread in tens).
SLOW_REQUEST_S = 0.5
#: The requests a healthy store answers at once, whatever the peers do.
TIMED_REQUESTS = frozenset(("add", "check", "delete_key", "compare_set", "num_keys"))


class StoreHealth:
    """The durations of this process's timed store requests: the last one and those in flight.

    Attributes:
        slow_seen: A timed request took over :data:`SLOW_REQUEST_S` since the fit started.
        left_late: A guard of this process left a verdict for a later batch since the fit
            started: its later exchanges may go at other batches than the other ranks'.
        batch_waited: ``(train batch, seconds)``: how long the guards waited for late
            verdicts at that batch, together (the training thread's; ``Guard.verdict_late``).
    """

    def __init__(self) -> None:
        self._since: dict[int, float] = {}  # thread ident -> when its request went
        self._last_s = 0.0
        self.slow_seen = False
        self.left_late = False
        self.batch_waited: tuple[int, float] = (-1, 0.0)

    def restart(self) -> None:
        """A fit starts: what earlier fits saw is forgotten (requests in flight stay)."""
        self.slow_seen = self.left_late = False
        self.batch_waited = (-1, 0.0)

    def begin(self) -> float:
        """Records that this thread sent a timed request; returns when."""
        started = monotonic()
        self._since[threading.get_ident()] = started
        return started

    def end(self, started: float) -> None:
        """Records that this thread's timed request sent at ``started`` was answered (or failed)."""
        self._last_s = monotonic() - started
        self._since.pop(threading.get_ident(), None)
        if self._last_s > SLOW_REQUEST_S:
            self.slow_seen = True

    def round_trip_s(self) -> float:
        """How long the store takes to answer: the last timed request, or one in flight longer."""
        now = monotonic()
        in_flight = max((now - since for since in tuple(self._since.values())), default=0.0)
        return max(self._last_s, in_flight)

    def slow(self) -> bool:
        """Whether the last timed request, or one in flight, took over :data:`SLOW_REQUEST_S`."""
        if self._last_s > SLOW_REQUEST_S:
            return True
        if self.round_trip_s() > SLOW_REQUEST_S:  # one in flight that long
            self.slow_seen = True
            return True
        return False


#: This process's (every channel's clients reach the same store).
store_health = StoreHealth()
