"""A real 2-rank Composer job with rankguard.

Run: ``composer -n 2 composer_job.py OUT SCENARIO...``.

Each scenario is a fresh Trainer in the same processes; outcomes per rank go
to ``OUT/rank{N}.json`` (see tests/e2e/common.py).
"""

from __future__ import annotations

import sys

import torch
from composer import Callback, Evaluator, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import ClaimedStream, LyingSampler, Points, Recorder

COUNTERS: dict[str, int] = {}


class CountBatches(Callback):
    """Counts the train and eval batches that actually ran on this rank."""

    def batch_start(self, state, logger):
        COUNTERS["train_batches"] = COUNTERS.get("train_batches", 0) + 1

    def eval_batch_start(self, state, logger):
        COUNTERS["eval_batches"] = COUNTERS.get("eval_batches", 0) + 1


def model() -> ComposerClassifier:
    torch.manual_seed(0)
    return ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2)


def sharded(n: int, batch_size: int = 4, drop_last: bool = False, sampler=None) -> DataLoader:
    """Points(n) sharded over the ranks by a DistributedSampler (or ``sampler``)."""
    data = Points(n)
    return DataLoader(
        data,
        batch_size=batch_size,
        sampler=sampler or dist.get_sampler(data),
        drop_last=drop_last,
    )


def fit(train: DataLoader, eval_loader: DataLoader, guard=None, **trainer_kwargs) -> None:
    COUNTERS.clear()
    trainer = Trainer(
        **trainer_kwargs,
        model=model(),
        train_dataloader=train,
        eval_dataloader=Evaluator(label="eval", dataloader=eval_loader),
        max_duration="1ep",
        eval_interval="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[guard or RankGuard(data_consistency_guard=False), CountBatches()],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()


def per_rank(n_rank0: int, n_rank1: int) -> int:
    return n_rank0 if dist.get_global_rank() == 0 else n_rank1


SCENARIOS = {
    "healthy": lambda: fit(sharded(64), sharded(32), RankGuard()),
    # Checkpoints every 4 batches into a relative folder: every save goes through the barrier.
    "checkpointing": lambda: fit(
        sharded(64),
        sharded(32),
        RankGuard(),
        save_folder="ckpt/{run_name}",
        save_interval="4ba",
        run_name="e2e",
    ),
    # Ranks built eval sets of different sizes: 2 vs 4 eval batches.
    "uneven_eval": lambda: fit(sharded(64), sharded(per_rank(16, 32))),
    # The same with every guard: the root cause (different datasets) is named first.
    "uneven_eval_all_guards": lambda: fit(sharded(64), sharded(per_rank(16, 32)), RankGuard()),
    # Ranks built train sets of different sizes: 2 vs 3 train batches.
    "uneven_train": lambda: fit(sharded(per_rank(16, 24)), sharded(32)),
    # drop_last differs: 18 samples per rank, 4 full batches + a partial one on rank 1.
    "drop_last_mismatch": lambda: fit(
        sharded(36, drop_last=dist.get_global_rank() == 0), sharded(32)
    ),
    # Ranks hold 32 and 34 train samples (8 vs 9 batches, the last partial); enforced
    # drop_last gives both 8 full batches.
    "drop_last_enforce": lambda: fit(
        sharded(per_rank(64, 68)),
        sharded(32),
        RankGuard(data_consistency_guard=False, drop_last_guard={"mode": "enforce"}),
    ),
    # Both ranks claim 4 eval batches; rank 0 yields 2, rank 1 yields 4. Composer stops
    # every rank when rank 0 runs out: rank 1's last 2 batches are silently skipped. With
    # the count before the first batch off, the after-eval check catches it.
    "lying_len": lambda: fit(
        sharded(64),
        sharded(64, sampler=LyingSampler(Points(64), 16, per_rank(8, 16))),
        RankGuard(
            data_consistency_guard=False,
            batch_parity_guard={"eval_end_timeout_s": 5, "max_count_samples": 0},
        ),
    ),
    # Both ranks claim 4 eval batches; rank 1 yields 8. Composer runs the 4 its __len__
    # says on every rank: rank 1's other 4 are silently skipped. Counted at fit start.
    "data_left_counted": lambda: fit(
        sharded(64),
        sharded(64, sampler=LyingSampler(Points(64), 16, per_rank(16, 32))),
        RankGuard(data_consistency_guard=False),
    ),
    # Each rank streams its own eval data; both streams say 4 batches, rank 0's holds 3.
    # Composer stops both when rank 0 runs out: rank 1's last batch is silently skipped.
    "data_left_eval_stream": lambda: fit(
        sharded(64),
        DataLoader(ClaimedStream(per_rank(12, 16), claimed=16), batch_size=4),
        RankGuard(data_consistency_guard=False),
    ),
    # The same in training: both streams say 4 batches, rank 0's holds 3.
    "data_left_train_stream": lambda: fit(
        DataLoader(ClaimedStream(per_rank(12, 16), claimed=16), batch_size=4),
        sharded(32),
        RankGuard(data_consistency_guard=False),
    ),
    # Streams that hold what they say on every rank: every check silent.
    "stream_healthy": lambda: fit(
        DataLoader(ClaimedStream(16, claimed=16), batch_size=4),
        DataLoader(ClaimedStream(12, claimed=12), batch_size=4),
        RankGuard(),
    ),
}


def main() -> None:
    out_dir, *names = sys.argv[1:]
    recorder = Recorder(out_dir)
    for name in names:
        recorder.run(name, SCENARIOS[name], COUNTERS)


if __name__ == "__main__":
    main()
