"""A preemption signal, agreed: every rank stops after one train step, then exits with 75.

The handler notes the signal; the watchdog thread publishes and reads requests; the loop
parks at its next step boundary; rank 0 decides the step. The adapter ends its loop there
and the process exits with 75 when Python exits, after the user's code that follows the
fit (:func:`exit_at_interpreter_exit`). docs/hang.md#preemption-every-rank-stops-at-one-step.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rankguard.callbacks.core.side_channel import notify
from rankguard.callbacks.hang.ending import end_process
from rankguard.callbacks.hang.status import EXIT_CODES

__all__ = [
    "FRAMEWORKS",
    "SIGNAL_CHOICES",
    "STOP_EXIT_CODE",
    "StopAgreement",
    "StopRequest",
    "Stopped",
    "check_signals",
    "decide",
    "exit_at_interpreter_exit",
    "own_handlers",
]

logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

#: The exit code of a rank that stopped on an agreed preemption: restart the job.
STOP_EXIT_CODE = EXIT_CODES["preempted"]
#: A rank that saw the request and has not parked this long is inside a batch (waiting in
#: its collective for a parked peer, most often): its watchdog thread names its next boundary.
UNPARKED_S = 1.0
#: The signals a scheduler or launcher sends to preempt a job (SLURM's ``--signal``, LSF's
#: SIGUSR2, torchelastic's SIGTERM, a terminal's SIGINT), where this platform has them.
SIGNAL_CHOICES = tuple(
    n
    for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGPWR")
    if hasattr(signal, n)
)


#: The packages whose own handlers act on the signalled rank alone (Lightning's issues a
#: collective in it, OLMo-core's cancels that rank's run, the HF Trainer's saves on it):
#: the agreed stop does their work on every rank, so they are not called during the fit.
FRAMEWORKS = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "transformers",
    "accelerate",
    "composer",
    "olmo_core",
    "torch",
    "rankguard",
)


def own_handlers(handler: Any) -> list[Callable[[int, Any], Any]]:
    """The user's own handlers in ``handler``: a framework's, or Python's default, are not.

    A framework that composes the handlers it found with its own (Lightning's
    ``_HandlersCompose``, a ``signal_handlers`` list) is opened, so a handler the user
    set before the fit is found inside it.
    """
    inner = getattr(handler, "signal_handlers", None)
    if isinstance(inner, list | tuple):
        return [own for each in inner for own in own_handlers(each)]
    if not callable(handler) or handler is signal.default_int_handler:
        return []
    function = getattr(handler, "__func__", handler)
    module = getattr(function, "__module__", None) or ""
    return [] if module.split(".")[0] in FRAMEWORKS else [handler]


def _name(handler: Any) -> str:
    """``"main.<locals>.save"``, or a callable object's class with its module."""
    kind = type(handler)
    return getattr(handler, "__qualname__", None) or f"{kind.__module__}.{kind.__qualname__}"


def check_signals(value: Any) -> tuple[str, ...]:
    """``value`` (signal names) as a tuple, else ``ValueError`` naming ``stop_signals``."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(n in SIGNAL_CHOICES for n in names):
        raise ValueError(
            f"`stop_signals` must be a list of signal names from {', '.join(SIGNAL_CHOICES)} "
            f"(e.g. ['SIGTERM', 'SIGUSR1']), or [] for none; got {value!r}."
        )
    return tuple(dict.fromkeys(names))


def decide(claims: Mapping[int, int], world_size: int) -> int | None:
    """The agreed step: the last boundary any rank named, once every rank named one.

    Each rank names the first boundary it can still reach (where it parked, or the end
    of the batch it is inside); every rank can run on to the largest, so that is where
    every rank stops. ``None`` while a rank has not named one.
    """
    if any(rank not in claims for rank in range(world_size)):
        return None
    return max(claims.values())


@dataclass(frozen=True)
class StopRequest:
    """Who asked to stop: the rank that got the signal, which signal, when (Unix time)."""

    rank: int
    signal: str
    at: float

    def encode(self) -> bytes:
        """The store's value."""
        return f"{self.rank} {self.signal} {self.at!r}".encode()

    @classmethod
    def decode(cls, blob: bytes) -> StopRequest:
        """The request a store value holds."""
        rank, name, at = blob.decode().split()
        return cls(int(rank), name, float(at))


