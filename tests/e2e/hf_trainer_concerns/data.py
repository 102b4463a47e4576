"""What the ranks read: the healthy fit on a seeded split, an unseeded split, eval sets of
unlike sizes."""

from __future__ import annotations

import torch.distributed as dist

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import seed_everything, seeded_split, token_dataset, unseeded_split
from tests.e2e.hf_trainer_concerns.harness import QUICK, train


def healthy() -> None:
    seed_everything(0)
    train("healthy", RankGuard(**QUICK), *seeded_split())


def unseeded() -> None:
    train_set, eval_set = unseeded_split(64, test_size=0.25)  # before the Trainer seeds anything
    train("unseeded_split", RankGuard(**QUICK), train_set, eval_set)


def uneven_eval() -> None:
    # Each rank built its own eval set (16 and 32 samples): 2 and 4 eval batches.
    eval_set = token_dataset(16 if dist.get_rank() == 0 else 32)
    guard = RankGuard(data_consistency_guard=False, **QUICK)
    train("uneven_eval", guard, seeded_split()[0], eval_set)


SCENARIOS = {
    "healthy": healthy,
    "unseeded_split": unseeded,
    "uneven_eval": uneven_eval,
}
