"""BackgroundExchange's thread at the interpreter's exit: closed, and an exchange in flight ended.

A thread still inside a store request when the interpreter finalizes is ended by Python
inside torch's C++ code, which aborts the process (``terminate called without an active
exception``, SIGABRT) after a healthy fit. The exit waits for it instead (``close_at_exit``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rankguard.callbacks.core import background_exchange
from rankguard.callbacks.core.background_exchange import BackgroundExchange

ROOT = Path(__file__).resolve().parents[2]


class SlowChannel:
    """A distributed channel whose exchange answers after ``seconds`` (a peer slow to post)."""

    is_distributed = True

    def __init__(self, seconds: float, done: Path | None = None) -> None:
        self.seconds, self.done = seconds, done

    def exchange(self, name, payload, decide):
        time.sleep(self.seconds)
        if self.done is not None:
            self.done.write_text(repr(payload))
        return decide({0: payload})


def test_the_interpreters_exit_waits_for_an_exchange_still_in_flight(tmp_path):
    # The fit ended and the script returns at once, its last exchange still waiting for
    # its verdict: the process exits only once that exchange ended, and exits 0.
    done = tmp_path / "done"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from rankguard.callbacks.core.background_exchange import BackgroundExchange
        from tests.core.test_background_exchange import SlowChannel

        exchange = BackgroundExchange(SlowChannel(1.0, Path({str(done)!r})), "t", lambda v: v)
        exchange.post(lambda: "last interval")
        """
    )
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert done.read_text() == "'last interval'"


def test_at_exit_an_idle_thread_ends_at_once_and_a_busy_one_after_its_exchange():
    idle = BackgroundExchange(SlowChannel(0.0), "idle", lambda v: v)
    assert idle.post(lambda: 1).result(5) == {0: 1}
    busy = BackgroundExchange(SlowChannel(0.5), "busy", lambda v: v)
    pending = busy.post(lambda: 2)
    started = time.monotonic()
    background_exchange.close_at_exit()
    took = time.monotonic() - started
    assert not idle._thread.is_alive() and not busy._thread.is_alive()
    assert pending.result(0) == {0: 2}  # its exchange ended, not cut
    assert took < background_exchange.EXIT_WAIT_S