@dataclass(frozen=True)
class Stopped:
    """Why and where this rank's training stopped (``agreed``: at the agreed step)."""

    request: StopRequest | None
    step: int
    agreed: bool

    @property
    def reason(self) -> str:
        """``"preempted by SIGTERM on rank 1 at step 12"``."""
        if self.request is None:
            return f"preempted by a stop signal at step {self.step}"
        return f"preempted by {self.request.signal} on rank {self.request.rank} at step {self.step}"


class StopAgreement:
    """One rank's part in stopping every rank at one train step on a preemption signal.

    Three threads take part. The signal handler (main thread) only notes the signal.
    The watchdog thread calls :meth:`poll` once per wake: it publishes this rank's
    signal, reads whether any rank asked (one store request while none did), names
    this rank's next boundary when its loop is stuck inside a batch, and on rank 0
    publishes the decision. The training thread reads :attr:`requested` at each step
    boundary and, once set, calls :meth:`at_boundary`, which says whether to stop there.

    Args:
        signals: The signal names that ask for the stop (``()``: none).
        grace_s: How long this rank waits, from when it first knew of the stop, for the
            agreed step; past it the rank stops where it is.
        next_boundary: The first step boundary the training loop can still reach, from
            its heartbeats (``None``: none, its fit ended); called on the watchdog thread.

    Attributes:
        requested: Some rank asked to stop (the training thread's one read a step).
        stopped: Where and why this rank stopped, or ``None``.
    """

    def __init__(
        self, signals: Iterable[str], grace_s: float, next_boundary: Callable[[], int | None]
    ) -> None:
        self.signals = tuple(signals)
        self.grace_s = grace_s
        self._next_boundary = next_boundary
        self._previous: dict[int, Any] = {}
        self._chained: dict[int, list[Callable[[int, Any], Any]]] = {}
        self._fits = 0
        self.channel: Any = None
        self.reset(None)

    def reset(self, channel: Any) -> None:
        """A new fit on ``channel`` (its keys are the fit's own): nothing asked yet."""
        self._fits += 1
        self.channel = channel
        self._base = "" if channel is None else f"{channel.prefix}/stop/{self._fits}"
        self._signum: int | None = None  # set by the handler only
        self._signal_at = 0.0
        self._published = False
        self._since: float | None = None  # when this rank first knew (monotonic)
        self.requested = False
        self.request: StopRequest | None = None
        self._claim: int | None = None
        self._lock = threading.Lock()  # the two writers of this rank's claim
        self._decided = False  # rank 0 published the decision
        self._decision: int | None = None  # read by the training thread
        self.stopped: Stopped | None = None

    @property
    def _distributed(self) -> bool:
        return self.channel is not None and self.channel.is_distributed

    # -- the signal handler (main thread) -------------------------------------------------

    def install(self) -> None:
        """Catches :attr:`signals` (main thread only; at fit start); :meth:`restore` undoes it."""
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.info(
                "rankguard hang_watchdog: the fit started off the main thread: %s not caught, "
                "so a preemption is not agreed between the ranks",
                ", ".join(self.signals),
            )
            return
        for name in self.signals:
            signum = getattr(signal, name)
            previous = signal.signal(signum, self._handle)
            self._previous[signum] = previous
            self._chained[signum] = own_handlers(previous)
            if callable(previous) and previous is not signal.default_int_handler:
                self._say_chained(name, previous, self._chained[signum])

    @staticmethod
    def _say_chained(name: str, previous: Any, own: list[Callable[[int, Any], Any]]) -> None:
        """The INFO line on a handler found at install: called at the agreed step, or not."""
        if own:
            then = (
                f"and calls {', '.join(_name(h) for h in own)} on every rank at the agreed "
                "stop step, before the save"
            )
        else:
            then = "and does not call it: the agreed stop does its work on every rank"
        logger.info(
            "rankguard hang_watchdog: %s already had a handler (%s); rankguard catches it during "
            "the fit to stop every rank at one step, %s (it is restored when the fit ends)",
            name,
            _name(previous),
            then,
        )

    def _handle(self, signum: int, frame: Any) -> None:
        """Notes the signal: no lock, no I/O, no collective (the watchdog thread acts)."""
        del frame
        if self._signum is None:
            self._signal_at = time.monotonic()
            self._signum = signum

    def restore(self) -> None:
        """Puts back the handlers :meth:`install` replaced (those still rankguard's)."""
        previous, self._previous, self._chained = self._previous, {}, {}
        for signum, handler in previous.items():
            try:
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, handler)
            except (ValueError, TypeError) as exc:  # off the main thread, or at shutdown
                logger.debug("rankguard: could not restore the handler of %s: %s", signum, exc)

    # -- the watchdog thread, once per wake ----------------------------------------------

    def poll(self, notified: bool = True) -> None:
        """Publishes this rank's signal, reads the request, claims, decides (never raises).

        ``notified``: something was published since the last poll (the channel's
        notices changed); while no rank asked, the request count is read only then.
        """
        try:
            self._poll(notified)
        except Exception as exc:  # the store: the status exchange says what is wrong
            logger.debug("rankguard: stop agreement: store unreadable: %s", exc)

    def _poll(self, notified: bool = True) -> None:
        if self._signum is not None and not self._published:
            self._publish(self._signum)
            notified = True  # this rank's own request: read at once, as before
        if not self.requested:
            if not self._distributed or not notified:
                return
            if self.channel.store.add(f"{self._base}/count", 0) == 0:
                return
            self._since = self._since or time.monotonic()
            self.requested = True
        self._read_request()
        if self._claim is None and time.monotonic() - (self._since or 0) >= UNPARKED_S:
            boundary = self._next_boundary()
            if boundary is not None:
                self._claim_at(boundary, by="watchdog")
        if self._distributed and self.channel.is_leader and not self._decided:
            self._decide()

    def _publish(self, signum: int) -> None:
        """Asks every rank to stop (this rank got ``signum``): first request wins the words."""
        self._published = True
        name = signal.Signals(signum).name
        request = StopRequest(
            self._rank(), name, time.time() - (time.monotonic() - self._signal_at)
        )
        logger.info(
            "rankguard hang_watchdog: %s received; asking every rank to stop at one step", name
        )
        self._since = self._since or self._signal_at
        if not self._distributed:
            self.request, self.requested = request, True
            return
        store = self.channel.store
        if not store.check([f"{self._base}/request"]):
            store.set(f"{self._base}/request", request.encode())
        store.add(f"{self._base}/count", 1)
        notify(self.channel)  # the watchdogs read the count once this changes

    def _rank(self) -> int:
        return self.channel.rank if self.channel is not None else 0

    def _read_request(self) -> None:
        if self.request is None and self._distributed:
            key = f"{self._base}/request"
            if self.channel.store.check([key]):
                self.request = StopRequest.decode(self.channel.store.get(key))

    def _decide(self) -> None:
        """Rank 0: once every rank named its boundary, publishes the largest (bounded)."""
        if time.monotonic() - (self._since or 0) > self.grace_s:
            return  # too late: every rank stops where it is
        channel = self.channel
        keys = [f"{self._base}/at/r{rank}" for rank in range(channel.world_size)]
        if not channel.store.check(keys):
            return
        claims = {rank: int(v) for rank, v in enumerate(channel.store.multi_get(keys))}
        step = decide(claims, channel.world_size)
        if step is not None:
            channel.store.set(f"{self._base}/decision", str(step).encode())
            self._decided = True

    # -- both threads: this rank's claim --------------------------------------------------

    def _claim_at(self, boundary: int, by: str) -> int:
        """Names the boundary this rank stops at first; the first to name it wins."""
        with self._lock:
            if self._claim is None:
                self._claim = boundary
                if self._distributed:
                    self.channel.store.set(
                        f"{self._base}/at/r{self.channel.rank}", str(boundary).encode()
                    )
                logger.debug("rankguard: stop: this rank names step %d (%s)", boundary, by)
            return self._claim

    # -- the training thread, at a step boundary once requested --------------------------

    def at_boundary(self, completed: int) -> bool:
        """Whether the loop stops here, ``completed`` train steps done (it may park first).

        At the first boundary after the request the loop parks until the decision (at
        most the grace); it runs on to the agreed step, and stops there.
        """
        if self.stopped is not None:
            return True
        if self._decision is not None:
            return completed >= self._decision and self._stop(completed, agreed=True)
        claim = self._claim_at(completed, by="training loop")
        if completed < claim:
            return False  # inside a batch when it was named: the next boundaries first
        self._decision = self._await_decision()
        if self._decision is None:
            logger.error(
                "rankguard hang_watchdog: no agreed stop step within stop_grace_s=%g s (a rank "
                "did not answer); this rank stops after train step %d, where it is, and the "
                "others may stop elsewhere",
                self.grace_s,
                completed,
            )
            return self._stop(completed, agreed=False)
        if completed > self._decision:  # never: a claim is at least the next boundary
            logger.error(
                "rankguard hang_watchdog: the agreed stop step %d is behind this rank (step %d); "
                "it stops here",
                self._decision,
                completed,
            )
            return self._stop(completed, agreed=False)
        return completed == self._decision and self._stop(completed, agreed=True)

    def _await_decision(self) -> int | None:
        if not self._distributed:
            return self._claim
        left = (self._since or time.monotonic()) + self.grace_s - time.monotonic()
        key = f"{self._base}/decision"
        store = self.channel.store
        try:
            store.wait([key], timedelta(seconds=max(left, 0.01)))
            return int(store.get(key))
        except Exception as exc:  # the store's timeout
            logger.debug("rankguard: stop decision not read: %s", exc)
            return None

    def _stop(self, completed: int, agreed: bool) -> bool:
        if self.request is None and self._distributed:
            try:
                self._read_request()
            except Exception as exc:
                logger.debug("rankguard: stop request unreadable: %s", exc)
        self.stopped = Stopped(self.request, completed, agreed)
        if agreed:
            logger.warning(
                "rankguard hang_watchdog: Preempted: %s; every rank stops after train step %d "
                "(save now: the process then exits with code %d, restart the job).",
                self.stopped.reason.removeprefix("preempted by "),
                completed,
                STOP_EXIT_CODE,
            )
        self._call_chained()
        return True

    def _call_chained(self) -> None:
        """Calls the user's own handlers of the signal asked with (training thread, every rank).

        Never in a signal's context, never on one rank alone: at the step every rank
        stops at. A handler that exits (``sys.exit``) is told at INFO: the process exits
        with :data:`STOP_EXIT_CODE` after the save; one that raises is logged, and the
        stop goes on.
        """
        name = self.request.signal if self.request is not None else None
        signum = getattr(signal, name) if name in SIGNAL_CHOICES else self._signum
        for handler in self._chained.get(signum or -1, ()):
            try:
                handler(signum, None)
            except (SystemExit, KeyboardInterrupt) as exc:
                logger.info(
                    "rankguard hang_watchdog: %s asked to exit (%s); every rank stops at this "
                    "step instead, and the process exits with %d after the save",
                    _name(handler),
                    type(exc).__name__,
                    STOP_EXIT_CODE,
                )
            except Exception:
                logger.warning(
                    "rankguard hang_watchdog: %s raised when called at the agreed stop; the "
                    "stop goes on",
                    _name(handler),
                    exc_info=True,
                )


# -- the exit after a stop (an adapter's choice) ---------------------------------------

_exit_after: list[tuple[int, Any, float]] = []


def exit_at_interpreter_exit(code: int, channel: Any = None, window_s: float = 20.0) -> None:
    """Makes this process end with ``code`` when the interpreter exits (after the user's code).

    The loop's code after the fit (its save, its clean-up) runs first; then every
    ``atexit`` handler registered after this module was imported; then the one exit
    path (:func:`~rankguard.callbacks.hang.ending.end_process`): the logs flushed, the
    process groups aborted, every rank met on ``channel`` within ``window_s`` (a
    launcher that sees one rank exit stops the others: none must be cut off in its
    save), and the process ends with ``code`` whatever status it would have had.
    """
    _exit_after[:] = [(code, channel, window_s)]


def _exit_with_agreed_code() -> None:
    if not _exit_after:
        return
    code, channel, window_s = _exit_after[0]
    end_process(code, channel=channel, why="preempted", window_s=window_s)


atexit.register(_exit_with_agreed_code)  # at import: it runs after handlers registered later
