"""Waits in rankguard's own code that finish whatever a signal handler raises meanwhile.

Python runs a signal handler in the main thread, wherever it is; a handler that raises
(the DataLoader's SIGCHLD handler when a worker died, OLMo-core's SIGTERM handler once
the fit failed) raises inside whatever rankguard was waiting for there: a fault half
published, a watchdog thread half closed. These waits go on to their end, bounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["wait_through_signals"]

logger = logging.getLogger("rankguard.callbacks.hang_watchdog")


def wait_through_signals(
    wait: Callable[[float], object],
    done: Callable[[], bool],
    limit_s: float,
    what: str,
    *,
    through: type[BaseException] = Exception,
    ends: list[BaseException] | None = None,
) -> bool:
    """Calls ``wait(seconds left)`` until ``done()`` or ``limit_s``; whether it is done.

    An exception of class ``through`` raised meanwhile (by a signal handler: the wait
    itself does not raise) is logged at INFO and the wait goes on: the exception follows
    from what rankguard is finishing, which matters more. A request to end the process
    (``SystemExit`` from a framework's SIGTERM handler, ``KeyboardInterrupt``) is not
    dropped where ``ends`` is given: the first is kept there for the caller to raise once
    it finished (a launcher that stops the ranks waits for them, then kills them).

    Args:
        wait: Blocks at most the seconds it is given (``Event.wait``, ``Thread.join``).
        done: Whether the awaited thing happened.
        limit_s: The longest wait in all.
        what: What is awaited, for the log: ``"this rank told the others its fault"``.
        through: The exceptions waited through (``BaseException``: even an interrupt).
        ends: Where to keep a request to end the process that was waited through.
    """
    deadline = time.monotonic() + limit_s
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            wait(left)
        except through as late:
            kept = ends is not None and not isinstance(late, Exception)
            logger.info(
                "rankguard: %s raised while %s; rankguard finishes that first%s.",
                type(late).__name__,
                what,
                ", then raises it" if kept else "",
            )
            if kept and not ends:
                ends.append(late)
    return True
