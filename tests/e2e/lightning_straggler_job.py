"""A real 2-rank Lightning job for StragglerMonitor (CPU, gloo, ``strategy="ddp"``).

Usage::

    python tests/e2e/lightning_straggler_job.py OUT_DIR SCENARIO [SCENARIO ...]

Lightning's DDP launcher re-executes this script for rank 1, so both ranks
run the same scenarios in order, each a fresh ``Trainer`` in the same two
processes. The module's ``training_step`` calls its network directly (not
its own ``forward``), as most LightningModules do. After every scenario each
rank writes ``OUT_DIR/rank<r>.json``: per scenario the outcome, each
rankguard record (warning and above) with the train batches done when it came, and
the ``rankguard/straggler*`` metrics a real Lightning logger received.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from rankguard.integrations.lightning import RankGuard
from tests.e2e.common import Points
from tests.e2e.lightning_data_job import MetricsRecorder
from tests.e2e.straggler_common import (
    BATCH,
    BATCHES,
    STALL,
    STRAGGLER,
    SlowForward,
    SlowReads,
    forward_delay,
)


class Classifier(L.LightningModule):
    """Trains ``SlowForward``; counts the train batches done."""

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

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.module: Classifier | None = None
        self.records: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        batch = self.module.batches if self.module is not None else 0
        self.records.append([batch, record.getMessage()])


def run(settings: dict[str, Any], slow_compute: bool, slow_data: bool, **kw: Any) -> dict:
    metrics = MetricsRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=metrics,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=[RankGuard(**settings), *kw.pop("callbacks", [])],
        **{"enable_checkpointing": False, **kw},
    )
    rank = trainer.global_rank
    module = Classifier(forward_delay(rank, slow_compute))
    train = DataLoader(SlowReads(BATCHES * BATCH, rank, slow_data), batch_size=BATCH)
    val = DataLoader(Points(8), batch_size=BATCH)
    records = AtBatch()
    records.module = module
    logging.getLogger("rankguard").addHandler(records)
    result: dict[str, Any] = {"outcome": "ok"}
    try:
        trainer.fit(module, train, val)
    except Exception as exc:
        result = {"outcome": type(exc).__name__, "message": str(exc)}
    finally:
        logging.getLogger("rankguard").removeHandler(records)
    result.update(
        rank=rank,
        train_batches=module.batches,
        logged=records.records,
        metrics=[
            [step, {k: v for k, v in m.items() if k.startswith("rankguard/straggler")}]
            for step, m in metrics.calls
            if any(k.startswith("rankguard/straggler") for k in m)
        ],
    )
    return result


def checkpoint_every_6(out_dir: str) -> list[L.Callback]:
    return [ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), every_n_train_steps=6)]


SCENARIOS: dict[str, Callable[[str], dict]] = {
    # Equal ranks, validated and saved every 6 batches: no warning, scores every interval.
    "straggler_healthy": lambda out: run(
        {"straggler_monitor": STRAGGLER},
        False,
        False,
        val_check_interval=6,
        enable_checkpointing=True,
        callbacks=checkpoint_every_6(out),
    ),
    "slow_compute": lambda out: run({"straggler_monitor": STRAGGLER}, True, False),
    "slow_data": lambda out: run(
        {"straggler_monitor": STRAGGLER, "data_stall_monitor": STALL}, False, True
    ),
    "slow_compute_raise": lambda out: run(
        {"straggler_monitor": {**STRAGGLER, "on_violation": "raise"}},
        True,
        False,
    ),
}


def main(argv: list[str]) -> int:
    out_dir, *names = argv
    torch.set_num_threads(1)  # two ranks on two shared cores
    L.seed_everything(0, verbose=False)
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {"finished": False, "scenarios": {}}
    for name in names:
        result = SCENARIOS[name](out_dir)
        report["scenarios"][name] = result
        report["finished"] = name == names[-1]
        path = os.path.join(out_dir, f"rank{result['rank']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
