"""A real 2-rank Composer job for DataConsistencyGuard and DataStallMonitor.

Run: ``composer -n 2 composer_data_job.py OUT SCENARIO...``.

Each scenario is a fresh Trainer in the same processes; outcomes per rank go
to ``OUT/rank{N}.json`` (see tests/e2e/common.py), with the batches that ran,
the ``rankguard/*`` metrics Composer's ``InMemoryLogger`` received, and the
train batch at which each rankguard warning or error was logged.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from composer import Callback, Evaluator, Trainer
from composer.loggers import InMemoryLogger
from composer.utils import dist, get_device, reproducibility
from torch.utils.data import DataLoader, Dataset, Subset, get_worker_info, random_split

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import Points, Recorder
from tests.e2e.composer_job import model

OBSERVED: dict = {}
BATCH = 4
STALL = {"threshold": 0.5, "window": 3, "interval": 5}
SLOW_ITEM_S = 0.15  # rank 1's reads in the stall scenario (a step takes ~60 ms on 2 busy cores)


class CountBatches(Callback):
    """Counts the train and eval batches that actually ran on this rank."""

    def batch_start(self, state, logger):
        OBSERVED["train_batches"] = OBSERVED.get("train_batches", 0) + 1

    def eval_batch_start(self, state, logger):
        OBSERVED["eval_batches"] = OBSERVED.get("eval_batches", 0) + 1


class LogAtBatch(logging.Handler):
    """Appends each rankguard record (warning and above) to ``path`` as it is logged.

    One JSON line per record: the scenario, the train batches run so far, the
    level and the message; written at once, so records logged while the
    process exits (Composer closes callbacks at exit) are kept.
    """

    def __init__(self, path: str) -> None:
        super().__init__(logging.WARNING)
        self.path = path
        self.scenario = ""

    def emit(self, record: logging.LogRecord) -> None:
        line = {
            "scenario": self.scenario,
            "batch": OBSERVED.get("train_batches", 0),
            "level": record.levelname,
            "message": record.getMessage(),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def rank() -> int:
    return dist.get_global_rank()


def fit(train, eval_loader, guard, *, rankguard_metrics: bool = False) -> None:
    """Trains 1 epoch with ``guard``; records batch counts and rankguard metrics."""
    OBSERVED.clear()
    memory = InMemoryLogger()
    trainer = Trainer(
        model=model(),
        train_dataloader=train,
        eval_dataloader=Evaluator(label="eval", dataloader=eval_loader),
        max_duration="1ep",
        eval_interval="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[memory],
        callbacks=[guard, CountBatches()],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
        if rankguard_metrics:
            OBSERVED["metrics"] = {
                key: [[int(ts.batch), float(value)] for ts, value in series]
                for key, series in memory.data.items()
                if key.startswith("rankguard/")
            }


def sharded(data: Dataset, batch_size: int = BATCH, **kwargs) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, sampler=dist.get_sampler(data), **kwargs)


def fit_split(train_idx, eval_idx) -> None:
    data = Points(64)
    fit(sharded(Subset(data, train_idx)), sharded(Subset(data, eval_idx)), RankGuard())


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
    fit(sharded(train), sharded(evaluation), RankGuard())


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
    fit(DataLoader(train, batch_size=BATCH), DataLoader(evaluation, batch_size=BATCH), RankGuard())


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


class SlowOnRank(Dataset):
    """``Points(n)`` whose items take ``delay_s`` to read on ``slow_rank`` only."""

    def __init__(self, n: int, slow_rank: int | None, delay_s: float = SLOW_ITEM_S) -> None:
        self.points = Points(n)
        self.delay_s = delay_s if slow_rank == rank() else 0.0

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.points[i]


def stall(slow_rank: int | None) -> None:
    """10 batches of 1 per rank; ``slow_rank`` reads each in 150 ms."""
    train = sharded(SlowOnRank(20, slow_rank), batch_size=1)
    guard = RankGuard(data_stall_monitor=STALL)
    fit(train, sharded(Points(8)), guard, rankguard_metrics=True)


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
    called (it would wait in a barrier for rank 0, itself waiting in a
    collective for rank 1): rank 1 exits with the error, rank 0 with the broken
    collective, and Composer closes the callbacks at exit.
    """
    OBSERVED.clear()
    data = WorkerDiesOnRank(64, at=49, dying_rank=1)
    trainer = Trainer(
        model=model(),
        train_dataloader=sharded(data, num_workers=1),
        max_duration="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[RankGuard(), CountBatches()],
    )
    trainer.fit()


STREAMING = ["streaming_healthy", "streaming_shuffle_seed_differs"]
SCENARIOS = {
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
}


def main() -> None:
    out_dir, *names = sys.argv[1:]
    dist.initialize_dist(get_device("cpu"))
    os.environ["MDS_ROOT"] = os.path.join(out_dir, "mds")
    write_mds(os.environ["MDS_ROOT"], [n for n in names if n in STREAMING])
    recorder = Recorder(out_dir)
    log = LogAtBatch(os.path.join(out_dir, f"rank{rank()}.log.jsonl"))
    logging.getLogger("rankguard").addHandler(log)
    for name in names:
        log.scenario = name
        if name == "dead_worker":  # ends the job: must come last
            dead_worker()
        else:
            recorder.run(name, SCENARIOS[name], OBSERVED)


if __name__ == "__main__":
    main()
