"""A real 2-rank Lightning job (CPU, gloo) that runs rankguard scenarios in sequence.

Usage::

    python tests/e2e/lightning_job.py OUT_DIR SCENARIO [SCENARIO ...]

Lightning's DDP launcher re-executes this script for rank 1 with the same
arguments, so both ranks run the same scenarios in the same order, each with a
fresh ``Trainer`` in the same two processes (the process group is made once).
Each rank writes ``OUT_DIR/rank<r>.json`` after every scenario: per scenario the
outcome (``"ok"`` or the exception class and message), the rankguard warnings
logged, and how many train and val steps the module ran.

An error is recorded and the next scenario runs (sound for errors that every
rank raises at the same point, which leaves the ranks in step); an error in the
last scenario is re-raised, so the process exits non-zero as a real job would.

Data is per rank (``use_distributed_sampler=False``) unless a scenario says
otherwise, so a scenario can give ranks different batch counts on purpose.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from rankguard.integrations.lightning import BatchParityGuard, DropLastGuard, RankGuard

BATCH = 4


class TinyModule(L.LightningModule):
    """Linear(4, 1) that counts its steps and logs val loss (``sync_dist=True`` by default)."""

    def __init__(self, sync_dist: bool = True) -> None:
        super().__init__()
        self.sync_dist = sync_dist
        self.layer = torch.nn.Linear(4, 1)
        self.train_steps = 0
        self.val_steps = 0
        self.sanity_val_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_steps += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.trainer.sanity_checking:
            self.sanity_val_steps += 1
        else:
            self.val_steps += 1
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("val_loss", loss, sync_dist=self.sync_dist)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LyingSampler(Sampler[int]):
    """Claims ``claimed`` samples but yields ``actual`` (as a broken streaming sampler does).

    Each batch from sample ``slow_after`` on takes 1.5 s more to fetch.
    """

    def __init__(self, claimed: int, actual: int, slow_after: int | None = None) -> None:
        self.claimed = claimed
        self.actual = actual
        self.slow_after = slow_after

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[int]:
        for i in range(self.actual):
            if self.slow_after is not None and i >= self.slow_after and i % BATCH == 0:
                time.sleep(1.5)
            yield i


def lying_loader(claimed: int, actual: int, slow_after: int | None = None) -> DataLoader:
    sampler = LyingSampler(claimed, actual, slow_after)
    return DataLoader(dataset(max(claimed, actual)), batch_size=BATCH, sampler=sampler)


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int, **kwargs: Any) -> DataLoader:
    return DataLoader(dataset(n), batch_size=BATCH, **kwargs)


@dataclass
class Scenario:
    """One fit: callbacks, per-rank loaders and Trainer settings."""

    callbacks: Callable[[], list[L.Callback]]
    train: Callable[[int], Any]
    val: Callable[[int], Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    sync_dist: bool = True


def per_rank(rank0: int, rank1: int) -> Callable[[int], DataLoader]:
    return lambda rank: loader(rank0 if rank == 0 else rank1)


EQUAL = per_rank(16, 16)  # 4 batches on every rank
UNEVEN_VAL = per_rank(8, 16)  # 2 batches on rank 0, 4 on rank 1

SCENARIOS: dict[str, Scenario] = {
    # The failure without rankguard: on gloo with one val metric sync per epoch, both
    # ranks finish and nothing says rank 1 ran twice the val batches of rank 0.
    "uneven_val_no_guard": Scenario(lambda: [], EQUAL, UNEVEN_VAL, {"num_sanity_val_steps": 0}),
    # Healthy runs: equal data, every guard, the sanity check on (2 steps).
    "healthy": Scenario(lambda: [RankGuard()], EQUAL, EQUAL),
    "healthy_distributed_sampler": Scenario(
        lambda: [RankGuard()],
        lambda rank: loader(32),
        lambda rank: [loader(16), loader(24)],
        {"use_distributed_sampler": True},
    ),
    # Lightning's DistributedSampler pads a val set of 15 to 16 samples: a warning.
    "eval_padding_distributed_sampler": Scenario(
        lambda: [RankGuard()],
        lambda rank: loader(32),
        lambda rank: loader(15),
        {"use_distributed_sampler": True, "num_sanity_val_steps": 0},
    ),
    # Uneven val batch counts: caught before the first val batch.
    "uneven_val": Scenario(
        lambda: [BatchParityGuard()], EQUAL, UNEVEN_VAL, {"num_sanity_val_steps": 0}
    ),
    # Val is first due in epoch 2, so the val loaders are unknown at fit start and the
    # check runs at the start of validation.
    "uneven_val_first_due_in_epoch_2": Scenario(
        lambda: [BatchParityGuard()],
        EQUAL,
        UNEVEN_VAL,
        {"num_sanity_val_steps": 0, "check_val_every_n_epoch": 2, "max_epochs": 2},
    ),
    "uneven_val_warn": Scenario(
        lambda: [BatchParityGuard(on_violation="warn")],
        EQUAL,
        UNEVEN_VAL,
        {"num_sanity_val_steps": 0},
    ),
    # With the sanity check (2 steps, equal on both ranks) the val loaders are
    # known at fit start, where the planned counts differ.
    "uneven_val_after_sanity": Scenario(lambda: [RankGuard()], EQUAL, UNEVEN_VAL),
    "uneven_train": Scenario(lambda: [BatchParityGuard()], per_rank(16, 24), EQUAL),
    "drop_last_differs": Scenario(
        lambda: [DropLastGuard()],
        lambda rank: loader(18, drop_last=rank == 0),
        EQUAL,
    ),
    "drop_last_differs_rankguard": Scenario(
        lambda: [RankGuard()],
        lambda rank: loader(18, drop_last=rank == 0),
        EQUAL,
    ),
    # 34 samples through Lightning's DistributedSampler: 17 per rank, 5 batches of 4
    # (the last of 1) unless mode="enforce" makes every rank drop the partial batch.
    # Two val loaders (a list): 2 vs 3 batches, then 2 vs 4 batches.
    "two_val_loaders_uneven": Scenario(
        lambda: [BatchParityGuard()],
        EQUAL,
        lambda rank: [loader(8 if rank == 0 else 12), loader(8 if rank == 0 else 16)],
    ),
    # Both ranks claim 4 val batches (len 16 samples); rank 0 yields 2, rank 1 yields 4:
    # with the count before the first batch off, caught by the after-eval check with the
    # counts that actually ran.
    "lying_len": Scenario(
        lambda: [BatchParityGuard(eval_end_timeout_s=5, max_count_samples=0)],
        EQUAL,
        lambda rank: lying_loader(claimed=16, actual=8 if rank == 0 else 16),
        {"num_sanity_val_steps": 0},
    ),
    # As above, but rank 1 is slow in its extra batches and no val metric is synced (a
    # sync at val epoch end would hold rank 0 until rank 1 is done): rank 0 reaches the
    # after-eval check first and names rank 1 once 0.5 s pass.
    "lying_len_slow_rank": Scenario(
        lambda: [BatchParityGuard(eval_end_timeout_s=0.5, max_count_samples=0)],
        EQUAL,
        lambda rank: lying_loader(claimed=16, actual=8 if rank == 0 else 16, slow_after=8),
        {"num_sanity_val_steps": 0},
        sync_dist=False,
    ),
    # Rank 1's sampler yields 4 batches, its __len__ says 2: Lightning stops at the planned
    # count, so rank 1's last 2 would silently never run. Counted before the first batch.
    "lying_len_capped_by_lightning": Scenario(
        lambda: [BatchParityGuard(eval_end_timeout_s=5)],
        EQUAL,
        lambda rank: lying_loader(claimed=8, actual=8 if rank == 0 else 16),
        {"num_sanity_val_steps": 0},
    ),
}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def run(name: str) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    settings = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp",
        "max_epochs": 1,
        "use_distributed_sampler": False,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **scenario.trainer,
    }
    trainer = L.Trainer(callbacks=scenario.callbacks(), **settings)
    rank = trainer.global_rank
    module = TinyModule(sync_dist=scenario.sync_dist)
    capture = _Capture()
    logging.getLogger("rankguard").addHandler(capture)
    record: dict[str, Any] = {"scenario": name, "rank": rank, "outcome": "ok"}
    started = time.monotonic()
    error: BaseException | None = None
    try:
        trainer.fit(module, scenario.train(rank), scenario.val(rank))
    except Exception as exc:
        error = exc
        record.update(outcome="error", error_type=type(exc).__name__, error=str(exc))
    finally:
        logging.getLogger("rankguard").removeHandler(capture)
    record.update(
        rank=trainer.global_rank,
        warnings=capture.messages,
        train_steps=module.train_steps,
        val_steps=module.val_steps,
        sanity_val_steps=module.sanity_val_steps,
        metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        elapsed_s=round(time.monotonic() - started, 3),
    )
    record["_error"] = error
    return record


def main(argv: list[str]) -> int:
    out_dir, *names = argv
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise SystemExit(f"unknown scenarios {unknown}; valid: {sorted(SCENARIOS)}")
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "finished": False,
        "scenarios": {},
    }
    error: BaseException | None = None
    for name in names:
        record = run(name)
        error = record.pop("_error")
        report["rank"] = record["rank"]
        report["scenarios"][name] = record
        if name == names[-1]:
            report.update(finished=True, exit_code=0 if error is None else 1, ended_at=time.time())
        path = os.path.join(out_dir, f"rank{report['rank']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
    if error is not None:
        raise error
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
