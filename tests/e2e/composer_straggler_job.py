"""A real 2-rank Composer job for StragglerMonitor (CPU, gloo, DDP).

Run: ``composer -n 2 composer_straggler_job.py OUT SCENARIO...``.

Each scenario is a fresh Trainer in the same two processes; per rank,
``OUT/rank{N}.json`` records its outcome, rankguard's warnings and counters:
the train batches done, each rankguard record with the batches done when it
was logged, and the ``rankguard/straggler*`` metrics likewise (see
tests/e2e/common.py and tests/e2e/straggler_common.py).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from composer import Callback, Evaluator, Trainer
from composer.loggers import LoggerDestination
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader, Dataset

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import Points, Recorder
from tests.e2e.straggler_common import (
    BATCH,
    BATCHES,
    STALL,
    STRAGGLER,
    SlowForward,
    SlowReads,
    forward_delay,
)

COUNTERS: dict[str, Any] = {}
OUT: dict[str, str] = {}  # "dir": the output folder given on the command line


class CountBatches(Callback):
    """Counts the train batches done on this rank."""

    def batch_end(self, state: Any, logger: Any) -> None:
        COUNTERS["train_batches"] = COUNTERS.get("train_batches", 0) + 1


class Metrics(LoggerDestination):
    """Keeps rankguard's metrics with the train batch they were logged at."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        kept = {k: v for k, v in metrics.items() if k.startswith("rankguard/straggler")}
        if kept:
            COUNTERS.setdefault("metrics", []).append([COUNTERS.get("train_batches", 0), kept])


class AtBatch(logging.Handler):
    """Keeps each rankguard record (warning and above) with the train batch it came at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        line = [COUNTERS.get("train_batches", 0), record.getMessage()]
        COUNTERS.setdefault("logged", []).append(line)


def sharded(data: Dataset) -> DataLoader:
    return DataLoader(data, batch_size=BATCH, sampler=dist.get_sampler(data))


def fit(guard: RankGuard, *, slow_compute: bool = False, slow_data: bool = False, **kw) -> None:
    """``BATCHES`` train batches per rank; rank 1 computes or reads slowly if told."""
    COUNTERS.clear()
    rank = dist.get_global_rank()
    torch.manual_seed(0)
    model = SlowForward(forward_delay(rank, slow_compute))
    trainer = Trainer(
        model=ComposerClassifier(model, num_classes=2),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        train_dataloader=sharded(SlowReads(2 * BATCHES * BATCH, rank, slow_data)),
        max_duration="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[Metrics()],
        callbacks=[guard, CountBatches()],
        **kw,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()


SCENARIOS = {
    # Equal ranks, evaluated and saved every 6 batches: no warning, scores every interval.
    "healthy": lambda: fit(
        RankGuard(straggler_monitor=STRAGGLER),
        eval_dataloader=Evaluator(label="eval", dataloader=sharded(Points(16))),
        eval_interval="6ba",
        save_folder=OUT["dir"] + "/ckpt/{run_name}",
        save_interval="6ba",
        run_name="straggler",
    ),
    "slow_compute": lambda: fit(RankGuard(straggler_monitor=STRAGGLER), slow_compute=True),
    "slow_data": lambda: fit(
        RankGuard(straggler_monitor=STRAGGLER, data_stall_monitor=STALL), slow_data=True
    ),
    "slow_compute_raise": lambda: fit(
        RankGuard(straggler_monitor={**STRAGGLER, "on_violation": "raise"}), slow_compute=True
    ),
}


def main() -> None:
    out_dir, *names = sys.argv[1:]
    OUT["dir"] = out_dir
    torch.set_num_threads(1)  # two ranks on two shared cores
    recorder = Recorder(out_dir)
    logging.getLogger("rankguard").addHandler(AtBatch())
    for name in names:
        recorder.run(name, SCENARIOS[name], COUNTERS)


if __name__ == "__main__":
    main()
