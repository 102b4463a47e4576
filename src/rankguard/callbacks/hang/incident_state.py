"""One rank's incident state: the open incident, the last verdict, and the counts kept.

The watchdog's thread changes it as :mod:`~rankguard.callbacks.hang.incident` says; the guard
reads its counts (``incidents``, ``ceilings_reached``, ``last_incident``) and waits on ``ended``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from rankguard.callbacks.core.errors import HangDetectedError
from rankguard.callbacks.hang.incident import State
from rankguard.callbacks.hang.status import GaveUp, Runs, Verdict, in_runs

__all__ = ["IncidentState"]


@dataclass(eq=False)
class IncidentState:
    """What this rank knows of its incidents.

    Attributes:
        runs: The ranks held in the open incident (``incident.Hold``'s), ``()`` when none.
        reported: A report of the open incident was made (stage 1 or 2).
        ended: Set once the open incident reached stage 2.
        gave_up: A rankguard check that gave up waiting for ranks, until the incident ends.
        last: The last verdict of a status exchange, or ``None`` before the first.
        told_mismatch: The collective mismatches already warned about (once each).
        incidents: Incidents reported by this rank so far (never reset).
        ceilings_reached: Incidents that reached stage 2 on this rank (never reset).
        last_incident: The last report as a :class:`HangDetectedError`, or ``None``.
    """

    runs: Runs = ()
    reported: bool = False
    ended: threading.Event = field(default_factory=threading.Event)
    gave_up: GaveUp | None = None
    last: Verdict | None = None
    told_mismatch: set[str] = field(default_factory=set)
    incidents: int = 0
    ceilings_reached: int = 0
    last_incident: HangDetectedError | None = None

    def new_fit(self) -> None:
        """A new fit: no open incident, no verdict yet (the counts are kept)."""
        self.recovered()
        self.last = None

    def recovered(self) -> None:
        """Every rank made progress again: the open incident is over."""
        self.runs, self.reported, self.gave_up = (), False, None
        self.ended.clear()

    @property
    def decided(self) -> State:
        """The open incident as :func:`incident.after_verdict` reads it."""
        return State(self.reported, self.ended.is_set())

    def reported_as(self, error: HangDetectedError) -> None:
        """A report of the open incident was made: counted once per incident."""
        if not self.reported:
            self.incidents += 1  # tests wait on it
        self.reported = True
        self.last_incident = error

    def reached_ceiling(self) -> None:
        """The open incident reached stage 2 (``ended`` is set once it is logged)."""
        self.ceilings_reached += 1
        self.gave_up = None

    def faulted(self, error: HangDetectedError) -> None:
        """A peer's fault was reported on this rank."""
        self.incidents += 1
        self.last_incident = error

    def still_training(self, world_size: int) -> tuple[list[int], str]:
        """The ranks whose fit had not ended at the last verdict, and every rank's phase then."""
        last = self.last
        if last is None or self.ended.is_set():
            return [], ""
        return [r for r in range(world_size) if not in_runs(r, last.done)], last.phases
