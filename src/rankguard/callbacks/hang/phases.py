"""Heartbeats to phases: which deadline applies, the intervals that calibrate it, decisions.

Pure: :class:`PhaseTracker` reads step-log entries; the watchdog feeds it and reads its state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from rankguard.callbacks.core.events import Event
from rankguard.callbacks.core.step_log import (
    BATCH_END,
    BATCH_END_FETCH_START,
    FETCH_END_BATCH_START,
    PAIRS,
    SUBPHASES,
    Entry,
    expand,
)
from rankguard.callbacks.hang.calibration import IntervalHistory
from rankguard.callbacks.hang.kinds import Phase

__all__ = ["Beat", "ClosestCall", "Decision", "PhaseTracker"]


class Beat(NamedTuple):
    """The training thread's last heartbeat, read by the watchdog thread."""

    event: str
    step: int
    batch_index: int | None
    loader: str | None
    at: float  # time.perf_counter()
    kind: str  # the phase kind whose deadline applies from here (Phase.DONE after fit end)


class ClosestCall(NamedTuple):
    """The healthy interval closest to its deadline: :attr:`HangWatchdog.closest_call`."""

    share: float  # of the deadline
    kind: str
    seconds: float
    deadline: float


class Decision(NamedTuple):
    """A decision that can split the ranks (a stop, a save entered...), as this rank saw it."""

    value: Any
    step: int | None  # the step at which it last changed


#: Events that end a phase after eval: back in the train loop, or a checkpoint save.
_LEAVE_OR_END_EVAL = {
    Event.EVAL_END: Phase.POST_EVAL,
    Event.CHECKPOINT_SAVE_START: Phase.CHECKPOINT,
    Event.DATA_FETCH_START: Phase.DATA,
    Event.DATA_FETCH_END: Phase.TRAIN,
    Event.TRAIN_BATCH_START: Phase.TRAIN,
}
#: The phase kind that follows each of a train step's heartbeats once a step has ended and
#: no eval just ended (``_kind``'s answer then, with nothing for it to update).
_STEP_KINDS = {
    Event.DATA_FETCH_START: Phase.DATA,
    Event.DATA_FETCH_END: Phase.TRAIN,
    Event.TRAIN_BATCH_START: Phase.TRAIN,
}
#: The events of an eval (its phase kind applies from each).
_EVAL = (Event.EVAL_START, Event.EVAL_BATCH_START, Event.EVAL_BATCH_END)


def _add(spans: dict[str, list[float]], kind: str, seconds: float) -> None:
    """Adds an interval of ``kind`` to those read."""
    span = spans.get(kind)
    if span is None:
        spans[kind] = [seconds]
    else:
        span.append(seconds)


