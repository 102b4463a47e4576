"""Per-step cost of DataStallMonitor: the four events it handles, dispatched as adapters do.

Run: ``python benchmarks/data_stall_overhead.py``. Uses a local (world size 1)
side channel, so the once-per-interval exchange is included but costs no
network round trips; on a real job add 3 store round trips per ``interval``.

The second table is Composer's path for a starved rank: DATA_FETCH_START
comes with the train loader and, once a window looked slow, the monitor
watches for the loader's ``__next__`` to return (a profile hook live while the
batch is produced). Here every step is all fetch, so every fetch is watched:
``next()`` on a real DataLoader with and without the monitor's events around
it (best of 3). The cost grows with the Python calls the main process makes
to produce a batch: the dataset's and collate's with ``num_workers=0``,
receiving and unpickling with workers. A healthy run never arms the hook and
pays the first table's cost only.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from rankguard.callbacks.core.events import Event, EventFacts, LoaderFacts
from rankguard.callbacks.core.guard import GuardRunner
from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor

STEP_EVENTS = (
    Event.DATA_FETCH_START,
    Event.DATA_FETCH_END,
    Event.TRAIN_BATCH_START,
    Event.TRAIN_BATCH_END,
)


def per_step_us(runner: GuardRunner | None, steps: int, facts: EventFacts) -> float:
    start = time.perf_counter()
    for step in range(steps):
        facts.step = step
        for event in STEP_EVENTS:
            if runner is not None:
                runner.fire(event, facts)
    return (time.perf_counter() - start) / steps * 1e6


class Records(Dataset):
    """Python-heavy items: a dict of lists and a string per sample."""

    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, i: int) -> dict:
        return {"ids": [i % 50_000] * 64, "mask": [1] * 64, "text": f"doc-{i}"}


def fetch_us(loader: DataLoader, runner: GuardRunner | None, steps: int) -> float:
    """Mean time of one fetch (events around ``next()``), in microseconds."""
    facts = EventFacts(loader=LoaderFacts("train", loader, is_train=True))
    iterator = iter(loader)
    next(iterator)  # start workers
    start = time.perf_counter()
    for step in range(steps):
        facts.step = step
        if runner is not None:
            runner.fire(Event.DATA_FETCH_START, facts)
        next(iterator)
        if runner is not None:
            runner.fire(Event.DATA_FETCH_END, facts)
            runner.fire(Event.TRAIN_BATCH_START, facts)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    logging.getLogger("rankguard").setLevel(logging.ERROR)  # every step here is a stall
    steps = 200_000
    runner = GuardRunner([DataStallMonitor(interval=50)])
    runner.fire(Event.FIT_START, EventFacts())
    baseline = per_step_us(None, steps, EventFacts())
    total = per_step_us(runner, steps, EventFacts())
    loader = DataLoader(list(range(8)))
    composer = per_step_us(runner, steps, EventFacts(loader=LoaderFacts("train", loader, True)))
    print(f"empty loop:                          {baseline:6.2f} us/step")
    print(f"GuardRunner + DataStallMonitor:      {total:6.2f} us/step (4 events per step)")
    print(f"monitor + dispatch overhead:         {total - baseline:6.2f} us/step")
    print(f"  with the train loader (Composer):  {composer - baseline:6.2f} us/step")
    print()
    print(f"{'starved rank, loader (batch of 32)':<40} {'next()':>9} {'+monitor':>9} {'cost':>8}")
    tensors = TensorDataset(torch.randn(1 << 16, 64), torch.randint(0, 10, (1 << 16,)))
    workers = {"num_workers": 2, "persistent_workers": True}
    cases = [
        ("TensorDataset, num_workers=0", DataLoader(tensors, batch_size=32), 1000),
        ("python dict items, num_workers=0", DataLoader(Records(), batch_size=32), 500),
        ("TensorDataset, num_workers=2", DataLoader(tensors, batch_size=32, **workers), 500),
    ]
    for label, loader, n in cases:
        plain = min(fetch_us(loader, None, n) for _ in range(3))
        watched = min(fetch_us(loader, runner, n) for _ in range(3))
        print(f"{label:<40} {plain:7.1f}us {watched:7.1f}us {watched - plain:6.1f}us")


if __name__ == "__main__":
    main()
