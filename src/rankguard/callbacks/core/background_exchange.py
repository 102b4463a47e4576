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
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from rankguard.callbacks.core.side_channel import SideChannel

__all__ = ["BackgroundExchange", "Pending"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.background_exchange")


class Pending:
    """One posted exchange: its verdict or error once the thread has run it.

    Attributes:
        payload: What this rank sent, once the thread has built it.
    """

    def __init__(self, threaded: bool = True) -> None:
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
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Pending] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._closed = False

    def post(self, build: Callable[[], Any]) -> Pending:
        """Queues an exchange of what ``build()`` returns (run on the thread); returns at once."""
        if self._closed or not self.channel.is_distributed:
            pending = Pending(threaded=False)
            if self._closed:
                pending._finish(error=RuntimeError(f"exchange {self.name!r} is closed"))
            else:  # a local channel: nothing to wait for
                self._run(build, pending)
            return pending
        pending = Pending()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"rankguard-{self.name}", daemon=True
            )
            self._thread.start()
        self._jobs.put((build, pending))
        return pending

    def close(self) -> None:
        """Stops the thread after the exchange it runs; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)

    def _run(self, build: Callable[[], Any], pending: Pending) -> None:
        try:
            pending.payload = build()
            pending._finish(self.channel.exchange(self.name, pending.payload, self.decide))
        except BaseException as exc:  # handed to the collector, never lost on a thread
            pending._finish(error=exc)
