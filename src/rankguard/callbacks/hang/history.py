"""What each rank did lately, batch by batch: the history the verdict compares across ranks.

:class:`History` reads the step log (on the watchdog thread) into :class:`Phases`, the plain
value a status carries; :mod:`rankguard.callbacks.hang.cause` compares them.
See docs/hang.md#what-split-them-each-ranks-history.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from rankguard.callbacks.core.events import Event
from rankguard.callbacks.core.step_log import (
    BACKWARD,
    BACKWARD_END,
    BACKWARD_OPTIMIZER_STEP,
    BATCH_END,
    BATCH_END_FETCH_START,
    BATCH_START,
    FETCH_END,
    FETCH_END_BATCH_START,
    FETCH_START,
    MICROBATCH,
    OPTIMIZER_STEP,
    Entry,
)

__all__ = [
    "EPOCH_END",
    "FIT_END",
    "MAX_BACKWARDS",
    "MAX_BATCHES",
    "Backward",
    "BatchPhases",
    "History",
    "Phases",
]

#: Train batches kept per rank (the latest): a split is proven within a batch or two of
#: where the ranks wait; a difference older than this is not seen.
MAX_BATCHES = 12
#: Backward passes kept per rank (the latest), with whether each ended its window.
MAX_BACKWARDS = 24
#: What ran after a train batch, before the next: its pass ended, the fit ended.
EPOCH_END = "epoch end"
FIT_END = "fit end"
#: The sub-phases that make a rank's backward passes known, and its optimizer steps.
_BACKWARDS = frozenset({BACKWARD, MICROBATCH, BACKWARD_OPTIMIZER_STEP})
_STEPS = frozenset({OPTIMIZER_STEP, BACKWARD_OPTIMIZER_STEP})


class BatchPhases(NamedTuple):
    """One train batch on one rank: the backward passes in it, what ran after it.

    Attributes:
        n: Its place in this fit on this rank (1: the first): the ranks' batches pair by it.
        step: The framework's step at its start (the reports' "train batch N").
        epoch: The pass over the train loader it belongs to (0: the fit's first).
        backwards: Backward passes announced in it.
        ended: Whether its end was announced.
        after: What ran after its end, before the next batch, in order: ``"eval of
            'val'"``, ``"save"``, :data:`EPOCH_END`, :data:`FIT_END`.
    """

    n: int
    step: int
    epoch: int
    backwards: int
    ended: bool
    after: tuple[str, ...] = ()


class Backward(NamedTuple):
    """One backward pass on one rank, and whether the optimizer stepped after it.

    Attributes:
        ordinal: Backward passes in this fit on this rank, this one included: the ranks'
            pair by it.
        n: The train batch it ran in (:attr:`BatchPhases.n`).
        window: Its place in its accumulation window (1: the window's first).
        ends_window: ``True``: the optimizer stepped after it; ``False``: the window went
            on (another backward, or the batch's end, came first); ``None``: not known yet.
    """

    ordinal: int
    n: int
    window: int
    ends_window: bool | None


class Phases(NamedTuple):
    """A rank's history as its status carries it (a fixed size at any length of run).

    Attributes:
        batches: Its last train batches, oldest first.
        backwards: Its last backward passes, oldest first.
        announces: The parts of a batch its adapter announces (``step_log.SUBPHASES``
            names): where none are, its backward passes and optimizer steps are unknown.
        now: The part of its last batch it is in: ``"forward"`` (started, no backward
            yet), ``"backward"``, ``"after backward"``, ``"optimizer step"``; ``""``
            between batches.
    """

    batches: tuple[BatchPhases, ...] = ()
    backwards: tuple[Backward, ...] = ()
    announces: tuple[str, ...] = ()
    now: str = ""

    @property
    def knows_backwards(self) -> bool:
        """Whether the adapter announces backward passes."""
        return not _BACKWARDS.isdisjoint(self.announces)

    @property
    def knows_steps(self) -> bool:
        """Whether the adapter announces optimizer steps."""
        return not _STEPS.isdisjoint(self.announces)

    @property
    def knows_starts(self) -> bool:
        """Whether a backward is announced at its start (else the one running is not listed)."""
        return BACKWARD in self.announces


class History:
    """Reads the step log into this rank's :class:`Phases` (the hang watchdog's reader).

    Attributes:
        announces: The parts of a batch the adapter announces, set at fit start.
    """

    def __init__(self) -> None:
        self.announces: tuple[str, ...] = ()
        self.reset()

    def reset(self) -> None:
        """A new fit: nothing run yet (what the adapter announces stays)."""
        self._batches: deque[list] = deque(maxlen=MAX_BATCHES)
        self._backwards: deque[list] = deque(maxlen=MAX_BACKWARDS)
        self._n = 0
        self._ordinal = 0
        self._window = 0
        self._epoch = -1
        self._now = ""
        self._pending: list | None = None

    def phases(self) -> Phases:
        """This rank's history now (the watchdog thread, at each status)."""
        return Phases(
            tuple(BatchPhases(*b) for b in self._batches),
            tuple(Backward(*b) for b in self._backwards),
            self.announces,
            self._now,
        )

    def read(self, entries: list[Entry]) -> None:
        """Reads step-log entries, oldest first (under the step log's lock).

        The watchdog's thread reads some five entries a train batch: the usual ones are
        told apart first, with the state in locals (a method call costs as much).
        """
        steps = not _STEPS.isdisjoint(self.announces)
        batches, backwards = self._batches, self._backwards
        pending = self._pending  # the last backward whose window's end is not known yet
        for _, event, step, _, loader, _ in entries:
            if event == FETCH_START or event == FETCH_END:  # a fetch: no batch's part
                continue
            if event == FETCH_END_BATCH_START or event == BATCH_START:
                self._n += 1
                batches.append([self._n, step, max(self._epoch, 0), 0, False, ()])
                self._now = "forward"
            elif event == BATCH_END_FETCH_START or event == BATCH_END:
                if pending is not None and steps:  # the batch ended before any step
                    pending[3], pending = False, None
                if batches:
                    batches[-1][4] = True
                self._now = ""
            elif event == BACKWARD or event == MICROBATCH or event == BACKWARD_OPTIMIZER_STEP:
                if pending is not None and steps:  # another backward came before any step
                    pending[3], pending = False, None
                self._ordinal += 1
                self._window += 1
                ends = None if event == BACKWARD else event != MICROBATCH
                last = [self._ordinal, self._n, self._window, ends if steps else None]
                backwards.append(last)
                pending = last if last[3] is None else None
                if batches:
                    batches[-1][3] += 1
                if ends:
                    self._window = 0
                self._now = _NOW[event]
            elif event == OPTIMIZER_STEP:
                if pending is not None:
                    pending[3], pending = True, None
                self._window = 0
                self._now = "optimizer step"
            elif event == BACKWARD_END:
                self._now = "after backward"
            else:
                pending = self._beat(event, loader, pending)
                batches, backwards = self._batches, self._backwards  # new ones at a fit's start
        self._pending = pending

    def _beat(self, event: str, loader: str | None, pending: list | None) -> list | None:
        """Any other heartbeat: a new fit, a pass, or what runs after a batch.

        Returns the backward whose window's end is not known yet (none after a new fit).
        """
        if event == Event.FIT_START:
            self.reset()
            return None
        if event == Event.EPOCH_START:
            self._epoch += 1
        else:
            said = _AFTER.get(event)
            if said is not None and self._batches:
                last = self._batches[-1]
                last[5] = (*last[5], said.format(loader=loader))
        return pending


#: The part of its batch a rank is in after each backward announcement.
_NOW = {BACKWARD: "backward", MICROBATCH: "forward", BACKWARD_OPTIMIZER_STEP: "optimizer step"}
#: What runs after a batch, by the heartbeat that starts it.
_AFTER = {
    Event.EVAL_START: "eval of {loader!r}",
    Event.CHECKPOINT_SAVE_START: "save",
    Event.EPOCH_END: EPOCH_END,
    Event.FIT_END: FIT_END,
}
