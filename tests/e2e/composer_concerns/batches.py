"""Batch parity and drop_last in Composer (tests/frameworks/test_batches_e2e.py)."""

from __future__ import annotations

from collections.abc import Callable

from composer import Callback
from torch.utils.data import DataLoader

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import (
    ClaimedStream,
    LyingSampler,
    Points,
)
from tests.e2e.composer_concerns.harness import CountBatches, fit, per_rank, rank, sharded


def parity(train: DataLoader, eval_loader: DataLoader, guard: Callback | None = None) -> None:
    fit(train, [guard or RankGuard(data_consistency_guard=False), CountBatches()], eval_loader)


SCENARIOS: dict[str, Callable[[], None]] = {
    "healthy": lambda: parity(sharded(64), sharded(32), RankGuard()),
    # Checkpoints every 4 batches into a relative folder: every save goes through the barrier.
    "checkpoint_barrier": lambda: fit(
        sharded(64),
        [RankGuard(), CountBatches()],
        sharded(32),
        save_folder="ckpt/{run_name}",
        save_interval="4ba",
        run_name="e2e",
    ),
    # Ranks built eval sets of different sizes: 2 vs 4 eval batches.
    "uneven_eval": lambda: parity(sharded(64), sharded(per_rank(16, 32))),
    # The same with every guard: the root cause (different datasets) is named first.
    "uneven_eval_all_guards": lambda: parity(sharded(64), sharded(per_rank(16, 32)), RankGuard()),
    # Ranks built train sets of different sizes: 2 vs 3 train batches.
    "uneven_train": lambda: parity(sharded(per_rank(16, 24)), sharded(32)),
    # drop_last differs: 18 samples per rank, 4 full batches + a partial one on rank 1.
    "drop_last_mismatch": lambda: parity(sharded(36, drop_last=rank() == 0), sharded(32)),
    # Ranks hold 32 and 34 train samples (8 vs 9 batches, the last partial); enforced
    # drop_last gives both 8 full batches.
    "drop_last_enforce": lambda: parity(
        sharded(per_rank(64, 68)),
        sharded(32),
        RankGuard(data_consistency_guard=False, drop_last_guard={"mode": "enforce"}),
    ),
    # Both ranks claim 4 eval batches; rank 0 yields 2, rank 1 yields 4. Composer stops
    # every rank when rank 0 runs out: rank 1's last 2 batches are silently skipped. With
    # the count before the first batch off, the after-eval check catches it.
    "lying_len": lambda: parity(
        sharded(64),
        sharded(64, sampler=LyingSampler(Points(64), 16, per_rank(8, 16))),
        RankGuard(
            data_consistency_guard=False,
            batch_parity_guard={"eval_end_timeout_s": 5, "max_count_samples": 0},
        ),
    ),
    # Both ranks claim 4 eval batches; rank 1 yields 8. Composer runs the 4 its __len__
    # says on every rank: rank 1's other 4 are silently skipped. Counted at fit start.
    "data_left_counted": lambda: parity(
        sharded(64),
        sharded(64, sampler=LyingSampler(Points(64), 16, per_rank(16, 32))),
        RankGuard(data_consistency_guard=False),
    ),
    # Each rank streams its own eval data; both streams say 4 batches, rank 0's holds 3.
    # Composer stops both when rank 0 runs out: rank 1's last batch is silently skipped.
    "data_left_eval_stream": lambda: parity(
        sharded(64),
        DataLoader(ClaimedStream(per_rank(12, 16), claimed=16, seed=rank()), batch_size=4),
        RankGuard(data_consistency_guard=False),
    ),
    # The same in training: both streams say 4 batches, rank 0's holds 3.
    "data_left_train_stream": lambda: parity(
        DataLoader(ClaimedStream(per_rank(12, 16), claimed=16, seed=rank()), batch_size=4),
        sharded(32),
        RankGuard(data_consistency_guard=False),
    ),
    # Streams that hold what they say on every rank: every check silent.
    "stream_healthy": lambda: parity(
        DataLoader(ClaimedStream(16, claimed=16, seed=rank()), batch_size=4),
        DataLoader(ClaimedStream(12, claimed=12, seed=rank()), batch_size=4),
        RankGuard(),
    ),
}


def setup(names: list[str]) -> None:
    """Nothing to set up before this concern's first scenario."""


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = set()
