"""The per-step record: what a train step costs on the training thread, and who reads it.

:class:`StepLog` is the one thing the per-step events (a fetch's start and end,
a train batch's start and end) touch: a clock read and an append each. The
guards read it later, in order, from :meth:`StepLog.drain`: at the steps they
asked for (``due``), before any other event, on the hang watchdog's thread, and
on the interval exchange's thread before the monitors' intervals are sent
(:meth:`StepLog.take_closed`).
See docs/design.md#overhead-what-a-step-costs.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any, TypeVar

from rankguard.callbacks.core.events import EventFacts, LoaderFacts

__all__ = [
    "BACKWARD",
    "BACKWARD_END",
    "BACKWARD_OPTIMIZER_STEP",
    "DRAIN_EVERY",
    "MICROBATCH",
    "OPTIMIZER_STEP",
    "PAIRS",
    "SUBPHASES",
    "Entry",
    "StepLog",
    "StepReader",
    "expand",
]

logger = logging.getLogger("rankguard.callbacks.guard")

#: ``(time.perf_counter(), event, step, batch_index, loader name, decisions)``: one event,
#: or two at the same instant (a kind in :data:`PAIRS`; a batch end's has the next fetch's
#: step in the ``batch_index`` place when it is not the batch's).
Entry = tuple[float, str, int, "int | None", "str | None", "dict[str, Any] | None"]
#: Reads the entries appended since the last drain, oldest first.
StepReader = Callable[[list[Entry]], None]
#: The training thread drains the log at a due batch once it holds this many entries, and
#: asks for a due at least this often (train batches): the log stays small even when no
#: guard asks to be read sooner and no thread reads it.
DRAIN_EVERY = 1024

T = TypeVar("T")

FETCH_START = "data_fetch_start"
FETCH_END = "data_fetch_end"
BATCH_START = "train_batch_start"
BATCH_END = "train_batch_end"
#: A fetch that ends as its batch starts, and a batch that ends as the next fetch starts:
#: one entry for the two events, where a loop has them back to back (half the entries
#: to append on the training thread and to read on the guards' threads).
FETCH_END_BATCH_START = "data_fetch_end+train_batch_start"
BATCH_END_FETCH_START = "train_batch_end+data_fetch_start"
#: Each paired kind: the two events it stands for, in order.
PAIRS = {
    FETCH_END_BATCH_START: (FETCH_END, BATCH_START),
    BATCH_END_FETCH_START: (BATCH_END, FETCH_START),
}
#: The parts of a train batch an adapter announces where its framework does (the table:
#: docs/design.md#events-the-training-loop-as-the-guards-see-it): a backward starts, it
#: ended, the optimizer steps; where a framework announces a microbatch only at its end, a
#: microbatch's backward ran and its accumulation window goes on (no optimizer step after
#: it), or the window's last backward ran and the optimizer steps (the HF Trainer's hooks).
#: No heartbeat: no deadline, interval or progress; the hang watchdog's history reads them.
BACKWARD = "backward"
BACKWARD_END = "backward_end"
OPTIMIZER_STEP = "optimizer_step"
MICROBATCH = "microbatch"
BACKWARD_OPTIMIZER_STEP = "backward+optimizer_step"
SUBPHASES = frozenset({BACKWARD, BACKWARD_END, OPTIMIZER_STEP, MICROBATCH, BACKWARD_OPTIMIZER_STEP})


class StepLog:
    """Per-step events as the training thread records them, read by the guards in order.

    Adapters call :meth:`fetch_start`, :meth:`fetch_end`, :meth:`batch_start` and
    :meth:`batch_end`; the hang watchdog adds its heartbeats of every other event
    (:meth:`append`), so the log holds the loop's events in the order they came.
    :meth:`drain` hands what was appended since the last drain to every reader,
    under a lock (the training thread and the watchdog thread both drain).

    Attributes:
        batches: Train batches started since :meth:`reset` (the fit's start).
        due: The value of ``batches`` at which :meth:`batch_start` calls the due
            handler (the guards act on the training thread, reading the log first
            if they need it).
        fetch_clock: When set (``LoaderReturnClock``-like: ``arm(loader)``,
            ``disarm()``), a fetch window given its loader is timed to the
            loader's return; such windows' steps are put in ``watched``.
        watched: Steps whose fetch window ended at the loader's return (read and
            discarded by the reader that set ``fetch_clock``).
        switch: When set, :meth:`batch_start` calls it at batch ``switch_at``, after
            any due; it returns the next such batch. Lighter than a due (no guard
            runs, the log is not read): the straggler monitor hooks the model's
            forward for the batches it times with it.
        switch_at: The value of ``batches`` at which ``switch`` runs next.
        step: The framework's step of the train batch at whose start the guards last
            acted (:meth:`act`).
        act_at: The lower of ``due`` and ``switch_at``: the one threshold a batch's start
            compares ``batches`` with before it calls :meth:`act` (kept by their setters).
    """

    def __init__(self) -> None:
        # A list: the training thread appends at its end; a read takes the entries it
        # found (a slice) and deletes them (a slice), two C calls whatever their number.
        self.entries: list[Entry] = []
        self.batches = 0
        self.step = 0
        self.act_at: float = 1
        self._due_at: float = 1  # the first batch asks the guards for theirs
        self._switch_at: float = math.inf
        self.fetch_clock: Any = None
        self.watched: set[int] = set()
        self.switch: Callable[[int], float] | None = None
        self._armed: Any = None  # the fetch clock armed for the open fetch window
        self._lock = threading.Lock()
        self._readers: list[StepReader] = []
        #: Called with each train batch an adapter hands :meth:`fetch_end_batch_start` or
        #: :meth:`batch_start` while set (a guard that reads the first batches sets it and
        #: clears it once it has them): one attribute check a step.
        self.batch_probe: Callable[[Any], None] | None = None
        self._on_due: Callable[[int], float] | None = None

    @property
    def due(self) -> float:
        """The value of ``batches`` at which a batch's start calls the due handler."""
        return self._due_at

    @due.setter
    def due(self, batches: float) -> None:
        self._due_at = batches
        self.act_at = min(batches, self._switch_at)

    @property
    def switch_at(self) -> float:
        """The value of ``batches`` at which a batch's start calls ``switch``."""
        return self._switch_at

    @switch_at.setter
    def switch_at(self, batches: float) -> None:
        self._switch_at = batches
        self.act_at = min(self._due_at, batches)

    def connect(self, readers: list[StepReader], on_due: Callable[[int], float]) -> None:
        """Sets who reads the log and the training thread's due handler (its next due back)."""
        self._readers = readers
        self._on_due = on_due

    def reset(self, due: float = 1) -> None:
        """Forgets what was recorded (a new fit); the first due is ``due``."""
        with self._lock:
            self.entries.clear()
            self.batches = self.step = 0
            self.due = due
            self.fetch_clock = None
            self.switch, self.switch_at = None, math.inf
            self.watched.clear()
            if self._armed is not None:
                self._armed.disarm()
                self._armed = None

    # -- the training thread, every step: a clock read and an append ---------------------

    def fetch_start(self, step: int, loader: LoaderFacts | None = None) -> None:
        """A fetch starts (``loader``: the adapter's window also holds a collective)."""
        if loader is None:
            self.entries.append((perf_counter(), FETCH_START, step, None, None, None))
            return
        self.entries.append((perf_counter(), FETCH_START, step, None, loader.name, None))
        clock = self.fetch_clock
        if clock is not None and clock.arm(loader.loader):
            self._armed = clock

    def fetch_end(self, step: int) -> None:
        """The fetch ended (at the loader's return if the window was watched)."""
        if self._armed is not None:
            returned_at = self._armed.disarm()
            self._armed = None
            self.watched.add(step)
            now = perf_counter() if returned_at is None else returned_at
            self.entries.append((now, FETCH_END, step, None, None, None))
            return
        self.entries.append((perf_counter(), FETCH_END, step, None, None, None))

    def batch_start(self, step: int, batch: Any = None) -> None:
        """A train batch starts; at the due batch, the guards act (see :attr:`due`).

        ``batch``: the batch, where the adapter has it, for :attr:`batch_probe`.
        """
        self.entries.append((perf_counter(), BATCH_START, step, None, None, None))
        self.batches = batches = self.batches + 1
        if batches >= self.act_at:
            self.step = step
            self.act(batches)
        if self.batch_probe is not None and batch is not None:
            self.batch_probe(batch)

    def batch_end(self, step: int, decisions: dict[str, Any] | None = None) -> None:
        """The train batch ended, with the framework's split decisions if it has any."""
        self.entries.append((perf_counter(), BATCH_END, step, None, None, decisions))

    # -- a train batch's parts, where the framework announces them: an append each -------

    def backward(self) -> None:
        """A backward starts."""
        self.entries.append((perf_counter(), BACKWARD, 0, None, None, None))

    def backward_end(self) -> None:
        """The backward ended."""
        self.entries.append((perf_counter(), BACKWARD_END, 0, None, None, None))

    def optimizer_step(self) -> None:
        """The optimizer steps."""
        self.entries.append((perf_counter(), OPTIMIZER_STEP, 0, None, None, None))

    def microbatch(self) -> None:
        """A microbatch's backward ran; its accumulation window goes on (no optimizer step)."""
        self.entries.append((perf_counter(), MICROBATCH, 0, None, None, None))

    def backward_optimizer_step(self) -> None:
        """The window's last backward ran and the optimizer steps (one hook for both)."""
        self.entries.append((perf_counter(), BACKWARD_OPTIMIZER_STEP, 0, None, None, None))

    # -- two events at once, where a loop has them back to back: one call, one entry ------

    def fetch_end_batch_start(self, step: int, batch: Any = None) -> None:
        """:meth:`fetch_end` then :meth:`batch_start` (a fetch whose batch starts at once).

        ``batch``: the batch, where the adapter has it, for :attr:`batch_probe` (the one
        place it is called: a guard that reads the first train batches sets it).
        """
        if self._armed is not None:  # a watched window ends at the loader's return
            self.fetch_end(step)
            self.batch_start(step, batch)
            return
        self.entries.append((perf_counter(), FETCH_END_BATCH_START, step, None, None, None))
        # batch_start's count and threshold, inline: a call costs more than they do here
        self.batches = batches = self.batches + 1
        if batches >= self.act_at:
            self.step = step
            self.act(batches)
        if self.batch_probe is not None and batch is not None:
            self.batch_probe(batch)

    def act(self, batches: int) -> None:
        """At train batch ``batches`` (``>= act_at``): the due handler, then ``switch``, if due."""
        if batches >= self._due_at:
            self._due(batches)
        if batches >= self._switch_at:
            self.switch_at = self.switch(batches)  # type: ignore[misc]

    def batch_end_fetch_start(
        self, step: int, decisions: dict[str, Any] | None = None, *, fetch_step: int | None = None
    ) -> None:
        """:meth:`batch_end` then :meth:`fetch_start` with no loader (the next fetch at once).

        ``fetch_step``: the fetch's step where the loop counts it as the next one's.
        """
        self.entries.append(
            (perf_counter(), BATCH_END_FETCH_START, step, fetch_step, None, decisions)
        )

    # -- any event -------------------------------------------------------------------------

    def append(self, event: str, facts: EventFacts) -> None:
        """Records ``event`` with ``facts`` (a heartbeat of an event that is not per step)."""
        loader = facts.loader
        name = loader.name if loader is not None else None
        self.entries.append(
            (perf_counter(), event, facts.step, facts.batch_index, name, facts.decisions or None)
        )

    def record(self, event: str, facts: EventFacts) -> None:
        """Records a per-step ``event`` from its facts (the runner's path before it opened)."""
        if event == FETCH_START:
            self.fetch_start(facts.step, facts.loader)
        elif event == FETCH_END:
            self.fetch_end(facts.step)
        elif event == BATCH_START:
            self.batch_start(facts.step)
        else:
            self.batch_end(facts.step, facts.decisions or None)

    # -- readers ---------------------------------------------------------------------------

    def drain(self) -> None:
        """Hands every entry appended since the last drain to each reader, oldest first."""
        with self._lock:
            entries = self.entries
            if not entries:
                return
            count = len(entries)
            taken = entries[:count]
            del entries[:count]  # what the training thread appended since stays
            for reader in self._readers:
                try:
                    reader(taken)
                except Exception:  # one guard's bug must not cost the others their steps
                    logger.exception("rankguard: %r could not read the step log", reader)

    def take_closed(self, closed: dict[int, T], batch: int) -> T | None:
        """The interval a reader closed at train batch ``batch``, once the log is read that far.

        A monitor's reader closes an interval when it reads the start of the batch that
        ends it, whichever thread reads the log, and keeps it in ``closed`` under that
        batch. This reads the log to now, then takes the interval out of ``closed``;
        intervals closed before it and never taken (a fit that ended at one) are dropped.

        Returns:
            The interval, or ``None`` if the reader never closed it (a log reset under it).
        """
        self.drain()
        taken = closed.pop(batch, None)
        for older in [b for b in closed if b < batch]:
            del closed[older]
        return taken

    def _due(self, batches: int) -> None:
        on_due = self._on_due
        if on_due is None:
            self.due = batches + DRAIN_EVERY
            self.drain()
            return
        self.due = min(on_due(batches), batches + DRAIN_EVERY)


def expand(entries: list[Entry]) -> list[Entry]:
    """``entries`` with each paired one (:data:`PAIRS`) as its two events, at its time."""
    out: list[Entry] = []
    for entry in entries:
        pair = PAIRS.get(entry[1])
        if pair is None:
            out.append(entry)
            continue
        at, _, step, fetch_step, _, decisions = entry
        if pair[0] == FETCH_END:
            out.append((at, FETCH_END, step, None, None, None))
            out.append((at, BATCH_START, step, None, None, None))
        else:
            out.append((at, BATCH_END, step, None, None, decisions))
            fetch = step if fetch_step is None else fetch_step
            out.append((at, FETCH_START, fetch, None, None, None))
    return out
