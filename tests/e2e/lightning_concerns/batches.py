"""Batch parity and drop_last in Lightning (tests/frameworks/test_batches_e2e.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from torch.utils.data import (
    DataLoader,
    Sampler,
)

from rankguard.integrations.lightning import (
    BatchParityGuard,
    DropLastGuard,
    RankGuard,
)
from tests.e2e.lightning_concerns.harness import (
    BATCH,
    Outcome,
    Scenario,
    SkipsStepModule,
    TinyModule,
    dataset,
    loader,
    run_fit,
)


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


def per_rank(rank0: int, rank1: int) -> Callable[[int], DataLoader]:
    return lambda rank: loader(rank0 if rank == 0 else rank1)


def fits(
    callbacks: Callable[[], list[L.Callback]],
    train: Callable[[int], Any],
    val: Callable[[int], Any],
    settings: dict[str, Any] | None = None,
    sync_dist: bool = True,
) -> Scenario:
    """A :class:`Scenario` from per-rank train and val loaders."""
    module = functools.partial(TinyModule, sync_dist=sync_dist)
    return Scenario(callbacks, lambda rank: (train(rank), val(rank)), settings or {}, module)


EQUAL = per_rank(16, 16)  # 4 batches on every rank
UNEVEN_VAL = per_rank(8, 16)  # 2 batches on rank 0, 4 on rank 1
NO_SANITY = {"num_sanity_val_steps": 0}

SCENARIOS: dict[str, Scenario] = {
    # The failure without rankguard: on gloo with one val metric sync per epoch, both
    # ranks finish and nothing says rank 1 ran twice the val batches of rank 0.
    "uneven_val_no_guard": fits(lambda: [], EQUAL, UNEVEN_VAL, NO_SANITY),
    # Healthy runs: equal data, every guard, the sanity check on (2 steps).
    "healthy": fits(lambda: [RankGuard()], EQUAL, EQUAL),
    "healthy_distributed_sampler": fits(
        lambda: [RankGuard()],
        lambda rank: loader(32, shared=True),
        lambda rank: [loader(16, shared=True), loader(24, shared=True)],
        {"use_distributed_sampler": True},
    ),
    # Lightning's DistributedSampler pads a val set of 15 to 16 samples: a warning.
    "eval_padding_distributed_sampler": fits(
        lambda: [RankGuard()],
        lambda rank: loader(32, shared=True),
        lambda rank: loader(15, shared=True),
        {"use_distributed_sampler": True, "num_sanity_val_steps": 0},
    ),
    # Gradient accumulation (Lightning's no_sync on every micro-batch but the last), a
    # replica check at every batch: equal throughout.
    "healthy_accumulation": fits(
        lambda: [RankGuard(replica_guard={"interval": 1})],
        EQUAL,
        EQUAL,
        {"accumulate_grad_batches": 2},
    ),
    # Manual optimization, rank 1 skips its second step: caught at the check after it.
    "replica_skipped_step": Scenario(
        lambda: [RankGuard(replica_guard={"interval": 1})],
        lambda rank: (EQUAL(rank), EQUAL(rank)),
        NO_SANITY,
        SkipsStepModule,
    ),
    # Uneven val batch counts: caught before the first val batch.
    "uneven_val": fits(lambda: [BatchParityGuard()], EQUAL, UNEVEN_VAL, NO_SANITY),
    # Val is first due in epoch 2, so the val loaders are unknown at fit start and the
    # check runs at the start of validation.
    "uneven_val_first_due_in_epoch_2": fits(
        lambda: [BatchParityGuard()],
        EQUAL,
        UNEVEN_VAL,
        {"num_sanity_val_steps": 0, "check_val_every_n_epoch": 2, "max_epochs": 2},
    ),
    "uneven_val_warn": fits(
        lambda: [BatchParityGuard(on_violation="warn")], EQUAL, UNEVEN_VAL, NO_SANITY
    ),
    # With the sanity check (2 steps, equal on both ranks) the val loaders are
    # known at fit start, where the planned counts differ.
    "uneven_val_after_sanity": fits(lambda: [RankGuard()], EQUAL, UNEVEN_VAL),
    "uneven_train": fits(lambda: [BatchParityGuard()], per_rank(16, 24), EQUAL),
    "drop_last_differs": fits(
        lambda: [DropLastGuard()], lambda rank: loader(18, drop_last=rank == 0), EQUAL
    ),
    "drop_last_differs_rankguard": fits(
        lambda: [RankGuard()], lambda rank: loader(18, drop_last=rank == 0), EQUAL
    ),
    # Two val loaders (a list): 2 vs 3 batches, then 2 vs 4 batches.
    "two_val_loaders_uneven": fits(
        lambda: [BatchParityGuard()],
        EQUAL,
        lambda rank: [loader(8 if rank == 0 else 12), loader(8 if rank == 0 else 16)],
    ),
    # Both ranks claim 4 val batches (len 16 samples); rank 0 yields 2, rank 1 yields 4:
    # with the count before the first batch off, caught by the after-eval check with the
    # counts that actually ran.
    "lying_len": fits(
        lambda: [BatchParityGuard(eval_end_timeout_s=5, max_count_samples=0)],
        EQUAL,
        lambda rank: lying_loader(claimed=16, actual=8 if rank == 0 else 16),
        NO_SANITY,
    ),
    # As above, but rank 1 is slow in its extra batches and no val metric is synced (a
    # sync at val epoch end would hold rank 0 until rank 1 is done): rank 0 reaches the
    # after-eval check first and names rank 1 once 0.5 s pass.
    "lying_len_slow_rank": fits(
        lambda: [BatchParityGuard(eval_end_timeout_s=0.5, max_count_samples=0)],
        EQUAL,
        lambda rank: lying_loader(claimed=16, actual=8 if rank == 0 else 16, slow_after=8),
        NO_SANITY,
        sync_dist=False,
    ),
    # Rank 1's sampler yields 4 batches, its __len__ says 2: Lightning stops at the planned
    # count, so rank 1's last 2 would silently never run. Counted before the first batch.
    "lying_len_capped_by_lightning": fits(
        lambda: [BatchParityGuard(eval_end_timeout_s=5)],
        EQUAL,
        lambda rank: lying_loader(claimed=8, actual=8 if rank == 0 else 16),
        NO_SANITY,
    ),
}


def setup(names: list[str]) -> Callable[[str], Outcome]:
    """Each scenario a fit of its own: its outcome, the warnings and errors it logged."""
    return lambda name: run_fit(name, SCENARIOS[name], data=False)


#: Whether ``OUT/rank<r>.json`` holds this concern's records alone, not a report around them.
RECORDS_ALONE = False
