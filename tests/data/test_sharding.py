"""Unsharded data: the decisions without processes, then 2 ranks through the loop API."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from rankguard.callbacks.core.errors import DataInconsistencyError
from rankguard.callbacks.data.sharding import (
    BatchPrints,
    ShardFacts,
    batch_prints,
    duplicated_batches,
    shard_facts,
    sharding_problems,
)
from tests.mp import run_ranks

DATA = TensorDataset(torch.arange(256).reshape(64, 4).float(), torch.arange(64) % 2)


def _prints(batches):
    digests, samples = zip(*(batch_prints(b) for b in batches), strict=True)
    return BatchPrints(tuple(digests), tuple(s for ss in samples for s in ss))


def _batches(loader, n=4):
    return [b for _, b in zip(range(n), loader, strict=False)]


def test_shard_facts_read_the_sampler_and_the_loader():
    sampler = DistributedSampler(DATA, num_replicas=4, rank=3)
    facts = shard_facts(DataLoader(DATA, sampler=sampler))
    assert (facts.map_style, facts.num_replicas, facts.shard) == (True, 4, 3)
    plain = shard_facts(DataLoader(DATA, shuffle=True))
    assert (plain.map_style, plain.num_replicas, plain.sampler) == (True, None, "RandomSampler")


def test_a_sampler_with_the_wrong_num_replicas_is_proven_at_fit_start():
    facts = {r: ShardFacts("DataLoader", True, 1, 0, "DistributedSampler") for r in (0, 1)}
    [problem] = sharding_problems(facts, same_dataset=True)
    assert "splits the data into num_replicas shares" in problem and "ranks 0,1: 1" in problem
    # Declared: one data-parallel replica of two model-parallel ranks reads one share.
    assert sharding_problems(facts, same_dataset=True, data_parallel_size=1) == []


def test_ranks_given_the_same_share_are_proven_at_fit_start():
    facts = {r: ShardFacts("DataLoader", True, 2, 0, "DistributedSampler") for r in (0, 1)}
    [problem] = sharding_problems(facts, same_dataset=True)
    assert "ranks 0,1 all read share 0" in problem
    healthy = {r: ShardFacts("DataLoader", True, 2, r, "DistributedSampler") for r in (0, 1)}
    assert sharding_problems(healthy, same_dataset=True) == []


def test_a_map_style_loader_without_a_sampler_is_proven_only_over_the_same_dataset():
    facts = {r: ShardFacts("DataLoader", True, sampler="RandomSampler") for r in (0, 1)}
    [problem] = sharding_problems(facts, same_dataset=True)
    assert (
        "ranks 0,1 read the same map-style dataset" in problem and "DistributedSampler" in problem
    )
    # Each rank loads its own shard on purpose: different datasets, nothing proven.
    assert sharding_problems(facts, same_dataset=False) == []
    # An iterable dataset cannot be judged from facts (its batches are).
    iterable = {
        r: ShardFacts("DataLoader", False, sampler="_InfiniteConstantSampler") for r in (0, 1)
    }
    assert sharding_problems(iterable, same_dataset=True) == []


def test_a_loader_that_shards_itself_declares_the_data_parallel_size():
    olmo = {r: ShardFacts("NumpyFSLDataLoader", num_replicas=2, shard=r) for r in (0, 1, 2, 3)}
    assert sharding_problems(olmo, same_dataset=True) == []  # 2 replicas of 2 shards
    wrong = {r: ShardFacts("NumpyFSLDataLoader", num_replicas=2, shard=0) for r in (0, 1, 2, 3)}
    [problem] = sharding_problems(wrong, same_dataset=True)
    assert "ranks 0-3 all read share 0" in problem


def test_identical_first_batches_are_named_with_their_count():
    loader = DataLoader(
        DATA, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    same = _prints(_batches(loader))
    loader2 = DataLoader(
        DATA, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    problem = duplicated_batches({0: same, 1: _prints(_batches(loader2))})
    assert problem == "ranks 0,1 read the same first 4 train batches"
    assert duplicated_batches({0: same, 1: same}, data_parallel_size=1) is None


def test_a_sharded_loader_shares_no_sample_and_an_unsharded_shuffle_shares_most():
    def sharded(rank):
        return _prints(
            _batches(
                DataLoader(
                    DATA,
                    batch_size=4,
                    sampler=DistributedSampler(DATA, num_replicas=2, rank=rank, seed=0),
                )
            )
        )

    assert duplicated_batches({0: sharded(0), 1: sharded(1)}) is None

    def shuffled(seed):  # each rank's own unseeded order over all of the data
        order = DataLoader(
            DATA, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
        return _prints(_batches(order))

    problem = duplicated_batches({0: shuffled(1), 1: shuffled(2)})
    assert problem is not None and problem.startswith("ranks 0,1 read the same samples"), problem


def test_constant_samples_are_not_taken_for_shared_ones():
    ones = TensorDataset(torch.ones(64, 4), torch.zeros(64))
    prints = {
        r: _prints(
            _batches(
                DataLoader(
                    ones,
                    batch_size=4,
                    sampler=DistributedSampler(ones, num_replicas=2, rank=r, shuffle=False),
                )
            )
        )
        for r in (0, 1)
    }
    # Every batch is the same bytes: the batches are named, the samples (repeated) are not.
    assert duplicated_batches(prints) == "ranks 0,1 read the same first 4 train batches"
    prints = {r: BatchPrints((f"b{r}",), p.samples) for r, p in prints.items()}
    assert duplicated_batches(prints) is None


class _IgnoresRank(IterableDataset):
    """A custom iterable that never looks at the rank: every rank yields everything."""

    def __iter__(self):
        return iter(DATA)


def _loop(rank, world_size, kind):
    from rankguard.integrations.torch import RankGuard

    if kind == "no_sampler":
        loader = DataLoader(
            DATA, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
    elif kind == "wrong_replicas":
        loader = DataLoader(
            DATA, batch_size=8, sampler=DistributedSampler(DATA, num_replicas=1, rank=0)
        )
    elif kind == "iterable":
        loader = DataLoader(_IgnoresRank(), batch_size=8)
    else:
        loader = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA))
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("rankguard").addHandler(handler)
    batches = 0
    try:
        guard = RankGuard(hang_watchdog=False, straggler_monitor=False)
        with guard.fit(torch.nn.Linear(4, 2), None, loader) as run:
            for _ in run.train(loader):
                batches += 1
    except DataInconsistencyError as exc:
        return "error", str(exc), batches, warnings
    finally:
        logging.getLogger("rankguard").removeHandler(handler)
    return "ok", "", batches, warnings


@pytest.mark.parametrize(
    ("kind", "batches", "expected"),
    [
        (
            "no_sampler",
            0,
            "read the same map-style dataset through a DataLoader without a distributed sampler",
        ),
        ("wrong_replicas", 0, "splits the data into num_replicas shares that differ from the 2"),
        ("iterable", 4, "ranks 0,1 read the same first 4 train batches"),
    ],
)
def test_unsharded_loop_loaders_stop_every_rank(kind, batches, expected):
    outcomes = run_ranks(_loop, 2, kind, timeout_s=90)
    for o in outcomes:
        assert o.error is None, o.error
        outcome, message, ran, _ = o.value
        assert outcome == "error" and ran == batches, o.value
        assert message.startswith("Ranks train on the same data ("), message
        assert expected in message and "Fix:" in message, message


def test_a_sharded_loop_loader_is_clean():
    outcomes = run_ranks(_loop, 2, "sharded", timeout_s=90)
    for o in outcomes:
        assert o.error is None, o.error
        assert o.value == ("ok", "", 4, []), o.value
