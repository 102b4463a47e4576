"""DataConsistencyGuard: ranks that see different data are caught at fit start."""

from __future__ import annotations

import logging
import os
import random
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from rankguard.callbacks.core.errors import DataInconsistencyError
from rankguard.callbacks.core.events import EventFacts, LoaderFacts
from rankguard.callbacks.core.guard import RAISED
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.data.data_consistency_guard import (
    DataConsistencyGuard,
    compare_loader,
    rng_verdict,
)
from rankguard.callbacks.data.fingerprint import (
    DatasetFingerprint,
    fingerprint_loader,
    sample_indices,
)
from rankguard.callbacks.data.rng_state import rng_digest
from tests.mp import run_ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, RAISED, False):  # an error is logged, then raised
            self.messages.append(record.getMessage())


def _check(loader, rank, world_size, **kwargs):
    """Runs the guard's fit-start check; returns (error message or None, warnings)."""
    records = _Records()
    logging.getLogger("rankguard").addHandler(records)
    guard = DataConsistencyGuard(**kwargs)
    guard.bind(SideChannel.from_environment(timeout_s=20))
    facts = EventFacts.for_loaders([LoaderFacts("train", loader, is_train=True)])
    try:
        guard.on_fit_start(facts)
        error = None
    except DataInconsistencyError as exc:
        error = str(exc)
    logging.getLogger("rankguard").removeHandler(records)
    return error, records.messages


def _split(seed_numpy: bool, rank: int) -> list[int]:
    """The llama-recipes bug: torch is seeded, the split's numpy shuffle may not be."""
    torch.manual_seed(0)
    if seed_numpy:
        random.seed(0)
        np.random.seed(0)
    order = np.random.permutation(400)
    return [int(i) for i in order[:300]]  # the "train" part of a train/test split


