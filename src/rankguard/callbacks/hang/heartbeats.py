"""The hang watchdog's reading of its step log: phases, waits, batch history, last entries.

:class:`HeartbeatReader` owns the step log the training thread writes and everything read
from it; the guard feeds it facts at fit start, its thread reads it at each status.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from rankguard.callbacks.core.step_log import SUBPHASES, Entry, StepLog
from rankguard.callbacks.hang.calibration import IntervalHistory
from rankguard.callbacks.hang.deadlines import Settle
from rankguard.callbacks.hang.history import History
from rankguard.callbacks.hang.kinds import Phase
from rankguard.callbacks.hang.phases import Beat, PhaseTracker
from rankguard.callbacks.hang.stacks import library_paths
from rankguard.callbacks.hang.waits import WaitTracker

__all__ = ["HISTORY", "DecisionProbe", "HeartbeatReader"]

logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

HISTORY = 256  # heartbeats kept per rank for rank{N}.jsonl
#: An adapter's read of its framework's decisions (``EventFacts.decision_probe``).
DecisionProbe = Callable[[], Mapping[str, Any]]


class HeartbeatReader:
    """What this rank's heartbeats say, read from its step log.

    Args:
        measure: Whether intervals are recorded (``auto_calibrate``).
        warmup: Train batches ended before intervals are recorded.

    Attributes:
        steps: The step log the training thread writes (the guard's runner's).
        libraries: Where library code lives: frames there are not the user's.
        intervals: The intervals seen per phase kind, which calibrate the deadlines.
        phases: The phase, steps done and decisions the heartbeats say.
        waits: Where the loop waits, sampled from its stack.
        history: What the rank ran lately, batch by batch (the verdict compares it).
        entries: The last entries read, for the report's ``rank{N}.jsonl``.
        decision_probe: The adapter's read of its decisions, from fit start, or ``None``.
        split_decisions: The adapter's words for its decisions that can split the ranks.
        restored: Whether the intervals came from a checkpoint.
        save_estimate: A checkpoint save's expected seconds (from the model's size), or ``None``.
    """

    def __init__(self, *, measure: bool, warmup: int) -> None:
        self.steps = StepLog()
        self.libraries = library_paths()
        self.intervals = IntervalHistory()
        self.phases = PhaseTracker(self.intervals, measure=measure, warmup=warmup)
        self.waits = WaitTracker(self.libraries)
        self.history = History()
        self.entries: deque[Entry] = deque(maxlen=HISTORY)
        self.decision_probe: DecisionProbe | None = None
        self.split_decisions: dict[str, Any] = {}
        self.restored = False
        self.save_estimate: float | None = None

    @property
    def beat(self) -> Beat | None:
        """The last heartbeat read, or ``None`` before the first."""
        return self.phases.beat

    @property
    def fit_ended(self) -> bool:
        """Whether the last heartbeat read is the end of fit."""
        beat = self.phases.beat
        return beat is not None and beat.kind == Phase.DONE

    def reset(self) -> None:
        """A new fit: no steps done, no decisions, no wait (same intervals and beat)."""
        self.phases.reset()
        self.waits.wait = None

    def read_step_log(self) -> None:
        """Reads what the training thread appended to the step log since the last read.

        The step log hands it to every reader (this one's :meth:`read`). The watchdog
        thread calls it before it reads what the heartbeats say; the training thread at
        fit end, at a checkpoint save and when it stops the thread.
        """
        self.steps.drain()

    def read(self, entries: list[Entry], deadlines: Mapping[str, float]) -> None:
        """Reads step-log entries: the phases, then the batch history; keeps the last ones."""
        self.phases.read(entries, deadlines)
        self.history.read(entries)
        self.entries.extend(entries)

    def issuing_phase(self) -> tuple[str, int, int | None] | None:
        """The training thread's phase as it issues a collective: its last event, step, batch.

        Read by the record of collectives for what DDP and FSDP issue (once per forward and
        per FSDP collective): the step log's newest entry that is not a batch's part (a
        backward, an optimizer step: the batch's own entry names its phase), else the last
        one read.
        """
        entries = self.steps.entries
        for back in range(1, len(entries) + 1):
            try:
                _, event, step, batch_index, _, _ = entries[-back]
            except IndexError:  # drained meanwhile
                break
            if event not in SUBPHASES:
                return event, step, batch_index
        beat = self.phases.beat  # none left unread: the newest is the beat read
        return None if beat is None else (beat.event, beat.step, beat.batch_index)

    def probe_decisions(self, name: str) -> None:
        """Reads the adapter's decisions now (watchdog thread, at each status): never raises."""
        probe, beat = self.decision_probe, self.phases.beat
        if probe is None or beat is None:
            return
        try:
            self.phases.update_decisions(probe(), beat.step)
        except Exception as exc:  # a framework's state read from another thread
            logger.debug("rankguard %s: decision probe failed: %s", name, exc)

    def sample(
        self, stack: list[tuple[str, int, str]], counts: Any, now: float
    ) -> tuple[str | None, float]:
        """Where the loop waits in ``stack`` and how long it has waited there."""
        return self.waits.sample(stack, now, self.phases.progress, counts)

    def settled(
        self, point: str | None, wait_s: float, quiet_s: float | None, settle: Settle, now: float
    ) -> bool:
        """Whether the loop settled at a rendezvous (see :meth:`WaitTracker.exchange_early`)."""
        return self.waits.exchange_early(point, wait_s, quiet_s, settle, now)

    def quiet_s(self, now: float) -> float:
        """How long the loop has made no progress and issued no collective (as sampled)."""
        return self.waits.quiet_s(now)

    def ready_to_calibrate(self, warmup_steps: int) -> bool:
        """Whether the deadlines can be calibrated: warmed up, or restored from a checkpoint."""
        return self.restored or self.phases.steps_done >= warmup_steps
