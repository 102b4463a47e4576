"""What one look at a peer's process costs the watchdog thread (``faults.is_alive``).

At every wake (every 0.5-2 s) each rank's watchdog thread asks whether each peer on its
node still runs: 7 looks a wake on a node of 8 GPUs. This starts a process shaped like a
rank (torch imported, 20 more threads), then times the look both ways ``is_alive`` can
take, on this thread's CPU clock, warm:

* ``pidfd``: ``os.pidfd_open``, a poll that does not wait, a close (Linux 5.3+);
* ``/proc``: reading ``/proc/PID/stat`` (where no pidfd can be opened), which the kernel
  builds by summing every thread's times.

Each figure is printed beside its budget (5 us a look), ``OVER`` where it is above it.

Usage: ``python benchmarks/peer_liveness.py [--looks 2000]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from rankguard.callbacks.hang import faults

logger = logging.getLogger("peer_liveness")

#: CPU time one look may take (µs).
BUDGET_US = 5.0
#: A process with torch imported and 20 threads more, alive for a minute.
RANK_LIKE = (
    "import threading, time, torch\n"
    "for _ in range(20):\n"
    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def cpu_us_per_look(pid: int, looks: int) -> float:
    """This thread's CPU time per ``faults.is_alive(pid)``, in microseconds (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(looks):
            faults.is_alive(pid)
        best = min(best, (time.thread_time() - start) / looks * 1e6)
    return best


def no_pidfd(pid: int) -> int:
    """``os.pidfd_open`` where the kernel has none: ``is_alive`` reads ``/proc``."""
    raise OSError(38, "Function not implemented")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--looks", type=int, default=2000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    peer = subprocess.Popen([sys.executable, "-c", RANK_LIKE], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        peer.stdout.readline()  # torch imported, its threads started
        threads = len(os.listdir(f"/proc/{peer.pid}/task"))
        logger.info("a peer with %d threads, %d looks each way", threads, args.looks)
        pidfd_open = os.pidfd_open
        figures = {"pidfd": cpu_us_per_look(peer.pid, args.looks)}
        os.pidfd_open = no_pidfd  # type: ignore[assignment]
        try:
            figures["/proc"] = cpu_us_per_look(peer.pid, args.looks)
        finally:
            os.pidfd_open = pidfd_open
        for way, us in figures.items():
            over = "  OVER" if us > BUDGET_US else ""
            logger.info("  %-6s %5.1f us a look (budget %.0f)%s", way, us, BUDGET_US, over)
    finally:
        peer.kill()
        peer.wait()


if __name__ == "__main__":
    main()