class Opaque:
    """An item rankguard cannot hash by value."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class OpaqueDataset(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return {"obj": Opaque(), "set": {i}, "x": torch.tensor([i])}


def _scenarios(rank, world_size, root):
    def loader(data, seed=0):
        return DataLoader(data, sampler=DistributedSampler(data, world_size, rank, seed=seed))

    out = {}
    out["unseeded"] = _check(loader(_split(False, rank)), rank, world_size)
    out["seeded"] = _check(loader(_split(True, rank)), rank, world_size)
    data = list(range(100))
    out["sampler_seed"] = _check(loader(data, seed=rank), rank, world_size)
    out["length"] = _check(loader(list(range(100 + rank))), rank, world_size, check_rng=False)
    out["opaque"] = _check(loader(OpaqueDataset()), rank, world_size)
    own_shard = DataLoader(list(range(rank * 50, rank * 50 + 50 + rank)))  # no DistributedSampler
    out["own_shard"] = _check(own_shard, rank, world_size)
    out["streaming"] = _streaming(rank, world_size, root) if find_spec("streaming") else None
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    # One spawn for every scenario: starting ranks (torch, streaming imports) dominates.
    root = str(tmp_path_factory.mktemp("mds"))
    outcomes = run_ranks(_scenarios, 2, root, timeout_s=90)
    for o in outcomes:
        assert o.error is None, o.error
    return [o.value for o in outcomes]


def test_split_without_seed_is_caught_at_fit_start_naming_ranks_and_content(scenarios):
    for ranks in scenarios:
        error, warnings = ranks["unseeded"]
        assert error is not None
        assert "loader 'train'" in error and "content differs" in error
        assert "rank 0:" in error and "rank 1:" in error
        assert "train_test_split(..., seed=42)" in error and "numpy.random.seed" in error
    # torch seeded the same, numpy and python random not: warned once, on every rank.
    for ranks in scenarios:
        _, warnings = ranks["unseeded"]
        assert len(warnings) == 1 and "numpy" in warnings[0] and "torch was" in warnings[0]


def test_seeded_split_passes_silently(scenarios):
    for ranks in scenarios:
        assert ranks["seeded"] == (None, [])


def test_sampler_seed_difference_is_named(scenarios):
    error, _ = scenarios[0]["sampler_seed"]
    assert "sampler seed differs (rank 0: seed 0; rank 1: seed 1)" in error
    assert "content" not in error.split(".")[0] and "same `seed`" in error


def test_length_difference_is_named(scenarios):
    error, warnings = scenarios[1]["length"]
    assert "length differs (rank 0: 100 items; rank 1: 101 items)" in error
    assert warnings == []


def test_unhashable_items_fall_back_without_crashing(scenarios):
    for ranks in scenarios:
        assert ranks["opaque"] == (None, [])
    fp = fingerprint_loader(OpaqueDataset(), 4)
    assert fp.content_kind == "items" and fp.sampled == 4


def _streaming(rank, world_size, root):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    if rank == 0:
        for name in "abc":
            with MDSWriter(out=os.path.join(root, name), columns={"x": "int"}) as writer:
                for i in range(64):
                    writer.write({"x": i})
    SideChannel.from_environment(timeout_s=60).barrier("mds_written")

    def dataset(name, **kwargs):
        local = os.path.join(root, name)
        return StreamingDataset(local=local, shuffle=True, batch_size=4, **kwargs)

    same = dataset("a", shuffle_seed=7, num_canonical_nodes=1)
    seed = dataset("b", shuffle_seed=7 + rank, num_canonical_nodes=1)
    nodes = dataset("c", shuffle_seed=7, num_canonical_nodes=1 + rank)
    out = [_check(ds, rank, world_size, check_rng=False) for ds in (same, seed, nodes)]
    clean_stale_shared_memory()
    return out


def test_streaming_dataset_config_differences_are_caught(scenarios):
    # StreamingDatasets written locally with MDSWriter, opened on 2 ranks with local paths.
    if scenarios[0]["streaming"] is None:
        pytest.skip("needs mosaicml-streaming: pip install 'rankguard[streaming]'")
    for ranks in scenarios:
        same, seed, nodes = ranks["streaming"]
        assert same == (None, [])
        assert "streaming shuffle_seed differs (rank 0: 7; rank 1: 8)" in seed[0]
        assert "streaming num_canonical_nodes differs (rank 0: 1; rank 1: 2)" in nodes[0]
        assert "StreamingDataset" in nodes[0]


def _fp(**kwargs):
    return DatasetFingerprint(**{"dataset_type": "D", "sharded": True, **kwargs})


def test_hugging_face_fingerprint_alone_is_not_a_mismatch():
    # datasets gives random fingerprints to transforms it cannot hash.
    assert compare_loader({0: _fp(hf_fingerprint="a"), 1: _fp(hf_fingerprint="b")}) == []
    diffs = compare_loader({0: _fp(length=1, hf_fingerprint="a"), 1: _fp(length=2)})
    assert [name for name, _ in diffs] == ["length", "hf fingerprint"]


def test_a_loader_missing_on_some_ranks_is_named():
    diffs = compare_loader({0: _fp(), 1: None, 2: None})
    assert diffs == [("loader", "ranks 1,2: absent; rank 0: present")]


def test_ranks_loading_their_own_shard_without_a_distributed_sampler_pass(scenarios):
    for ranks in scenarios:
        assert ranks["own_shard"] == (None, [])


def test_check_content_decides_when_length_and_content_are_compared():
    own = {0: _fp(length=1, content="a", sharded=False), 1: _fp(length=2, sharded=False)}
    assert compare_loader(own) == []  # "auto": nobody shards with a distributed sampler
    assert [name for name, _ in compare_loader(own, True)] == ["length", "content"]
    sharded = {r: _fp(length=1 + r) for r in range(2)}
    assert [name for name, _ in compare_loader(sharded)] == ["length"]
    assert compare_loader(sharded, False) == []


def test_iterable_datasets_are_never_iterated_and_hf_fingerprints_are_read():
    class Stream(IterableDataset):
        def __iter__(self):
            raise AssertionError("iterated")

    fp = fingerprint_loader(DataLoader(Stream(), batch_size=2), 16)
    assert (fp.dataset_type, fp.length, fp.content_kind) == ("Stream", None, "none")

    class HFLike(list):
        _fingerprint = "9a8b7c"

    assert fingerprint_loader(DataLoader(HFLike([1, 2])), 16).hf_fingerprint == "9a8b7c"


def test_thousands_of_distinct_values_stay_short():
    diffs = compare_loader({r: _fp(length=r) for r in range(1024)})
    assert len(diffs[0][1]) < 200 and "1020 more groups" in diffs[0][1]


def test_rng_check_warns_only_when_generators_disagree_in_how_they_were_seeded():
    same = {"python random": "a", "numpy": "b", "torch": "c"}
    per_rank = {"python random": "x", "numpy": "y", "torch": "z"}
    assert rng_verdict({0: same, 1: same}) is None  # all seeded alike
    assert rng_verdict({0: same, 1: per_rank}) is None  # all per rank (seed + rank)
    numpy_not = dict(same, numpy="q")
    message = rng_verdict({0: same, 1: numpy_not})
    assert message.startswith("numpy was not seeded the same on every rank")
    assert "rank 0: state b; rank 1: state q" in message
    assert rng_verdict({0: dict(same, torch=None), 1: dict(per_rank, torch=None)}) is None


def test_fingerprint_leaves_random_streams_alone_and_reads_few_items():
    class Counting(Dataset):
        reads = 0

        def __len__(self):
            return 1_000_000

        def __getitem__(self, i):
            Counting.reads += 1
            return torch.rand(2)  # an augmentation: seeded per item while fingerprinting

    torch.manual_seed(1)
    before = (rng_digest(), torch.get_rng_state())
    a = fingerprint_loader(Counting(), 16)
    b = fingerprint_loader(Counting(), 16)
    assert (rng_digest(), torch.get_rng_state()).__repr__() == before.__repr__()
    assert a == b and a.content_kind == "items" and Counting.reads == 2 * 17
    assert sample_indices(10, 4) == [0, 3, 6, 9] and sample_indices(2, 4) == [0, 1]


def test_invalid_arguments_name_the_argument():
    with pytest.raises(ValueError, match="`sample_items`"):
        DataConsistencyGuard(sample_items=-1)
    with pytest.raises(ValueError, match="`on_violation`"):
        DataConsistencyGuard(on_violation="ignore")
    with pytest.raises(ValueError, match="`check_content`"):
        DataConsistencyGuard(check_content="sometimes")
