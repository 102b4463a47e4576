"""Stragglers in Composer (tests/frameworks/test_straggler_e2e.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from composer import Callback
from composer.loggers import LoggerDestination

from rankguard.integrations.composer import RankGuard
from tests.e2e.composer_concerns import harness
from tests.e2e.composer_concerns.harness import BATCH, COUNTERS, count, fit, rank, sharded
from tests.e2e.straggler_common import (
    BATCHES,
    STRAGGLER,
    SlowForward,
    forward_delay,
    slow_reads,
)
from tests.e2e.straggler_common import STALL as STRAGGLER_STALL


class CountDone(Callback):
    """Counts the train batches done on this rank (the clock of the straggler records)."""

    def batch_end(self, state: Any, logger: Any) -> None:
        count("train_batches")


class Metrics(LoggerDestination):
    """Keeps rankguard's straggler metrics with the train batch they were logged at."""

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


def race(guard: RankGuard, *, slow_compute: bool = False, slow_data: bool = False, **kw) -> None:
    """``BATCHES`` train batches per rank; rank 1 computes or reads slowly if told."""
    delay = forward_delay(rank(), slow_compute)
    fit(
        sharded(slow_reads(2 * BATCHES * BATCH, rank(), slow_data)),
        [guard, CountDone()],
        net=lambda: SlowForward(delay),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loggers=[Metrics()],
        **kw,
    )


SCENARIOS: dict[str, Callable[[], None]] = {
    # Equal ranks, evaluated and saved every 6 batches: no warning, scores every interval.
    "straggler_healthy": lambda: race(
        RankGuard(straggler_monitor=STRAGGLER),
        eval_loader=sharded(16),
        eval_interval="6ba",
        save_folder=harness.OUT + "/ckpt/{run_name}",
        save_interval="6ba",
        run_name="straggler",
    ),
    "slow_compute": lambda: race(RankGuard(straggler_monitor=STRAGGLER), slow_compute=True),
    "slow_data": lambda: race(
        RankGuard(straggler_monitor=STRAGGLER, data_stall_monitor=STRAGGLER_STALL), slow_data=True
    ),
    "slow_compute_raise": lambda: race(
        RankGuard(straggler_monitor={**STRAGGLER, "on_violation": "raise"}), slow_compute=True
    ),
}


def setup(names: list[str]) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores
    logging.getLogger("rankguard").addHandler(AtBatch())


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = set()
