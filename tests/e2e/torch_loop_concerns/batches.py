"""Batch counts that differ: eval sets of unlike sizes, per-rank streams that end a batch
short (DDP with ``join``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import ClaimedStream, seed_everything, seeded_split, token_dataset
from tests.e2e.torch_loop_concerns.harness import COUNTERS, QUICK, count, fit


def uneven_eval() -> None:
    # Each rank built its own eval set (16 and 32 samples); the loop names it only at eval.
    eval_set = token_dataset(16 if dist.get_rank() == 0 else 32)
    guard = RankGuard(data_consistency_guard=False, **QUICK)
    fit(guard, seeded_split()[0], eval_set, eval_at_fit=False)


def streams(train_n: int, eval_n: int) -> None:
    """Each rank streams its own samples (``__len__``: 16 on every rank); DDP with ``join``.

    The loop runs the planned number of train steps (``len(train_loader)``) and at
    most ``len(eval_loader)`` eval batches, as llama-recipes' ``max_train_step`` and
    ``max_eval_step`` do; DDP's ``join`` lets a rank whose stream ran out first
    finish the epoch, so nothing hangs and, without rankguard, nothing is said.
    """
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    train_loader = DataLoader(ClaimedStream(train_n, claimed=16, seed=rank), batch_size=4)
    eval_loader = DataLoader(ClaimedStream(eval_n, claimed=16, seed=rank), batch_size=4)
    with RankGuard(**QUICK).fit(model, optimizer, train_loader, eval_loaders=eval_loader) as run:
        with model.join():
            for x, y in run.train(train_loader):
                count("train_batches")
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if run.step == len(train_loader):
                    break
        eval_loss = torch.zeros(())
        with torch.no_grad():
            for x, y in run.eval(eval_loader, max_batches=len(eval_loader)):
                count("eval_batches")
                # The module itself: after a join block DDP's forward still all-reduces.
                eval_loss += torch.nn.functional.cross_entropy(model.module(x), y)
        dist.all_reduce(eval_loss)  # after the eval: no collective per batch
        count("evals")


def short_eval_stream() -> None:
    """Rank 0's eval stream ends a batch short (3 of 4), rank 1's holds 5."""
    streams(16, 12 if dist.get_rank() == 0 else 20)


def short_train_stream() -> None:
    """Rank 0's train stream ends a batch short (3 of 4), rank 1's holds 6."""
    streams(12 if dist.get_rank() == 0 else 24, 16)


SCENARIOS = {
    "uneven_eval": uneven_eval,
    "short_eval_stream": short_eval_stream,
    "short_train_stream": short_train_stream,
}
