"""Side-channel exchanges run on a background thread: post now, collect the verdict later.

A guard that compares ranks every few steps need not stop the training loop
while the deciding rank waits for every payload and decides: it posts a
function that builds its payload (:meth:`BackgroundExchange.post` returns at
once), a daemon thread builds the payload and runs
:meth:`SideChannel.exchange` with it, and the guard collects the verdict
some steps later (:meth:`Pending.result`), by which time it has normally
arrived. Every rank posts and collects at the same steps, so every rank acts
on the same verdict at the same step (an error raised from it stops every
rank together). A local channel (world size 1) has nothing to wait for: there
the payload is built and decided at once, on the caller's thread.

Exchanges run one at a time, in the order posted, on one thread per
:class:`BackgroundExchange` (the side channel gives each thread its own store
connection). The thread is a daemon: a rank that ends while an exchange still
waits for a rank that died does not wait for it.

An exchange costs a few store requests, about 120 us of CPU on a warm thread
and 400-550 us in a training fit, however small its payload. Guards that
exchange every few train batches post into their runner's
:class:`IntervalExchange` instead: what they post at one batch travels as one
exchange, on one thread, and each guard gets its own part of the verdict.
Where a guard leaves its interval to rankguard (``interval=None``), the
verdict also sets when the next one goes (:meth:`PartPending.next_post`): every
:data:`AUTO_INTERVAL` batches, stretched at fast steps so that an exchange
comes at most every :data:`AUTO_INTERVAL_S` seconds.
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any

from rankguard.callbacks.core.ranks import rank_label
from rankguard.callbacks.core.side_channel import SideChannel, spread_period
from rankguard.callbacks.core.store_health import store_health

__all__ = [
    "AUTO_INTERVAL",
    "AUTO_INTERVAL_S",
    "INTERVAL_RANKS_PER_S",
    "BackgroundExchange",
    "ExchangeSkewed",
    "IntervalExchange",
    "PartPending",
    "Pending",
    "auto_interval_s",
]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.background_exchange")

#: Train batches between a monitor's exchanges when its ``interval`` is left to rankguard.
AUTO_INTERVAL = 50
#: ... and the shortest time between them: where :data:`AUTO_INTERVAL` batches take less,
#: the interval is the smallest multiple of it that takes this long at the pace of the
#: last one (an exchange costs 400-550 us of CPU in a fit: at 10 ms steps, 50 batches
#: apart, that is 10 us a step; 5 s apart, 1 us). Beyond 640 ranks it grows with the
#: world size (:func:`auto_interval_s`).
AUTO_INTERVAL_S = 5.0
#: Ranks a second whose interval exchange the store serves, job-wide, at most (three
#: requests each on a rank but 0): the shortest time between exchanges is
#: ``max(AUTO_INTERVAL_S, world_size / INTERVAL_RANKS_PER_S)``, 128 s at 16,384 ranks.
INTERVAL_RANKS_PER_S = 128.0


def auto_interval_s(world_size: int) -> float:
    """The shortest time between interval exchanges a job of ``world_size`` ranks leaves to us.

    :data:`AUTO_INTERVAL_S` up to 640 ranks; beyond, one second per
    :data:`INTERVAL_RANKS_PER_S` ranks, so that what the exchanges ask of the store's one
    thread does not grow with the world size (docs/scale.md).
    """
    return spread_period(AUTO_INTERVAL_S, world_size, INTERVAL_RANKS_PER_S)


class Pending:
    """One posted exchange: its verdict or error once the thread has run it.

    Attributes:
        payload: What this rank sent, once the thread has built it.
        first: The first exchange its thread runs: the thread starts and opens its store
            connection first, most often at a fit's start, when the machine is busiest.
        left: Where a guard stopped waiting for its verdict (``None`` while none has): the
            train batch, the seconds it waited and why; the guards whose parts share the
            exchange wait for it once a batch, not each.
    """

    def __init__(self, threaded: bool = True, *, first: bool = False) -> None:
        self.first = first
        self.left: tuple[int, float, str] | None = None
        # Held until the verdict arrives: a lock is made and waited on in C, where an
        # Event is a Condition built in Python (posted and collected on the training thread).
        self._done = threading.Lock() if threaded else None
        if self._done is not None:
            self._done.acquire()
        self._finished = False
        self.payload: Any = None
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether the verdict (or an error) has arrived."""
        return self._finished

    def wait(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the verdict (or an error); whether it is in."""
        return self._finished or self._arrived(timeout_s)

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._finished = True
        if self._done is not None:
            self._done.release()

    def result(self, timeout_s: float | None = None) -> Any:
        """The verdict; waits up to ``timeout_s`` (``None``: as long as it takes).

        Raises:
            TimeoutError: No verdict within ``timeout_s``.
            Exception: Whatever the exchange raised (e.g. ``RanksMissingError``).
        """
        if not self._finished and not self._arrived(timeout_s):
            raise TimeoutError("no verdict yet")
        if self._error is not None:
            raise self._error
        return self._value

    def _arrived(self, timeout_s: float | None) -> bool:
        """Waits up to ``timeout_s`` for the verdict; the lock is left free for other waiters."""
        done = self._done
        if done is None or not done.acquire(timeout=-1 if timeout_s is None else timeout_s):
            return self._finished
        done.release()
        return True


#: How long the interpreter's exit waits for the exchanges threads still run (see
#: :func:`close_at_exit`): a healthy peer's answer comes in milliseconds.
EXIT_WAIT_S = 5.0
#: The exchanges whose thread started, until collected.
_STARTED: weakref.WeakSet[BackgroundExchange] = weakref.WeakSet()


def close_at_exit() -> None:
    """Closes every exchange at the interpreter's exit; waits for those a thread still runs.

    A thread inside an exchange waits in a store request, in torch's C++ code with the
    GIL released. Should the answer come once the interpreter is finalizing, Python ends
    the thread where it takes the GIL back, inside a C++ destructor, and the C++ runtime
    aborts the process: ``terminate called without an active exception`` (SIGABRT) after
    a fit that ended healthy, its last exchange (a peer slower to post) still in flight.
    Functions registered with :mod:`atexit` run before that point; idle threads end at
    once, busy ones after their exchange, within :data:`EXIT_WAIT_S` in all.
    """
    started = perf_counter()
    for exchange in list(_STARTED):
        exchange.close()
        thread = exchange._thread
        if thread is not None and thread.is_alive():
            thread.join(max(0.0, EXIT_WAIT_S - (perf_counter() - started)))


atexit.register(close_at_exit)


class BackgroundExchange:
    """Runs one guard's exchanges on a daemon thread, in the order posted.

    Args:
        channel: The side channel to exchange on.
        name: The exchange's name (see :meth:`SideChannel.exchange`).
        decide: The pure decision, run on the deciding rank.

    Example::

        exchange = BackgroundExchange(channel, "straggler_monitor/interval", decide)
        pending = exchange.post(lambda: summarize(samples))  # returns at once
        ...                                                   # some training steps later
        verdict = pending.result(timeout_s=channel.timeout_s)
        exchange.close()
    """

    def __init__(
        self, channel: SideChannel, name: str, decide: Callable[[Mapping[int, Any]], Any]
    ) -> None:
        self.channel = channel
        self.name = name
        self.decide = decide
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def post(self, build: Callable[[], Any], decide: Decide | None = None) -> Pending:
        """Queues an exchange of what ``build()`` returns (run on the thread); returns at once.

        ``decide``: this exchange's decision, in place of the one given at creation.
        """
        decide = self.decide if decide is None else decide
        if self._closed or not self.channel.is_distributed:
            pending = Pending(threaded=False)
            if self._closed:
                pending._finish(error=RuntimeError(f"exchange {self.name!r} is closed"))
            else:  # a local channel: nothing to wait for
                self._run(build, pending, decide)
            return pending
        pending = Pending(first=self._thread is None)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"rankguard-{self.name}", daemon=True
            )
            self._thread.start()
            _STARTED.add(self)
        self._jobs.put((build, pending, decide))
        return pending

    def close(self) -> None:
        """Stops the thread after the exchange it runs; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)

    def _run(self, build: Callable[[], Any], pending: Pending, decide: Decide) -> None:
        try:
            pending.payload = build()
            pending._finish(self.channel.exchange(self.name, pending.payload, decide))
        except BaseException as exc:  # handed to the collector, never lost on a thread
            pending._finish(error=exc)


