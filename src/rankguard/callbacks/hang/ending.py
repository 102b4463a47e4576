"""The one way rankguard ends a process: evidence, process groups aborted, ranks met, exit.

Every end rankguard causes (a verdict's 70 or 75, a peer's fault, a teardown past its
bound) goes through :func:`end_process`. The order and why: docs/hang.md#how-rankguard-ends-a-job.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, NoReturn

from rankguard.callbacks.core import torch_private

__all__ = ["ABORT_WAIT_S", "LEAVE_WAIT_S", "abort_process_groups", "end_process", "flush_logs"]

logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

#: An abort of the process groups that has not returned within this (seconds) is left
#: behind: the process ends anyway (an abort can itself wait on a broken fabric).
ABORT_WAIT_S = 5.0
#: How long rank 0, which may host the store, waits at the end for the others' last request.
LEAVE_WAIT_S = 5.0
_KEYS = "ending"


def flush_logs() -> None:
    """Flushes every root handler and the standard streams: the process ends with ``os._exit``."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, or replaced by None
            pass


def abort_process_groups(wait_s: float = ABORT_WAIT_S) -> str:
    """Aborts this process's process groups, waiting at most ``wait_s``; says what happened.

    On NCCL this cancels the collectives in flight before the process (and its CUDA
    context) ends, as PyTorch's own watchdog does on a timeout: a process that ends
    with a communicator open can fault its NVLink peers. Runs on a thread of its own:
    an abort that waits does not hold the exit.
    """
    outcome: list[str] = []

    def abort() -> None:
        try:
            outcome.append("aborted" if torch_private.abort_process_groups() else "none open")
        except Exception as exc:  # already destroyed, or a torch without the reach
            outcome.append(f"not aborted ({type(exc).__name__}: {exc})")

    thread = threading.Thread(target=abort, name="rankguard-abort", daemon=True)
    thread.start()
    thread.join(wait_s)
    return outcome[0] if outcome else f"abort still running after {wait_s:g} s: left behind"


def _meet(
    channel: Any, skip: Iterable[int], window_s: float, leaving: Callable[[], None] | None
) -> None:
    """Every rank reaches the end within ``window_s``; rank 0, which may host the store, last.

    ``leaving()`` first (the fault board: this rank ends without a fault). Each rank
    says it arrived, waits for the others (not ``skip``: ranks known gone), then says
    it leaves (its last store request); rank 0 waits for those before it exits. Never
    raises: a rank late or gone is not waited for past the window.

    Counted, not named: the ``n``-th rank to arrive (or leave) sets key ``n``, so a rank
    waits on one key whatever the world size (``arrived/<ranks it expects>``), and no rank
    reads every other rank's key (16,384 ranks each waiting on 16,383 keys ask the store
    to look up 268 million).
    """
    if leaving is not None:
        try:
            leaving()
        except Exception as exc:
            logger.debug("rankguard: could not say this rank leaves: %s", exc)
    rank, world = channel.rank, channel.world_size
    skipped = {rank, *skip}
    expected = 1 + sum(1 for r in range(world) if r not in skipped)  # this rank too
    base = f"{channel.prefix}/{_KEYS}"
    store = channel.store
    try:
        arrived = store.add(f"{base}/arrived", 1)
        store.set(f"{base}/arrived/{arrived}", b"1")
        if expected > 1:
            store.wait([f"{base}/arrived/{expected}"], timedelta(seconds=window_s))
    except Exception as exc:
        logger.debug("rankguard: not every rank reached the end within %g s: %s", window_s, exc)
    try:
        if not channel.is_leader:
            left = store.add(f"{base}/left", 1)
            store.set(f"{base}/left/{left}", b"1")
            return
        others = store.add(f"{base}/arrived", 0) - 1  # those that arrived: each leaves once
        if others > 0:
            store.wait([f"{base}/left/{others}"], timedelta(seconds=LEAVE_WAIT_S))
    except Exception as exc:
        logger.debug("rankguard: the end's last store request failed: %s", exc)


def end_process(
    code: int,
    *,
    channel: Any,
    why: str,
    evidence: Callable[[], None] | None = None,
    skip: Iterable[int] = (),
    window_s: float = LEAVE_WAIT_S,
    leaving: Callable[[], None] | None = None,
    exit_: Callable[[int], Any] = os._exit,
) -> NoReturn:
    """Ends this process with ``code``, in the one order that is safe for the fabric.

    1. ``evidence()``: the report files, stacks and flight recorder (errors logged).
    2. The logs flushed: nothing after this is printed by Python.
    3. This process's process groups aborted (at most :data:`ABORT_WAIT_S`).
    4. Every rank met (at most ``window_s``; ``skip``: ranks known gone), rank 0 last:
       bounded on a thread of its own (a store whose host is gone can hold a request
       for the client's own timeout, minutes).
    5. ``os._exit(code)``: no atexit handler or teardown can wait on a dead peer.

    Args:
        code: The exit code (``status.EXIT_CODES``).
        channel: The side channel whose store the ranks meet in (``None``: no meeting).
        why: What ended it, for the DEBUG log of the steps.
        evidence: Writes what this rank knows; called first.
        skip: Ranks not to wait for (gone, or the rank whose fault this is).
        window_s: How long a rank waits for the others to reach the end.
        leaving: Says on the store that this rank leaves, before the meeting.
        exit_: The exit (tests pass a recorder).
    """
    started = time.monotonic()
    if evidence is not None:
        try:
            evidence()
        except Exception as exc:
            logger.error("rankguard: could not write this rank's evidence: %s", exc)
    flush_logs()
    aborted = abort_process_groups()
    if channel is not None and channel.is_distributed:
        meeting = threading.Thread(
            target=_meet,
            args=(channel, tuple(skip), window_s, leaving),
            name="rankguard-end",
            daemon=True,
        )
        meeting.start()
        meeting.join(window_s + LEAVE_WAIT_S + 1.0)
    logger.info(
        "rankguard: ending (%s) with exit code %d: process groups %s, %.2f s after the end began.",
        why,
        code,
        aborted,
        time.monotonic() - started,
    )
    flush_logs()
    exit_(code)
    raise SystemExit(code)  # only where ``exit_`` returned (a test's recorder)
