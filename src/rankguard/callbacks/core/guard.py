"""The base of every core guard, and the runner adapters drive.

A guard reacts to :class:`~rankguard.callbacks.core.events.Event` s through
methods named ``on_<event>`` (``on_fit_start``, ``on_eval_end``, ...), talks
to other ranks only through its :class:`SideChannel`, and reports a
violation through :meth:`Guard.violation`, which raises or logs a warning as
``on_violation`` says.

An error every rank raises from the same verdict leaves through
:meth:`Guard.raise_on_every_rank`: each rank logs it first, then waits until
every rank has logged it, then raises. A launcher tears the whole job down
when the first rank exits (Composer's sends SIGTERM to the others, Lightning's
rank 0 kills its children, torchrun's agent stops every worker), so without
the wait a rank that is a moment slower could be killed before its own error
is printed.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from time import monotonic
from typing import Any, ClassVar, NoReturn

from rankguard.callbacks.core.background_exchange import (
    ExchangeSkewed,
    IntervalExchange,
    PartPending,
    Pending,
)
from rankguard.callbacks.core.errors import RankGuardError
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.settings import check_choice, check_positive
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.core.step_log import DRAIN_EVERY, StepLog
from rankguard.callbacks.core.store_health import store_health

__all__ = ["PER_STEP", "RAISED", "Guard", "GuardRunner", "MetricSink"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.guard")

MetricSink = Callable[[Mapping[str, float]], None]

ON_VIOLATION = ("raise", "warn")
#: How long a rank that raises waits for the others to have logged the same error.
RAISE_WAIT_S = 10.0
#: Set on the log record of an error that is then raised (a handler may leave it out).
RAISED = "rankguard_raised"
#: How long a train batch waits for a verdict due at it while the store answers at once
#: (:meth:`Guard.verdict_late`): on a loaded machine the ranks may take seconds to send
#: theirs (a thread not scheduled, a payload still building), and every rank waiting is
#: what makes them all act at the same batch.
VERDICT_WAIT_S = 10.0
#: ... and once the store answered slowly in this fit: an exchange then takes several of
#: its round trips, and a batch waits no longer than this for it.
LATE_AFTER_S = 0.5
#: How often a waiting batch asks whether the store answers slowly.
LATE_POLL_S = 0.05


class Guard:
    """Base class of core guards.

    Args:
        on_violation: ``"raise"`` (default) raises the guard's error on every
            rank; ``"warn"`` logs it as a warning and lets training go on.

    The per-step events (a fetch's start and end, a train batch's start and end)
    reach no handler: they are recorded in the runner's :class:`StepLog` (``steps``),
    which a guard reads by defining ``read_steps(entries)``; one that must act on
    the training thread at some train batch sets :attr:`due` to it and defines
    ``on_due(batches)``, called at the start of that batch; it reads the log first
    (``steps.drain()``) when what it does needs the steps before it.

    Attributes:
        name: Snake-case name of the guard, used as its key in ``RankGuard``
            configs and in side-channel exchange names.
        steps: The step log this guard's per-step events go to (the runner's).
        due: The train batch (``steps.batches``, counted from 1 in a fit) at whose
            start ``on_due`` runs; ``math.inf``: none.
    """

    name: ClassVar[str] = "guard"
    #: The per-step events ``read_steps`` reads (what the reference lists).
    step_events: ClassVar[tuple[Event, ...]] = ()
    #: Its ``on_error`` tells the other ranks (they may end at once): it runs after every
    #: guard that only explains the error on this rank, so their lines are logged first.
    tells_peers_on_error: ClassVar[bool] = False

    def __init__(self, *, on_violation: str = "raise") -> None:
        self.on_violation = check_choice("on_violation", on_violation, ON_VIOLATION)
        self.channel = SideChannel(None)
        self.log_metrics: MetricSink = _no_metrics
        self.due: float = math.inf
        self._warned: set[str] = set()
        # Alone until a runner of several guards takes it: its own step log and runner.
        self.steps = StepLog()
        self._runner = GuardRunner([self])

    def bind(self, channel: SideChannel, log_metrics: MetricSink | None = None) -> None:
        """Gives the guard its side channel and metric sink (at FIT_START)."""
        self.channel = channel
        self.log_metrics = log_metrics or _no_metrics

    def handler(self, event: Event) -> Callable[[EventFacts], None] | None:
        """The guard's handler for ``event`` (its ``on_<event>`` method), if it has one."""
        return getattr(self, f"on_{event.value}", None)

    def handle(self, event: Event, facts: EventFacts) -> None:
        """Dispatches ``event`` to this guard alone, as its runner would (never opens a channel)."""
        self._runner.dispatch(event, facts)

    def violation(self, error: RankGuardError, *, every_rank: bool = True) -> None:
        """Raises ``error`` or logs it as a warning, as ``on_violation`` says.

        Args:
            error: The error.
            every_rank: Whether every rank reports it (from a shared verdict),
                so a raising rank waits for the others to log it; ``False`` for
                an error only some ranks see, e.g. about ranks that never arrived.
        """
        if self.on_violation == "raise":
            self.raise_on_every_rank(error, every_rank=every_rank)
        logger.warning("rankguard %s: %s", self.name, error)

    def raise_on_every_rank(self, error: RankGuardError, *, every_rank: bool = True) -> NoReturn:
        """Logs ``error`` (ERROR), waits until every rank has logged it, then raises it.

        Args:
            error: The error, the same on every rank.
            every_rank: ``False`` when some ranks will not raise it: then no wait.
        """
        logger.error("rankguard %s: %s", self.name, error, extra={RAISED: True})
        if every_rank and self.channel.is_distributed:
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            try:
                self.channel.barrier(f"{self.name}/raised", timeout_s=RAISE_WAIT_S)
            except Exception as exc:  # a rank that never logs it must not hold this one
                logger.debug("rankguard %s: not every rank logged the error: %s", self.name, exc)
        raise error

    def verdict_late(self, pending: Pending | PartPending | None, batches: int) -> bool:
        """Whether ``pending``'s verdict is not in at train batch ``batches`` and left for later.

        While the store answers at once, a train batch waits for a verdict due at it up
        to :data:`VERDICT_WAIT_S`, however the machine's load slows the ranks sending
        theirs: every rank then acts at the same batch. Once this process's store requests
        showed it slow in this fit (:mod:`~rankguard.callbacks.core.store_health`: a
        congested host), a batch waits at most :data:`LATE_AFTER_S`; but for the verdict of
        its exchange thread's first exchange (:attr:`Pending.first`: the thread starting
        and connecting at a fit's start, when a loaded machine's requests are slowest for
        want of a core). A verdict not in by then is acted on at the first batch it is in;
        the guard says so once, at INFO. Guards whose parts went in one exchange wait for
        it once a batch: where another already stopped waiting at this batch, this one
        does not wait again; and every guard's wait at one batch counts against the one
        :data:`LATE_AFTER_S` of that batch.
        """
        if pending is None:
            return False
        left = pending.left
        if left is not None and left[0] == batches:  # another guard's part waited for it
            if pending.wait(0):
                return False
            self._say_late(*left)
            return True
        # Once slow, LATE_AFTER_S is the batch's, shared by every guard's exchange due at it.
        waited_at, spent = store_health.batch_waited
        spent = spent if waited_at == batches else 0.0
        started = monotonic()
        waited = 0.0
        try:
            while not pending.wait(LATE_POLL_S):
                waited = monotonic() - started
                slow = not pending.first and (store_health.slow() or store_health.slow_seen)
                bound = LATE_AFTER_S if slow else VERDICT_WAIT_S
                if waited >= (bound - spent if slow else bound):
                    store_health.left_late = True
                    why = (
                        "the store answers slowly" if slow else "the ranks are slow to send theirs"
                    )
                    # The bound the batch waited, not the clock: on a loaded machine a wait
                    # ends a poll or a scheduling delay past it (0.55 s read "0.6 s").
                    pending.left = (batches, bound, why)
                    self._say_late(batches, bound, why)
                    return True
            return False
        finally:
            store_health.batch_waited = (batches, spent + monotonic() - started)

    def _say_late(self, batches: int, bound: float, why: str) -> None:
        """Says once, at INFO, that a verdict was not in at ``batches`` after ``bound`` (s)."""
        self._say_once(
            logging.INFO,
            "late",
            "the verdict of its exchange was not in at train batch %d after %.1f s (%s): "
            "training goes on, and it acts on the verdict at the batch it comes",
            batches,
            bound,
            why,
        )

    def skip_failed(self, what: str, exc: Exception) -> None:
        """Says once that ``what`` (an exchange) failed and is skipped.

        At INFO where it failed because a rank acted on an earlier verdict late (the
        store answered slowly, :class:`ExchangeSkewed`); at WARNING otherwise.
        """
        level = logging.INFO if isinstance(exc, ExchangeSkewed) else logging.WARNING
        self._say_once(level, "failed", "%s failed (%s); skipping it", what, exc)

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Logs a warning the first time ``key`` is seen by this guard."""
        self._say_once(logging.WARNING, key, message, *args)

    def _say_once(self, level: int, key: str, message: str, *args: Any) -> None:
        """Logs ``message`` at ``level`` the first time ``key`` is seen by this guard."""
        if key not in self._warned:
            self._warned.add(key)
            logger.log(level, "rankguard %s: %s", self.name, message % args if args else message)

    def state_dict(self) -> dict[str, Any]:
        """What the guard keeps across a restart, saved with checkpoints (plain values)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` saved (before the first event of a resumed fit)."""
        del state

    def close(self) -> None:
        """Releases what the guard holds; safe to call twice and after an error."""


def _no_metrics(metrics: Mapping[str, float]) -> None:
    del metrics


#: The events recorded in the step log instead of dispatched to handlers.
PER_STEP = frozenset(
    (Event.DATA_FETCH_START, Event.DATA_FETCH_END, Event.TRAIN_BATCH_START, Event.TRAIN_BATCH_END)
)
EVAL_BATCH = frozenset((Event.EVAL_BATCH_START, Event.EVAL_BATCH_END))


class GuardRunner:
    """Dispatches core events to guards; adapters own one.

    At the first event (normally FIT_START; a sanity-check eval may come
    first) it opens the side channel (local at world size 1) and binds every
    guard to it before dispatching.

    Args:
        guards: The guards, in the order they should run.
        exchange_timeout_s: Default side-channel timeout (scaled with the world
            size by :func:`~rankguard.callbacks.core.side_channel.scaled_timeout`).

    Attributes:
        handlers: Per event, the guards' handlers it reaches, in order (empty where
            no guard handles it, and for the per-step events, which go to ``steps``).
        steps: The step log every guard shares. An adapter's per-step path records
            into it itself (its ``fetch_start``, ``batch_start``, ...), as
            :meth:`fire` would.
    """

    def __init__(self, guards: Iterable[Guard], *, exchange_timeout_s: float = 300.0) -> None:
        self.guards = list(guards)
        self.timeout_s = check_positive("exchange_timeout_s", exchange_timeout_s)
        self.channel: SideChannel | None = None
        self.handlers: dict[Event, tuple[Callable[[EventFacts], None], ...]] = {
            event: ()
            if event in PER_STEP
            else tuple(h for g in self.guards if (h := g.handler(event)) is not None)
            for event in Event
        }
        self.steps = StepLog()
        #: Where due guards post their interval exchanges: one exchange per batch for all.
        self.intervals = IntervalExchange()
        self._due_guards = [g for g in self.guards if hasattr(g, "on_due")]
        readers = [g.read_steps for g in self.guards if hasattr(g, "read_steps")]
        self._reads_steps = bool(readers)
        for guard in self.guards:
            guard.steps = self.steps
            guard._runner = self
        self.steps.connect(readers, self._on_due)

    def handles(self, event: Event) -> bool:
        """Whether any guard handles ``event`` (adapters skip reading facts otherwise)."""
        if event in PER_STEP:
            return self._reads_steps
        return bool(self.handlers[event]) or event is Event.FIT_START

    def fire(self, event: Event, facts: EventFacts, log_metrics: MetricSink | None = None) -> None:
        """Dispatches ``event`` to every guard in order (opening the runner at FIT_START)."""
        if event is Event.FIT_START or self.channel is None:
            self.open(log_metrics)
        self.dispatch(event, facts)

    def dispatch(self, event: Event, facts: EventFacts) -> None:
        """Records a per-step event in the step log, or reads the log and runs the handlers.

        Every other event is preceded by a drain of the log (but an eval batch's, which
        no guard needs the train steps for), so its handlers see every step before it.
        """
        steps = self.steps
        if event in PER_STEP:
            steps.record(event.value, facts)
            return
        if event is Event.FIT_START:  # a new fit: the batch count starts again
            steps.drain()
            steps.reset()
            self.intervals.restart()
            store_health.restart()
        elif steps.entries and event not in EVAL_BATCH:
            steps.drain()
        try:
            for handler in self.handlers[event]:
                handler(facts)
        finally:  # what guards posted at this event goes as one exchange
            self.intervals.flush()
        steps.due = self._next_due(steps.batches)

    def _next_due(self, batches: int) -> float:
        due = min((g.due for g in self._due_guards), default=math.inf)
        return min(due, batches + DRAIN_EVERY)

    def _on_due(self, batches: int) -> float:
        """At a due train batch's start: lets due guards act (they read the log if they need)."""
        steps = self.steps
        if len(steps.entries) >= DRAIN_EVERY:  # nobody read it for a while: keep it small
            steps.drain()
        try:
            for guard in self._due_guards:
                if guard.due <= batches:
                    guard.on_due(batches)  # type: ignore[attr-defined]
        finally:  # what they posted at this batch goes as one exchange
            self.intervals.flush()
        return self._next_due(batches)

    def open(self, log_metrics: MetricSink | None = None) -> None:
        """Creates the side channel and binds the guards (idempotent per fit)."""
        if self.channel is None:
            try:
                self.channel = SideChannel.from_environment(timeout_s=self.timeout_s)
            except Exception as exc:  # never turn a healthy run into a failed one
                logger.warning(
                    "rankguard: cannot reach the other ranks (%s: %s); cross-rank checks are "
                    "off for this run",
                    type(exc).__name__,
                    exc,
                )
                self.channel = SideChannel(None)
        for guard in self.guards:
            guard.bind(self.channel, log_metrics)

    def error(self, exc: BaseException, facts: EventFacts) -> None:
        """Lets guards that explain errors (``on_error``) log what they know about ``exc``.

        Those that tell the other ranks go last: a peer told ends within seconds, and its
        launcher then stops this rank, maybe before a later line was logged.
        """
        for guard in sorted(self.guards, key=lambda g: g.tells_peers_on_error):
            on_error = getattr(guard, "on_error", None)
            if on_error is not None:
                try:
                    on_error(exc, facts)
                except Exception:
                    logger.exception("rankguard: %s could not explain the error", guard.name)

    def state_dict(self) -> dict[str, Any]:
        """Every guard's checkpoint state, by guard name (guards with none are left out)."""
        return {guard.name: state for guard in self.guards if (state := guard.state_dict())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Gives each guard its part of a checkpoint's state; unknown names are ignored."""
        for guard in self.guards:
            if state and guard.name in state:
                guard.load_state_dict(state[guard.name])

    def close(self) -> None:
        """Closes every guard; safe to call twice and after an error."""
        for guard in self.guards:
            try:
                guard.close()
            except Exception as exc:  # the exception in the line itself: a recording shows it
                logger.exception("rankguard: closing %s failed (%r)", guard.name, exc)
        self.intervals.close()
        self.channel = None
        self.steps.reset()  # a per-step event after this reaches nobody
