"""Stragglers in Lightning (tests/frameworks/test_straggler_e2e.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import (
    DataLoader,
)

from rankguard.integrations.lightning import (
    RankGuard,
)
from tests.e2e.common import Points
from tests.e2e.lightning_concerns import harness
from tests.e2e.lightning_concerns.harness import BATCH, MetricsRecorder, Outcome, trainer
from tests.e2e.straggler_common import (
    BATCHES,
    STRAGGLER,
    SlowForward,
    forward_delay,
    slow_reads,
)
from tests.e2e.straggler_common import STALL as STRAGGLER_STALL


class Classifier(L.LightningModule):
    """Trains ``SlowForward`` (calling it directly, as most modules do); counts batches done."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = SlowForward(delay_s)
        self.batches = 0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.model(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class AtBatch(logging.Handler):
    """Keeps each rankguard record (warning and above) with the batches done when it came."""

    def __init__(self, module: Classifier) -> None:
        super().__init__(logging.WARNING)
        self.module = module
        self.records: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append([self.module.batches, record.getMessage()])


def race(settings: dict[str, Any], slow_compute: bool, slow_data: bool, **kw: Any) -> dict:
    """``BATCHES`` train batches per rank; rank 1 computes or reads slowly if told."""
    metrics = MetricsRecorder()
    callbacks = [RankGuard(**settings), *kw.pop("callbacks", [])]
    job = trainer(callbacks, logger=metrics, num_sanity_val_steps=0, **kw)
    rank = job.global_rank
    module = Classifier(forward_delay(rank, slow_compute))
    train = DataLoader(slow_reads(BATCHES * BATCH, rank, slow_data, seed=rank), batch_size=BATCH)
    val = DataLoader(Points(8), batch_size=BATCH)
    records = AtBatch(module)
    logging.getLogger("rankguard").addHandler(records)
    result: dict[str, Any] = {"outcome": "ok"}
    try:
        job.fit(module, train, val)
    except Exception as exc:
        result = {"outcome": type(exc).__name__, "message": str(exc)}
    finally:
        logging.getLogger("rankguard").removeHandler(records)
    result.update(
        rank=rank,
        train_batches=module.batches,
        logged=records.records,
        metrics=metrics.kept("rankguard/straggler"),
    )
    return result


SCENARIOS: dict[str, Callable[[], dict]] = {
    # Equal ranks, validated and saved every 6 batches: no warning, scores every interval.
    "straggler_healthy": lambda: race(
        {"straggler_monitor": STRAGGLER},
        False,
        False,
        val_check_interval=6,
        enable_checkpointing=True,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(harness.OUT, "ckpt"), every_n_train_steps=6)
        ],
    ),
    "slow_compute": lambda: race({"straggler_monitor": STRAGGLER}, True, False),
    "slow_data": lambda: race(
        {"straggler_monitor": STRAGGLER, "data_stall_monitor": STRAGGLER_STALL}, False, True
    ),
    "slow_compute_raise": lambda: race(
        {"straggler_monitor": {**STRAGGLER, "on_violation": "raise"}}, True, False
    ),
}


def setup(names: list[str]) -> Callable[[str], Outcome]:
    torch.set_num_threads(1)  # two ranks on two shared cores
    L.seed_everything(0, verbose=False)
    return lambda name: (SCENARIOS[name](), None)


#: Whether ``OUT/rank<r>.json`` holds this concern's records alone, not a report around them.
RECORDS_ALONE = False
