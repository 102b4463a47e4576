"""Side-channel exchanges run on a background thread: post now, collect the verdict later.

A guard that compares ranks every few steps need not stop the training loop
while the deciding rank waits for every payload and decides: it posts its
payload (:meth:`BackgroundExchange.post` returns at once), a daemon thread
runs :meth:`SideChannel.exchange` with it, and the guard collects the verdict
some steps later (:meth:`BackgroundExchange.collect`), by which time it has
normally arrived. Every rank posts and collects at the same steps, so every
rank acts on the same verdict at the same step (an error raised from it stops
every rank together).

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

from rankguard.callbacks.side_channel import SideChannel

__all__ = ["BackgroundExchange", "Pending"]

logger = logging.getLogger(__name__)


class Pending:
    """One posted exchange: its verdict or error once the thread has run it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether the verdict (or an error) has arrived."""
        return self._done.is_set()

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def result(self, timeout_s: float | None = None) -> Any:
        """The verdict; waits up to ``timeout_s`` (``None``: as long as it takes).

        Raises:
            TimeoutError: No verdict within ``timeout_s``.
            Exception: Whatever the exchange raised (e.g. ``RanksMissingError``).
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError("no verdict yet")
        if self._error is not None:
            raise self._error
        return self._value


class BackgroundExchange:
    """Runs one guard's exchanges on a daemon thread, in the order posted.

    Args:
        channel: The side channel to exchange on.
        name: The exchange's name (see :meth:`SideChannel.exchange`).
        decide: The pure decision, run on the deciding rank.

    Example::

        exchange = BackgroundExchange(channel, "straggler_monitor/interval", decide)
        pending = exchange.post(payload)      # returns at once
        ...                                   # some training steps later
        verdict = pending.result(timeout_s=channel.timeout_s)
        exchange.close()
    """

    def __init__(
        self, channel: SideChannel, name: str, decide: Callable[[Mapping[int, Any]], Any]
    ) -> None:
        self.channel = channel
        self.name = name
        self.decide = decide
        self._jobs: queue.SimpleQueue[tuple[Any, Pending] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def post(self, payload: Any) -> Pending:
        """Queues an exchange of ``payload``; returns at once."""
        pending = Pending()
        if self._closed:
            pending._finish(error=RuntimeError(f"exchange {self.name!r} is closed"))
            return pending
        if not self.channel.is_distributed:  # nothing to wait for: decide here
            self._run(payload, pending)
            return pending
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"rankguard-{self.name}", daemon=True
            )
            self._thread.start()
        self._jobs.put((payload, pending))
        return pending

    def close(self) -> None:
        """Stops the thread after the exchange it runs; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            payload, pending = job
            self._run(payload, pending)

    def _run(self, payload: Any, pending: Pending) -> None:
        try:
            pending._finish(self.channel.exchange(self.name, payload, self.decide))
        except BaseException as exc:  # handed to the collector, never lost on this thread
            pending._finish(error=exc)
