"""Data consistency and stalls in Lightning (tests/frameworks/test_data_e2e.py)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    get_worker_info,
    random_split,
)

from rankguard.integrations.lightning import (
    DataStallMonitor,
    RankGuard,
)
from tests.e2e.common import SlowItems
from tests.e2e.lightning_concerns.batches import NO_SANITY
from tests.e2e.lightning_concerns.harness import (
    BATCH,
    Outcome,
    Scenario,
    TinyModule,
    dataset,
    run_fit,
)

STALL = {"threshold": 0.5, "window": 3, "interval": 5}
SLOW_ITEM_S = 0.15  # rank 1's reads in the stall scenario
COMPUTE_S = 0.05  # a training step's compute in the stall scenarios


class ComputingModule(TinyModule):
    """TinyModule whose training step takes ``COMPUTE_S`` longer, like a real model's.

    Lightning's own work between two batches (~1 ms here, more on a busy machine)
    counts as data wait; against the 3 ms step of a 5-parameter model it is a third.
    """

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(COMPUTE_S)
        return super().training_step(batch, batch_idx)


def split_loaders(train_idx: list[int], val_idx: list[int]) -> tuple[DataLoader, DataLoader]:
    """A train/val split of one 64-sample dataset (Lightning adds a DistributedSampler)."""
    data = dataset(64)
    return DataLoader(Subset(data, train_idx), BATCH), DataLoader(Subset(data, val_idx), BATCH)


def numpy_split(rank: int, seed_numpy: bool) -> tuple[DataLoader, DataLoader]:
    """The llama-recipes split: torch is seeded, the numpy shuffle may not be."""
    del rank
    torch.manual_seed(0)
    if seed_numpy:
        random.seed(0)
        np.random.seed(0)
    order = np.random.permutation(64).tolist()
    return split_loaders(order[:48], order[48:])


def torch_random_split(rank: int) -> tuple[DataLoader, DataLoader]:
    """``random_split`` without a generator after torch was seeded per rank."""
    torch.manual_seed(17 + rank)
    train, val = random_split(dataset(64), [48, 16])
    return DataLoader(train, BATCH), DataLoader(val, BATCH)


def stall(rank: int, slow_rank: int | None) -> tuple[DataLoader, DataLoader]:
    """10 train batches of 1 per rank; ``slow_rank`` reads each in 150 ms."""
    slow = SlowItems(dataset(10), SLOW_ITEM_S if rank == slow_rank else 0.0)
    return DataLoader(slow, batch_size=1), DataLoader(dataset(4), BATCH)


class WorkerDiesOnRank(Dataset):
    """``dataset(n)`` whose loader worker is killed (SIGKILL) reading ``at`` on ``dying_rank``."""

    def __init__(self, n: int, rank: int, at: int, dying_rank: int) -> None:
        self.data = dataset(n, own=True)
        self.at = at if rank == dying_rank else None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]


def dead_worker(rank: int) -> tuple[DataLoader, DataLoader]:
    """Rank 1's only loader worker dies reading item 24 (train batch 7 of 8)."""
    L.seed_everything(0, verbose=False)  # earlier scenarios seeded torch per rank
    train = DataLoader(WorkerDiesOnRank(32, rank, at=24, dying_rank=1), BATCH, num_workers=1)
    return train, DataLoader(dataset(4), BATCH)


class IgnoresRank(IterableDataset):
    """A custom iterable that never looks at the rank: every rank yields all 32 samples."""

    def __iter__(self) -> Iterator[Any]:
        return iter(dataset(32))


def rank_guard() -> list[L.Callback]:
    return [RankGuard()]


def stall_monitor() -> list[L.Callback]:
    return [DataStallMonitor(**STALL)]


PER_RANK_DATA = {"use_distributed_sampler": False, "num_sanity_val_steps": 0}
SCENARIOS: dict[str, Scenario] = {
    # Checked at fit start (no sanity check): both loaders and the generators' seeding.
    "unseeded_numpy_split": Scenario(rank_guard, lambda r: numpy_split(r, False), NO_SANITY),
    "seeded_numpy_split": Scenario(rank_guard, lambda r: numpy_split(r, True), NO_SANITY),
    # With the sanity check, the val loader is checked before its first sanity batch.
    "unseeded_random_split": Scenario(rank_guard, torch_random_split),
    "stall_healthy": Scenario(
        stall_monitor, lambda r: stall(r, None), PER_RANK_DATA, ComputingModule
    ),
    "stall_rank1": Scenario(stall_monitor, lambda r: stall(r, 1), PER_RANK_DATA, ComputingModule),
    # A custom iterable that never looks at the rank: both ranks read the same batches.
    "iterable_ignores_rank": Scenario(
        rank_guard, lambda r: (DataLoader(IgnoresRank(), BATCH), DataLoader(dataset(4), BATCH))
    ),
    # Rank 1 alone fails: the job's last scenario.
    "dead_worker": Scenario(rank_guard, dead_worker, PER_RANK_DATA),
}


def setup(names: list[str]) -> Callable[[str], Outcome]:
    """Each scenario a fit of its own, its data's metrics recorded too."""
    return lambda name: run_fit(name, SCENARIOS[name], data=True)


#: Whether ``OUT/rank<r>.json`` holds this concern's records alone, not a report around them.
RECORDS_ALONE = False
