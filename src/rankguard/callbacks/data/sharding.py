"""Whether ranks read different parts of the data: the facts, the prints, the decisions.

Pure functions beside ``DataConsistencyGuard``, which calls them at fit start
(:func:`shard_facts`, :func:`sharding_problems`) and over the first train batches
(:func:`batch_prints`, :func:`duplicated_batches`).
See docs/data.md#unsharded-data.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from rankguard.callbacks.core.ranks import group_ranks, rank_label

__all__ = [
    "BatchPrints",
    "ShardFacts",
    "batch_prints",
    "duplicated_batches",
    "shard_facts",
    "sharding_problems",
]

#: Bytes of each sample (of each tensor in a batch) hashed for its print.
SAMPLE_BYTES = 1024
#: A rank whose first samples were read by more ranks than its shard allows, at least
#: this often, reads what another rank reads (a sharded loader shares none).
OVERLAP_FRACTION = 0.5
#: Fewest distinct samples a rank must have printed for the overlap to be judged.
MIN_SAMPLES = 4

FIX_LOOP = (
    "Fix: give the train DataLoader a `DistributedSampler(dataset)` (it reads the world size "
    "and rank from the process group; call `sampler.set_epoch(epoch)` each epoch, and drop "
    "`shuffle=True` from the DataLoader), or have an IterableDataset read "
    "`torch.distributed.get_rank()`/`get_world_size()` (and `get_worker_info()`) and yield "
    "only its share. Composer: `sampler=composer.utils.dist.get_sampler(dataset)`. Lightning "
    "injects a DistributedSampler into map-style loaders (`use_distributed_sampler=True`); an "
    "IterableDataset must shard itself. A streaming dataset must be told the real world "
    "(mosaicml-streaming reads it from the launcher's environment: do not override "
    "WORLD_SIZE/RANK for it)."
)
FIX_REPLICAS = (
    "Fix: build the DistributedSampler with the data-parallel world: "
    "`DistributedSampler(dataset)` (the process group's world size and rank), or, with model "
    "parallelism, `num_replicas=<data-parallel size>, rank=<data-parallel rank>` and set "
    "`data_consistency_guard={'data_parallel_size': <that size>}`."
)
DECLARE = (
    "If ranks read the same data on purpose (model-parallel ranks of one data-parallel replica), "
    "declare it: `data_consistency_guard={'data_parallel_size': N}`, or turn the check off with "
    "`check_sharding=False`."
)


@dataclass(frozen=True)
class ShardFacts:
    """How one rank's train loader splits its data, read at fit start.

    Attributes:
        loader_type: The loader's class name.
        map_style: A ``DataLoader`` over a map-style dataset (its sampler picks the items).
        num_replicas: The shares a distributed sampler (or a loader that shards itself,
            OLMo-core's ``dp_world_size``) splits the data into; ``None`` without one.
        shard: This rank's share (``rank``, ``process_index``, ``dp_rank``), if known.
        sampler: The sampler's class name (``None`` without one).
    """

    loader_type: str
    map_style: bool = False
    num_replicas: int | None = None
    shard: int | None = None
    sampler: str | None = None


def _int(owner: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def shard_facts(loader: Any) -> ShardFacts:
    """Reads how ``loader`` shards its data (never iterates it)."""
    if not isinstance(loader, DataLoader):
        return ShardFacts(
            type(loader).__name__,
            num_replicas=_int(loader, "dp_world_size"),
            shard=_int(loader, "dp_rank"),
        )
    map_style = not isinstance(loader.dataset, IterableDataset)
    for owner in (loader.sampler, loader.batch_sampler):
        replicas = _int(owner, "num_replicas", "num_processes")
        if replicas is not None:
            shard = _int(owner, "rank", "process_index")
            return ShardFacts(
                type(loader).__name__, map_style, replicas, shard, type(owner).__name__
            )
    return ShardFacts(type(loader).__name__, map_style, sampler=type(loader.sampler).__name__)


def sharding_problems(
    facts: Mapping[int, ShardFacts | None],
    same_dataset: bool,
    data_parallel_size: int | None = None,
) -> list[str]:
    """What proves, from the loaders' facts, that ranks read the same data at fit start.

    Args:
        facts: Per rank, its train loader's :class:`ShardFacts`.
        same_dataset: Whether every rank's dataset has the same fingerprint (length and
            sampled content): without a sampler that splits it, each reads all of it.
        data_parallel_size: The declared data-parallel size; ``None``: the world size (or
            the data-parallel size a loader that shards itself declares, OLMo-core's).

    Returns:
        One sentence per problem (empty: nothing proven).
    """
    known = {r: f for r, f in facts.items() if f is not None}
    world = len(facts)
    if world < 2 or not known:
        return []
    size = data_parallel_size or _declared(known) or world
    if size < 2:
        return []
    problems = []
    replicas = {r: f.num_replicas for r, f in known.items() if f.num_replicas is not None}
    wrong = {r: n for r, n in replicas.items() if n != size}
    if wrong:
        text = "; ".join(f"{rank_label(rs)}: {n}" for n, rs in _by_value(wrong))
        problems.append(
            f"the distributed sampler splits the data into num_replicas shares that differ "
            f"from the {size} data-parallel ranks ({text}). {FIX_REPLICAS}"
        )
    shards = {r: known[r].shard for r in replicas if r not in wrong}
    if len(shards) == len(facts) and None not in shards.values():
        per_shard = world // size
        crowded = [(s, rs) for s, rs in _by_value(shards) if len(rs) > per_shard]
        if crowded:
            text = "; ".join(f"{rank_label(rs)} all read share {s}" for s, rs in crowded)
            problems.append(
                f"ranks are given the same share of the data ({text}; {size} shares, "
                f"{per_shard} rank(s) each). {FIX_REPLICAS}"
            )
    unsplit = sorted(r for r, f in known.items() if f.map_style and f.num_replicas is None)
    if same_dataset and unsplit and len(unsplit) > world // size:
        problems.append(
            f"{rank_label(unsplit)} read the same map-style dataset through a DataLoader "
            f"without a distributed sampler ({known[unsplit[0]].sampler}): every one of "
            f"them reads all of it. {FIX_LOOP}"
        )
    return problems


def _declared(facts: Mapping[int, ShardFacts]) -> int | None:
    """The data-parallel size a loader that shards itself declares (OLMo-core's)."""
    sizes = {f.num_replicas for f in facts.values() if f.sampler is None and f.num_replicas}
    return sizes.pop() if len(sizes) == 1 else None


def _by_value(values: Mapping[int, Any]) -> list[tuple[Any, list[int]]]:
    return [(value, ranks) for ranks, value in group_ranks(values)]


@dataclass(frozen=True)
class BatchPrints:
    """Cheap prints of a rank's first train batches, exchanged once.

    Attributes:
        batches: Per batch, a short hash of its first bytes of every tensor.
        samples: Per sample of those batches, an 8-byte hash of its first bytes.
    """

    batches: tuple[str, ...] = ()
    samples: tuple[int, ...] = ()


def batch_prints(batch: Any) -> tuple[str, list[int]]:
    """One batch's print and its samples' prints (tensors and numpy arrays; a few KiB read)."""
    leaves = [t for t in _leaves(batch, 0) if t.ndim >= 1 and t.shape[0] > 0]
    whole = hashlib.blake2b(digest_size=8)
    size = leaves[0].shape[0] if leaves else 0
    rows = [hashlib.blake2b(digest_size=8) for _ in range(size)]
    for leaf in leaves:
        whole.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
        if leaf.shape[0] != size:
            continue
        flat = leaf.detach().reshape(size, -1)
        per_row = max(1, SAMPLE_BYTES // max(1, flat.element_size()))
        head = flat[:, :per_row].cpu().contiguous()
        data = head.view(torch.uint8).numpy() if head.dtype != torch.bool else head.numpy()
        whole.update(data.tobytes())
        for row, digest in zip(data, rows, strict=True):
            digest.update(row.tobytes())
    samples = [int.from_bytes(d.digest(), "little", signed=True) for d in rows]
    return whole.hexdigest(), samples


def _leaves(obj: Any, depth: int) -> list[torch.Tensor]:
    if depth > 4:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.layout == torch.strided and not obj.is_quantized else []
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and getattr(obj, "ndim", 0):
        try:
            return [torch.from_numpy(obj)]
        except (TypeError, ValueError):
            return []
    if isinstance(obj, Mapping):
        return [t for key in sorted(obj, key=repr) for t in _leaves(obj[key], depth + 1)]
    if isinstance(obj, list | tuple):
        return [t for item in obj for t in _leaves(item, depth + 1)]
    return []


def duplicated_batches(
    per_rank: Mapping[int, BatchPrints], data_parallel_size: int | None = None
) -> str | None:
    """Names ranks whose first train batches are the same, or whose samples overlap.

    Args:
        per_rank: Every rank's prints of its first batches.
        data_parallel_size: The declared data-parallel size (``None``: the world size);
            ``world // data_parallel_size`` ranks may read the same data.

    Returns:
        The problem, or ``None`` when the ranks read different data.
    """
    world = len(per_rank)
    size = data_parallel_size or world
    if world < 2 or size < 2:
        return None
    allowed = max(1, world // size)
    sequences = {r: p.batches for r, p in per_rank.items() if p.batches}
    same = [(seq, ranks) for seq, ranks in _by_value(sequences) if len(ranks) > allowed]
    if same:
        seq, ranks = max(same, key=lambda pair: len(pair[1]))
        more = f" ({len(same) - 1} more such groups)" if len(same) > 1 else ""
        return f"{rank_label(ranks)} read the same first {len(seq)} train batches{more}"
    own = {r: set(p.samples) for r, p in per_rank.items()}
    # Samples a rank reads twice itself (constant rows, repeated items) say nothing.
    repeated = {r: {s for s, n in Counter(p.samples).items() if n > 1} for r, p in per_rank.items()}
    readers = Counter(s for samples in own.values() for s in samples)
    shared = {}
    for rank, samples in own.items():
        judged = samples - repeated[rank]
        if len(judged) >= MIN_SAMPLES:
            fraction = sum(readers[s] > allowed for s in judged) / len(judged)
            if fraction >= OVERLAP_FRACTION:
                shared[rank] = (fraction, len(judged))
    if len(shared) <= allowed:
        return None
    detail = "; ".join(f"rank {r}: {f:.0%} of {n}" for r, (f, n) in sorted(shared.items())[:8])
    return (
        f"{rank_label(sorted(shared))} read the same samples in their first train batches "
        f"({detail} samples also read by another rank; a sharded loader shares none)"
    )


def describe_unsharded(problems: Sequence[str], when: str) -> str:
    """The error for data that is not sharded: the short sentence, the problems, the fixes.

    Each problem from :func:`sharding_problems` carries its fix; one from
    :func:`duplicated_batches` does not, and gets the loader fix.
    """
    text = " | ".join(p if "Fix:" in p else f"{p}. {FIX_LOOP}" for p in problems)
    what = f"Ranks train on the same data ({when}; each rank computes what one would)"
    return f"{what}: {text} {DECLARE}"