class PhaseTracker:
    """What this rank's heartbeats say: its phase, steps done, intervals, decisions.

    Each interval between two heartbeats is recorded in ``history`` under the
    phase kind of the first (once ``warmup`` train batches ended), against the
    deadline then in force for the closest call.

    Args:
        history: The intervals per phase kind, which calibrate the deadlines.
        measure: Whether intervals are recorded (``auto_calibrate``).
        warmup: Train batches ended before intervals are recorded.

    Attributes:
        beat: The last heartbeat read, or ``None`` before the first.
        progress: Heartbeats read so far (never reset: a new one is progress).
        steps_done: Train batches ended in this fit.
        after_eval: Whether an eval ended and the rank is not yet back in its train loop.
        closest_call: The healthy interval closest to its deadline this fit, or ``None``.
        decisions: The decisions that can split the ranks, by name.
    """

    def __init__(self, history: IntervalHistory, *, measure: bool, warmup: int) -> None:
        self.history = history
        self.measure = measure
        self.warmup = warmup
        self.beat: Beat | None = None
        self.progress = 0
        self.reset()

    def reset(self) -> None:
        """A new fit: no steps done, no decisions, no closest call (same history and beat)."""
        self.steps_done = 0
        self.after_eval = False
        self.closest_call: ClosestCall | None = None
        self.decisions: dict[str, Decision] = {}

    def read(self, entries: list[Entry], deadlines: Mapping[str, float]) -> None:
        """Reads heartbeats: intervals, phases; :attr:`beat` becomes the last.

        A batch's parts (:data:`~rankguard.callbacks.core.step_log.SUBPHASES`) are no
        heartbeat: they are skipped here (the history reads them).

        Args:
            entries: Step-log entries, oldest first.
            deadlines: The deadline per phase kind in force (for the closest call).
        """
        last = self.beat
        at, kind = (None, "") if last is None else (last.at, last.kind)
        measure, warmup = self.measure, self.warmup
        done, after_eval = self.steps_done, self.after_eval
        spans: dict[str, list[float]] = {}  # the intervals read, by kind: recorded at the end
        beats = 0  # heartbeats read (a batch's parts are none: the history's to read)
        for now, event, step, _, _, decisions in entries:
            if event in SUBPHASES:
                continue
            beats += 1
            if event == Event.FIT_START:  # a new fit: no interval from the last one
                self._record(spans, deadlines)
                spans, at, self.closest_call, done, after_eval = {}, None, None, 0, False
            if at is not None and measure and done >= warmup:
                span = spans.get(kind)
                if span is None:
                    spans[kind] = [now - at]
                else:
                    span.append(now - at)
            at = now
            if decisions:  # none at most events
                self.update_decisions(decisions, step)
            if done and not after_eval:  # the usual heartbeats of a train step, past the first
                if event == FETCH_END_BATCH_START or event == BATCH_END_FETCH_START:
                    # Two heartbeats at once: a zero interval between them, of the first's kind.
                    if event == BATCH_END_FETCH_START:
                        done += 1
                    if measure and done >= warmup:
                        train = spans.get(Phase.TRAIN)
                        if train is None:
                            spans[Phase.TRAIN] = [0.0]
                        else:
                            train.append(0.0)
                    kind = Phase.TRAIN if event == FETCH_END_BATCH_START else Phase.DATA
                    continue
                if event == BATCH_END:
                    done += 1
                    kind = Phase.TRAIN
                    continue
                usual = _STEP_KINDS.get(event)
                if usual is not None:
                    kind = usual
                    continue
            self.steps_done, self.after_eval = done, after_eval
            pair = PAIRS.get(event)
            if pair is None:
                kind = self._kind(event)
            else:
                kind = self._kind(pair[0])
                if measure and self.steps_done >= warmup:
                    _add(spans, kind, 0.0)
                kind = self._kind(pair[1])
            done, after_eval = self.steps_done, self.after_eval
        self.steps_done, self.after_eval = done, after_eval
        self._record(spans, deadlines)
        if not beats:
            return
        self.progress += beats
        last = entries[-1]
        if last[1] in SUBPHASES:
            last = next(e for e in reversed(entries) if e[1] not in SUBPHASES)
        now, event, step, batch_index, loader, _ = expand([last])[-1]
        self.beat = Beat(event, step, batch_index, loader, now, kind)

    def _record(self, spans: Mapping[str, list[float]], deadlines: Mapping[str, float]) -> None:
        """Adds the intervals read to the calibration; the longest against its deadline.

        The closest call is the interval with the largest share of the deadline
        then in force for its kind: per kind, the longest.
        """
        closest = self.closest_call
        for kind, seconds in spans.items():
            self.history.record_many(kind, seconds)
            deadline = deadlines.get(kind)
            longest = max(seconds)
            if deadline and (closest is None or longest > closest.share * deadline):
                closest = ClosestCall(longest / deadline, kind, longest, deadline)
        self.closest_call = closest

    def update_decisions(self, decisions: Mapping[str, Any], step: int | None) -> None:
        """Keeps the decisions that can split the ranks, with the step each was last changed."""
        for name, value in decisions.items():
            seen = self.decisions.get(name)
            if (seen.value if seen is not None else None) != value:
                self.decisions[name] = Decision(value, step)

    def _kind(self, event: str) -> str:
        """The phase kind after ``event``, updating steps done and after-eval."""
        if event == Event.FIT_END:
            return Phase.DONE
        if event == Event.TRAIN_BATCH_END:
            self.steps_done += 1
        if self.steps_done == 0:
            return Phase.STARTUP
        if event in _EVAL:
            self.after_eval = False
            return Phase.EVAL
        if event in _LEAVE_OR_END_EVAL:
            self.after_eval = event == Event.EVAL_END
            return _LEAVE_OR_END_EVAL[event]
        return Phase.POST_EVAL if self.after_eval else Phase.TRAIN
