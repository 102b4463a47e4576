"""Waits that finish whatever a signal handler raises meanwhile (``core/interrupts.py``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from rankguard.callbacks.core.interrupts import wait_through_signals


def _fit_failed(signum, frame):
    """What OLMo-core 2.4's SIGTERM handler raises once its fit failed (``is_canceled``)."""
    raise RuntimeError("An error occurred")


@pytest.fixture
def raising_sigusr1():
    before = signal.signal(signal.SIGUSR1, _fit_failed)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_a_join_goes_on_through_a_signal_handlers_error_and_says_so(raising_sigusr1, caplog):
    thread = threading.Thread(target=time.sleep, args=(0.5,))  # the watchdog's last exchange
    sent = []

    def join(seconds):  # the launcher's SIGTERM arrives while rankguard joins
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGUSR1)
        thread.join(seconds)

    caplog.set_level(logging.INFO, logger="rankguard")
    started = time.monotonic()
    thread.start()
    assert wait_through_signals(join, lambda: not thread.is_alive(), 10.0, "it closed")
    assert not thread.is_alive() and time.monotonic() - started < 5.0
    assert "RuntimeError raised while it closed; rankguard finishes that first." in caplog.text


def test_the_wait_is_bounded_and_an_interrupt_goes_through_unless_asked():
    never = threading.Event()
    started = time.monotonic()
    assert not wait_through_signals(never.wait, never.is_set, 0.3, "never")
    assert 0.25 < time.monotonic() - started < 2.0

    def interrupted(seconds):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_through_signals(interrupted, never.is_set, 1.0, "never")
    calls = []

    def once_interrupted(seconds):
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        never.set()

    assert wait_through_signals(once_interrupted, never.is_set, 1.0, "it", through=BaseException)
    assert len(calls) == 2


def test_a_request_to_end_the_process_waited_through_is_kept_for_the_caller(caplog):
    never = threading.Event()
    calls = []

    def stopped_then_done(seconds):  # Composer's SIGTERM handler, then a SIGCHLD one's error
        calls.append(seconds)
        if len(calls) == 1:
            raise SystemExit(143)
        if len(calls) == 2:
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")
        never.set()

    ends: list[BaseException] = []
    caplog.set_level(logging.INFO, logger="rankguard")
    assert wait_through_signals(
        stopped_then_done, never.is_set, 5.0, "it", through=BaseException, ends=ends
    )
    assert len(calls) == 3
    assert [type(e) for e in ends] == [SystemExit] and ends[0].code == 143
    assert (
        "SystemExit raised while it; rankguard finishes that first, then raises it." in caplog.text
    )
    assert "RuntimeError raised while it; rankguard finishes that first." in caplog.text
