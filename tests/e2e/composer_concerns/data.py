"""Data consistency and stalls in Composer (tests/frameworks/test_data_e2e.py)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
from collections.abc import Callable

import numpy as np
import torch
from composer.loggers import InMemoryLogger
from composer.utils import dist, get_device, reproducibility
from torch.utils.data import (
    DataLoader,
    Dataset,
    Subset,
    get_worker_info,
    random_split,
)

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import (
    ClaimedStream,
    Points,
    SlowItems,
    destroy_process_group_waits,
)
from tests.e2e.composer_concerns import harness
from tests.e2e.composer_concerns.harness import (
    BATCH,
    COUNTERS,
    CountBatches,
    fit,
    rank,
    sharded,
    trainer,
)

#: The stall scenarios' DataStallMonitor; rank 1's reads in them (a step takes ~60 ms on 2
#: busy cores).
STALL = {"threshold": 0.5, "window": 3, "interval": 5}
SLOW_ITEM_S = 0.15


class LogAtBatch(logging.Handler):
    """Appends each rankguard record (warning and above) to ``path`` as it is logged.

    One JSON line per record: the scenario, the train batches run so far, the
    level and the message; written at once, so records logged while the
    process exits (Composer closes callbacks at exit) are kept.
    """

    def __init__(self, path: str) -> None:
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        line = {
            "scenario": harness.SCENARIO,
            "batch": COUNTERS.get("train_batches", 0),
            "level": record.levelname,
            "message": record.getMessage(),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def fit_data(train, eval_loader, guard, *, rankguard_metrics: bool = False) -> None:
    """Trains 1 epoch with ``guard``; records batch counts and, if told, rankguard metrics."""
    memory = InMemoryLogger()
    try:
        fit(train, [guard, CountBatches()], eval_loader, loggers=[memory])
    finally:
        if rankguard_metrics:
            COUNTERS["metrics"] = {
                key: [[int(ts.batch), float(value)] for ts, value in series]
                for key, series in memory.data.items()
                if key.startswith("rankguard/")
            }


def fit_split(train_idx, eval_idx) -> None:
    data = Points(64)
    fit_data(sharded(Subset(data, train_idx)), sharded(Subset(data, eval_idx)), RankGuard())


def numpy_split(seed_numpy: bool) -> None:
    """The llama-recipes split: torch is seeded, the numpy shuffle may not be."""
    torch.manual_seed(0)
    if seed_numpy:
        random.seed(0)
        np.random.seed(0)
    order = np.random.permutation(64).tolist()
    fit_split(order[:48], order[48:])


def torch_random_split(generator: torch.Generator | None) -> None:
    """``random_split`` after torch was seeded per rank (as Composer seeds: seed + rank)."""
    reproducibility.seed_all(17 + rank())
    train, evaluation = random_split(Points(64), [48, 16], generator=generator)
    fit_data(sharded(train), sharded(evaluation), RankGuard())


def streaming(shuffle_seed: int, scenario: str) -> None:
    """A StreamingDataset written locally with MDSWriter, shuffled with ``shuffle_seed``."""
    from streaming import StreamingDataset

    class PointsStream(StreamingDataset):
        def __getitem__(self, i: int):
            sample = super().__getitem__(i)
            return torch.tensor(sample["x"]), torch.tensor(sample["y"])

    root = os.path.join(os.environ["MDS_ROOT"], scenario)

    def dataset(name: str, **kwargs) -> StreamingDataset:
        local = os.path.join(root, name)
        return PointsStream(local=local, batch_size=BATCH, num_canonical_nodes=1, **kwargs)

    train = dataset("train", shuffle=True, shuffle_seed=shuffle_seed)
    evaluation = dataset("eval", shuffle=False)
    loaders = DataLoader(train, batch_size=BATCH), DataLoader(evaluation, batch_size=BATCH)
    fit_data(*loaders, RankGuard())


def write_mds(root: str, scenarios: list[str]) -> None:
    """Rank 0 writes a tiny local MDS dataset per streaming scenario (own dir each)."""
    if rank() == 0:
        from streaming import MDSWriter

        for scenario in scenarios:
            for name, n in (("train", 64), ("eval", 32)):
                out = os.path.join(root, scenario, name)
                with MDSWriter(out=out, columns={"x": "ndarray:float32:4", "y": "int"}) as w:
                    for x, y in Points(n, seed=len(name)):
                        w.write({"x": x.numpy(), "y": int(y)})
    dist.barrier()


def stall(slow_rank: int | None) -> None:
    """10 batches of 1 per rank; ``slow_rank`` reads each in 150 ms."""
    delay_s = SLOW_ITEM_S if slow_rank == rank() else 0.0
    train = sharded(SlowItems(Points(20), delay_s), batch_size=1)
    guard = RankGuard(data_stall_monitor=STALL)
    fit_data(train, sharded(8), guard, rankguard_metrics=True)


class WorkerDiesOnRank(Dataset):
    """``Points(n)`` whose loader worker is killed (SIGKILL) reading ``at`` on ``rank``."""

    def __init__(self, n: int, at: int, dying_rank: int) -> None:
        self.points = Points(n)
        self.at = at if dying_rank == rank() else None

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.points[i]


def dead_worker() -> None:
    """Rank 1's only loader worker dies reading item 49, its 25th (train batch 7 of 8).

    As in a real job, nothing catches the error and ``trainer.close()`` is never
    called (it would wait in a barrier for rank 0, itself waiting in a collective
    for rank 1). Rank 1's process then stays, as NCCL's communicator teardown waits
    for a peer (on gloo its closed socket would break rank 0's collective at once):
    rank 0 waits in its collective until rankguard ends it, naming rank 1's error.
    """
    data = WorkerDiesOnRank(64, at=49, dying_rank=1)
    try:
        trainer(sharded(data, num_workers=1), [RankGuard(), CountBatches()]).fit()
    finally:
        if rank() == 1:
            destroy_process_group_waits()


STREAMING = ["streaming_healthy", "streaming_shuffle_seed_differs"]
SCENARIOS: dict[str, Callable[[], None]] = {
    "unseeded_numpy_split": lambda: numpy_split(seed_numpy=False),
    "seeded_numpy_split": lambda: numpy_split(seed_numpy=True),
    "unseeded_random_split": lambda: torch_random_split(None),
    "seeded_random_split": lambda: torch_random_split(torch.Generator().manual_seed(0)),
    "streaming_healthy": lambda: streaming(7, "streaming_healthy"),
    "streaming_shuffle_seed_differs": lambda: streaming(
        7 + rank(), "streaming_shuffle_seed_differs"
    ),
    "stall_healthy": lambda: stall(None),
    "stall_rank1": lambda: stall(1),
    # A stream that ignores the rank (Composer checks map-style loaders only): every rank
    # reads the same 8 batches.
    "iterable_ignores_rank": lambda: fit_data(
        DataLoader(ClaimedStream(32, claimed=32), batch_size=4), sharded(16), RankGuard()
    ),
    "dead_worker": dead_worker,
}


def setup(names: list[str]) -> None:
    dist.initialize_dist(get_device("cpu"))
    os.environ["MDS_ROOT"] = os.path.join(harness.OUT, "mds")
    write_mds(os.environ["MDS_ROOT"], [n for n in names if n in STREAMING])
    log = LogAtBatch(os.path.join(harness.OUT, f"rank{rank()}.log.jsonl"))
    logging.getLogger("rankguard").addHandler(log)


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = {"dead_worker"}
