"""A real 2-rank Lightning job (CPU, gloo) for DataConsistencyGuard and DataStallMonitor.

Usage::

    python tests/e2e/lightning_data_job.py OUT_DIR SCENARIO [SCENARIO ...]

Lightning's DDP launcher re-executes this script for rank 1 with the same
arguments, so both ranks run the same scenarios in order, each a fresh
``Trainer`` in the same two processes. After every scenario each rank writes
``OUT_DIR/rank<r>.json``: per scenario the outcome (``"ok"`` or the exception
class and message), the rankguard records logged (warning and above), the
steps the module ran and the ``rankguard/*`` metrics a logger received. An
error in the last scenario is re-raised, so the process exits non-zero as a
real job would.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset, Subset, get_worker_info, random_split

from rankguard.integrations.lightning import DataStallMonitor, RankGuard
from tests.e2e.common import WarningCollector
from tests.e2e.lightning_job import BATCH, TinyModule, dataset

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


class MetricsRecorder(Logger):
    """A real Lightning logger that keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        del params, args, kwargs

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))


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


class SlowOnRank(Dataset):
    """``dataset(n)`` whose items take ``delay_s`` to read on rank ``slow_rank`` only."""

    def __init__(self, n: int, rank: int, slow_rank: int | None) -> None:
        self.data = dataset(n)
        self.delay_s = SLOW_ITEM_S if rank == slow_rank else 0.0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[i]


def stall(rank: int, slow_rank: int | None) -> tuple[DataLoader, DataLoader]:
    """10 train batches of 1 per rank; ``slow_rank`` reads each in 150 ms."""
    return DataLoader(SlowOnRank(10, rank, slow_rank), batch_size=1), DataLoader(dataset(4), BATCH)


class WorkerDiesOnRank(Dataset):
    """``dataset(n)`` whose loader worker is killed (SIGKILL) reading ``at`` on ``dying_rank``."""

    def __init__(self, n: int, rank: int, at: int, dying_rank: int) -> None:
        self.data = dataset(n)
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


def rank_guard() -> list[L.Callback]:
    return [RankGuard()]


def stall_monitor() -> list[L.Callback]:
    return [DataStallMonitor(**STALL)]


@dataclass
class Scenario:
    """One fit: callbacks, per-rank (train, val) loaders, Trainer settings, the module."""

    callbacks: Callable[[], list[L.Callback]]
    loaders: Callable[[int], tuple[DataLoader, DataLoader]]
    trainer: dict[str, Any] = field(default_factory=dict)
    module: Callable[[], TinyModule] = TinyModule


NO_SANITY = {"num_sanity_val_steps": 0}
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
    # Rank 1 alone fails: the job's last scenario.
    "dead_worker": Scenario(rank_guard, dead_worker, PER_RANK_DATA),
}


def run(name: str) -> tuple[dict[str, Any], BaseException | None]:
    scenario = SCENARIOS[name]
    metrics = MetricsRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        enable_checkpointing=False,
        logger=metrics,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=scenario.callbacks(),
        **scenario.trainer,
    )
    rank = trainer.global_rank
    module = scenario.module()
    train, val = scenario.loaders(rank)
    collector = WarningCollector()
    logging.getLogger("rankguard").addHandler(collector)
    record: dict[str, Any] = {"outcome": "ok"}
    error: BaseException | None = None
    try:
        trainer.fit(module, train, val)
    except Exception as exc:
        error = exc
        record.update(outcome="error", error_type=type(exc).__name__, error=str(exc))
    finally:
        logging.getLogger("rankguard").removeHandler(collector)
    record.update(
        rank=trainer.global_rank,
        warnings=collector.messages,
        train_steps=module.train_steps,
        val_steps=module.val_steps,
        sanity_val_steps=module.sanity_val_steps,
        metrics=[
            [step, {k: v for k, v in m.items() if k.startswith("rankguard/")}]
            for step, m in metrics.calls
            if any(k.startswith("rankguard/") for k in m)
        ],
    )
    return record, error


def main(argv: list[str]) -> int:
    out_dir, *names = argv
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {"finished": False, "scenarios": {}}
    error: BaseException | None = None
    for name in names:
        record, error = run(name)
        report["rank"] = record["rank"]
        report["scenarios"][name] = record
        report["finished"] = name == names[-1]
        path = os.path.join(out_dir, f"rank{report['rank']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
    if error is not None:
        raise error
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
