"""What the ranks read: the healthy fit, an unseeded split, a loader every rank reads whole,
a loader slow or starved on one rank."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import seed_everything, seeded_split, unseeded_split
from tests.e2e.torch_loop_concerns import harness
from tests.e2e.torch_loop_concerns.harness import (
    COUNTERS,
    QUICK,
    BagOfTokens,
    check_batch,
    count,
    fit,
)


def lenient_check(batch: dict, step: int) -> None:
    """The data check at step 2, whose error the loop catches: the batch trains as it is."""
    try:
        check_batch(batch, step, bad_step=2)
    except ValueError:
        count("bad_samples_caught")


def healthy() -> None:
    """2 epochs; rank 1's data check raises at step 2 and the loop catches it (no fault)."""
    train_set, eval_set = seeded_split()
    fit(RankGuard(**QUICK), train_set, eval_set, epochs=2, check=lenient_check)
    COUNTERS["checkpoint_files"] = len(list((harness.OUT / "ckpt").glob("step*.pt")))


def unseeded() -> None:
    train_set, eval_set = unseeded_split(64, test_size=0.25)  # before the loop seeds anything
    fit(RankGuard(**QUICK), train_set, eval_set)


class _WarnedAt(logging.Handler):
    """Records the train batch at which rankguard warns about data (``COUNTERS``)."""

    def emit(self, record: logging.LogRecord) -> None:
        if "cannot keep up" in record.getMessage():
            COUNTERS.setdefault("data_warned_at_batch", COUNTERS.get("train_batches", 0))


def slow_loop(slow_s: float, steps: int, raise_at: int | None = None) -> None:
    """Rank 1's loader ``slow_s`` slower per batch from its first (a slow disk on one node).

    ``raise_at``: its loader raises at that batch, as OLMo's data thread does when reads
    cannot keep up (``generator thread data thread 3 failed``).
    """
    from tests.e2e.common import Points, record_at_raise

    COUNTERS.clear()
    seed_everything(0)
    rank = dist.get_rank()

    def collate(samples):
        if rank == 1:
            time.sleep(slow_s)
            if COUNTERS.get("train_batches", 0) + 1 == raise_at:
                raise RuntimeError("generator thread data thread 3 failed")
        return torch.utils.data.default_collate(samples)

    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Points(2 * 4 * steps)
    sampler = DistributedSampler(data)
    train_loader = DataLoader(data, batch_size=4, sampler=sampler, collate_fn=collate)
    handler = _WarnedAt(logging.WARNING)
    logging.getLogger("rankguard").addHandler(handler)
    try:
        with RankGuard(**QUICK).fit(model, optimizer, train_loader) as run:
            try:
                for x, y in run.train(train_loader):
                    count("train_batches")
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except RuntimeError as exc:  # the loader's: recorded before rankguard tells rank 0
                record_at_raise(exc)
                raise
    finally:
        logging.getLogger("rankguard").removeHandler(handler)


def slow_rank_data() -> None:
    """Rank 1's loader 0.1 s slower per batch over 40 steps: named on every rank."""
    slow_loop(0.1, 40)


def starved_loader() -> None:
    """Rank 1's loader waits from its first batch and raises at its 8th (it ends the job).

    Rank 0 waits in its next collective; rank 1 goes on to ``teardown_waits``.
    """
    slow_loop(0.25, 20, raise_at=8)


def teardown_waits() -> None:
    """After its error, rank 1's process stays, as NCCL's communicator teardown waits for a
    peer: no closed socket tells rank 0 (on gloo it would, at once)."""
    if dist.get_rank() == 1:
        time.sleep(120)


def unsharded(make_loader: Callable[[Any], DataLoader]) -> None:
    """A loop whose train loader every rank reads whole: 2 epochs planned."""
    train_set, _ = seeded_split()
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(BagOfTokens())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = make_loader(train_set.with_format("torch"))
    with RankGuard(**QUICK).fit(model, optimizer, train_loader) as run:
        for _ in range(2):
            for batch in run.train(train_loader):
                count("train_batches")
                out = model(batch["input_ids"])
                torch.nn.functional.cross_entropy(out, batch["labels"]).backward()
                optimizer.step()
                optimizer.zero_grad()


def no_sampler() -> None:
    """As a new user writes it: shuffled with a seeded generator, no DistributedSampler."""
    seeded = torch.Generator().manual_seed(0)
    unsharded(lambda data: DataLoader(data, batch_size=8, shuffle=True, generator=seeded))


def sampler_wrong_replicas() -> None:
    """A DistributedSampler told a world of one (``num_replicas=1, rank=0``) on every rank."""
    unsharded(
        lambda data: DataLoader(
            data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0)
        )
    )


SCENARIOS = {
    "healthy": healthy,
    "unseeded_split": unseeded,
    "slow_rank_data": slow_rank_data,
    "starved_loader": starved_loader,
    "teardown_waits": teardown_waits,
    "no_sampler": no_sampler,
    "sampler_wrong_replicas": sampler_wrong_replicas,
}
