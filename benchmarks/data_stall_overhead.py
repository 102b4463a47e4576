"""Per-step cost of DataStallMonitor: the four events it handles, dispatched as adapters do.

Run: ``python benchmarks/data_stall_overhead.py``. Uses a local (world size 1)
side channel, so the once-per-interval exchange is included but costs no
network round trips; on a real job add 3 store round trips per ``interval``.
"""

from __future__ import annotations

import time

from rankguard.callbacks.data_stall import DataStallMonitor
from rankguard.callbacks.events import Event, EventFacts
from rankguard.callbacks.guard import GuardRunner

STEP_EVENTS = (
    Event.DATA_FETCH_START,
    Event.DATA_FETCH_END,
    Event.TRAIN_BATCH_START,
    Event.TRAIN_BATCH_END,
)


def per_step_us(runner: GuardRunner | None, steps: int) -> float:
    facts = EventFacts()
    start = time.perf_counter()
    for step in range(steps):
        facts.step = step
        for event in STEP_EVENTS:
            if runner is not None:
                runner.fire(event, facts)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    steps = 200_000
    runner = GuardRunner([DataStallMonitor(interval=50)])
    runner.fire(Event.FIT_START, EventFacts())
    baseline = per_step_us(None, steps)
    total = per_step_us(runner, steps)
    print(f"empty loop:                          {baseline:6.2f} us/step")
    print(f"GuardRunner + DataStallMonitor:      {total:6.2f} us/step (4 events per step)")
    print(f"monitor + dispatch overhead:         {total - baseline:6.2f} us/step")


if __name__ == "__main__":
    main()