#: A decision: every rank's payload, by rank, to the verdict.
Decide = Callable[[Mapping[int, Any]], Any]
_Job = tuple[Callable[[], Any], Pending, Decide]


class ExchangeSkewed(RuntimeError):
    """A part failed because ranks posted it at different batches after a late verdict.

    A rank whose guard acted on an earlier verdict late (``Guard.verdict_late``: the store
    answered slowly) may post its next exchanges at other batches than the others: that
    exchange is skipped.
    """


@dataclass(frozen=True)
class _PartFailed:
    """A part with no verdict: why (a rank could not build it, or its decision raised).

    ``skewed``: the ranks posted it at different batches after a late verdict.
    """

    message: str
    skewed: bool = False


class PartPending:
    """One guard's part of an :class:`IntervalExchange`: its verdict and payload once sent.

    Attributes:
        part: The part's name (the guard's).
    """

    def __init__(self, part: str) -> None:
        self.part = part
        self._whole: Pending | None = None  # the exchange it went in, once flushed
        self._world = 1  # the ranks it went to (the stretch grows with them)

    def wait(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the exchange's verdict (or an error); whether it is in."""
        return self._whole is None or self._whole.wait(timeout_s)

    @property
    def first(self) -> bool:
        """Whether it went in the first exchange of its thread (see :attr:`Pending.first`)."""
        return self._whole is not None and self._whole.first

    @property
    def left(self) -> tuple[int, float, str] | None:
        """The exchange's :attr:`Pending.left` (``None`` until it was flushed)."""
        return None if self._whole is None else self._whole.left

    @left.setter
    def left(self, left: tuple[int, float, str] | None) -> None:
        if self._whole is not None:
            self._whole.left = left

    @property
    def payload(self) -> Any:
        """What this rank sent for this part (``None`` until the exchange ran)."""
        whole = self._whole
        return None if whole is None or whole.payload is None else whole.payload[1].get(self.part)

    def result(self, timeout_s: float | None = None) -> Any:
        """This part's verdict; waits up to ``timeout_s`` (``None``: as long as it takes).

        Raises:
            TimeoutError: No verdict within ``timeout_s``.
            RuntimeError: The part was never sent, some rank could not build it, or
                its decision failed.
            Exception: Whatever the whole exchange raised (e.g. ``RanksMissingError``).
        """
        if self._whole is None:
            raise RuntimeError(f"part {self.part!r} was posted but never sent")
        verdicts = self._whole.result(timeout_s)[0]
        if self.part not in verdicts:
            raise RuntimeError(
                f"rankguard exchange part {self.part!r} failed: the deciding rank did not post "
                "it at this batch"
            )
        verdict = verdicts[self.part]
        if isinstance(verdict, _PartFailed):
            error = ExchangeSkewed if verdict.skewed else RuntimeError
            raise error(f"rankguard exchange part {self.part!r} failed: {verdict.message}")
        return verdict

    def next_post(self, batch: int, interval: int, auto: bool) -> int:
        """The train batch of this part's next exchange, the same on every rank.

        ``interval`` batches after ``batch`` (this one's), or after the latest batch
        any rank posted this exchange at where they differed. ``auto``: the smallest
        multiple of ``interval`` batches that lasts :func:`auto_interval_s` at the
        pace the verdict agreed (the slowest rank's over the last interval). Call it
        once the verdict or an error is in (after :meth:`result`); without a verdict,
        ``interval`` batches after ``batch``.
        """
        whole = self._whole
        if whole is None or not whole.done or whole._error is not None:
            return batch + interval
        _, latest, pace = whole._value  # see _Verdicts
        stretch = 1
        if auto and pace:
            stretch = max(1, math.ceil(auto_interval_s(self._world) / (interval * pace)))
        return max(batch, latest) + interval * stretch


#: An interval exchange's verdict, ``(parts, batch, pace)``: each part's verdict (a
#: :class:`_PartFailed` where it has none); the latest train batch any rank posted the
#: exchange at; the slowest rank's seconds per train batch since its last exchange (or the
#: fit's start), ``None`` where no rank could measure it. A plain tuple: it goes over the
#: store to every rank at every exchange (a dataclass pickles 90 bytes longer).
_Verdicts = tuple[dict[str, Any], int, "float | None"]


class IntervalExchange:
    """The exchanges guards post at one train batch, sent as one on one background thread.

    Each guard posts its part (:meth:`post`: a build and a decision); the runner
    sends them (:meth:`flush`) once every due guard has run at that batch. On the thread,
    every part is built, one exchange carries them all, and the deciding rank
    decides each part over the ranks that sent it: a part some rank could not
    build, or whose decision raised, fails alone. Ranks that posted at different
    batches (guards set differently per rank) get a failed part each.

    Args:
        name: The exchange's name (see :meth:`SideChannel.exchange`).
    """

    def __init__(self, name: str = "intervals") -> None:
        self.name = name
        self._exchange: BackgroundExchange | None = None
        self._channel: SideChannel | None = None
        self._batch = 0
        self._posted: dict[str, tuple[Callable[[], Any], Decide, PartPending]] = {}
        #: (time, train batch) of the last exchange sent, or of the fit's start.
        self._since: tuple[float, int] | None = None

    def restart(self) -> None:
        """A fit starts: the pace of its first exchange is measured from now."""
        self._since = (perf_counter(), 0)

    def post(
        self,
        channel: SideChannel,
        batch: int,
        part: str,
        build: Callable[[], Any],
        decide: Decide,
    ) -> PartPending:
        """Adds ``part`` to the exchange of train batch ``batch``; sent at :meth:`flush`."""
        if self._posted and batch != self._batch:  # the runner flushes each batch: not expected
            self.flush()
        self._channel, self._batch = channel, batch
        pending = PartPending(part)
        self._posted[part] = (build, decide, pending)
        return pending

    def flush(self) -> None:
        """Sends what was posted at this batch as one exchange (nothing if nothing was)."""
        if not self._posted:
            return
        posted, self._posted = self._posted, {}
        now, batch, since = perf_counter(), self._batch, self._since
        pace = (now - since[0]) / (batch - since[1]) if since and batch > since[1] else None
        self._since = (now, batch)
        channel = self._channel
        assert channel is not None
        exchange = self._exchange
        if exchange is None or exchange.channel is not channel:  # a new fit or channel
            if exchange is not None:
                exchange.close()
            exchange = self._exchange = BackgroundExchange(
                channel, self.name, partial(_decide_parts, {})
            )
        builds = {part: build for part, (build, _, _) in posted.items()}
        decides = {part: decide for part, (_, decide, _) in posted.items()}
        whole = exchange.post(
            partial(_build_parts, batch, builds, pace), partial(_decide_parts, decides)
        )
        for _, _, pending in posted.values():
            pending._whole = whole
            pending._world = channel.world_size

    def close(self) -> None:
        """Stops the thread after the exchange it runs; safe to call twice."""
        self._posted = {}
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.close()


def _build_parts(
    batch: int, builds: Mapping[str, Callable[[], Any]], pace: float | None
) -> tuple[int, dict, float | None, bool]:
    """``(batch, {part: payload}, pace, left_late)``; a part whose build raised is sent failed.

    ``left_late``: a guard of this rank left a verdict for a later batch (the store
    answered slowly), so it may post at other batches than the other ranks.
    """
    parts: dict[str, Any] = {}
    for part, build in builds.items():
        try:
            parts[part] = build()
        except Exception as exc:
            logger.exception("rankguard: could not build exchange part %r", part)
            parts[part] = _PartFailed(f"{type(exc).__name__}: {exc}")
    return batch, parts, pace, store_health.left_late


def _decide_parts(decides: Mapping[str, Decide], values: Mapping[int, Any]) -> _Verdicts:
    """Each part's verdict over the ranks that sent it (the deciding rank's parts)."""
    batches = {rank: value[0] for rank, value in values.items()}
    paces = [value[2] for value in values.values() if value[2] is not None]
    latest, pace = max(batches.values()), max(paces, default=None)
    if len(set(batches.values())) > 1:
        late = [rank for rank, value in values.items() if value[3]]
        why = (
            f"{rank_label(late)} acted on an earlier verdict late"
            if late
            else "are the guards set the same on every rank?"
        )
        failed = _PartFailed(
            f"the ranks posted it at different train batches ({batches}): {why}", bool(late)
        )
        return dict.fromkeys(decides, failed), latest, pace
    verdicts: dict[str, Any] = {}
    for part, decide in decides.items():
        sent = {rank: value[1][part] for rank, value in values.items() if part in value[1]}
        broken = [rank for rank, payload in sent.items() if isinstance(payload, _PartFailed)]
        if broken:
            verdicts[part] = _PartFailed(
                f"rank {broken[0]} could not build it: {sent[broken[0]].message}"
            )
            continue
        try:
            verdicts[part] = decide(sent)
        except Exception as exc:
            logger.exception("rankguard: deciding exchange part %r failed", part)
            verdicts[part] = _PartFailed(f"{type(exc).__name__}: {exc}")
    return verdicts, latest, pace
