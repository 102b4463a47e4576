"""Plain facts about data loaders, read without iterating them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from rankguard.callbacks.core.events import LoaderFacts

__all__ = [
    "LoaderSettings",
    "enforce_drop_last",
    "loader_settings",
    "planned_batches",
    "promised_batches",
    "sample_accounting",
]


def planned_batches(facts: LoaderFacts) -> int | None:
    """The number of batches one pass of the loader will run, if knowable.

    The framework's own plan (``facts.num_batches``) wins; else ``len(loader)``;
    ``None`` for loaders without a usable ``__len__`` (iterable, streaming).
    """
    if facts.num_batches is not None:
        return int(facts.num_batches)
    try:
        return len(facts.loader)
    except (TypeError, NotImplementedError):
        return None


def promised_batches(facts: LoaderFacts) -> int | None:
    """What the loader's own ``__len__`` promises for one pass (capped by the framework's plan).

    ``None`` when the loader has no usable ``__len__``: a framework's batch
    limit alone is a cap, not a promise.
    """
    try:
        promised = len(facts.loader)
    except (TypeError, NotImplementedError):
        return None
    return promised if facts.num_batches is None else min(promised, int(facts.num_batches))


@dataclass(frozen=True)
class LoaderSettings:
    """The batching settings of one loader on one rank (compared across ranks).

    Attributes:
        loader_type: Class name of the loader.
        batch_size: DataLoader ``batch_size`` (``None`` with a custom batch sampler).
        drop_last: DataLoader ``drop_last`` (as its batch sampler applies it).
        sampler: Class name of the sampler.
        dist_drop_last: ``DistributedSampler.drop_last``, or ``None`` if not one.
        dist_shuffle: ``DistributedSampler.shuffle``.
        dist_seed: ``DistributedSampler.seed``.
        dist_num_replicas: ``DistributedSampler.num_replicas``.
    """

    loader_type: str
    batch_size: int | None = None
    drop_last: bool | None = None
    sampler: str | None = None
    dist_drop_last: bool | None = None
    dist_shuffle: bool | None = None
    dist_seed: int | None = None
    dist_num_replicas: int | None = None


def loader_settings(loader: Any) -> LoaderSettings:
    """Reads a loader's batching settings; non-DataLoaders give only their type."""
    if not isinstance(loader, DataLoader):
        return LoaderSettings(loader_type=type(loader).__name__)
    batch_sampler = loader.batch_sampler
    drop_last = (
        batch_sampler.drop_last if isinstance(batch_sampler, BatchSampler) else loader.drop_last
    )
    sampler = loader.sampler
    dist = sampler if isinstance(sampler, DistributedSampler) else None
    return LoaderSettings(
        loader_type=type(loader).__name__,
        batch_size=loader.batch_size,
        drop_last=bool(drop_last),
        sampler=type(sampler).__name__,
        dist_drop_last=None if dist is None else bool(dist.drop_last),
        dist_shuffle=None if dist is None else bool(dist.shuffle),
        dist_seed=None if dist is None else int(dist.seed),
        dist_num_replicas=None if dist is None else int(dist.num_replicas),
    )


@dataclass(frozen=True)
class SampleAccounting:
    """What one rank's loader does with the dataset's samples in one pass.

    Attributes:
        dataset_len: Samples in the dataset (``None`` if unknown).
        samples: Samples this rank's sampler yields.
        padded: Samples the ``DistributedSampler`` repeats so ranks get equal
            shares (counted twice by eval metrics); 0 if none.
        dropped_by_sampler: Samples the ``DistributedSampler`` drops.
        last_batch: Size of the last, partial batch (0 if every batch is full).
        dropped_by_loader: Samples in a partial last batch that ``drop_last`` drops.
    """

    dataset_len: int | None
    samples: int | None
    padded: int = 0
    dropped_by_sampler: int = 0
    last_batch: int = 0
    dropped_by_loader: int = 0


def sample_accounting(loader: Any) -> SampleAccounting:
    """Counts padded, dropped and partial-batch samples of a loader on this rank."""
    if not isinstance(loader, DataLoader):
        return SampleAccounting(dataset_len=None, samples=None)
    try:
        dataset_len: int | None = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        dataset_len = None
    sampler = loader.sampler
    try:
        samples: int | None = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        samples = None
    padded = dropped_by_sampler = 0
    if isinstance(sampler, DistributedSampler) and dataset_len is not None:
        total = sampler.total_size
        padded = max(total - dataset_len, 0)
        dropped_by_sampler = max(dataset_len - total, 0)
    last_batch = dropped_by_loader = 0
    batch_size = loader.batch_size
    if samples is not None and batch_size:
        remainder = samples % batch_size
        if remainder and loader_settings(loader).drop_last:
            dropped_by_loader = remainder
        else:
            last_batch = remainder
    return SampleAccounting(
        dataset_len=dataset_len,
        samples=samples,
        padded=padded,
        dropped_by_sampler=dropped_by_sampler,
        last_batch=last_batch,
        dropped_by_loader=dropped_by_loader,
    )


def enforce_drop_last(loader: Any) -> bool:
    """Gives a DataLoader drop_last semantics in place, before it is iterated.

    Sets ``DistributedSampler.drop_last`` (recomputing its shares) and the
    batch sampler's ``drop_last``, so every rank runs the same number of full
    batches when the dataset length is the same on every rank.

    Returns:
        ``True`` if the loader now drops its remainders; ``False`` if it is
        not a map-style DataLoader with a standard ``BatchSampler`` (nothing
        changed).
    """
    if (
        not isinstance(loader, DataLoader)
        or isinstance(loader.dataset, IterableDataset)  # batches come from the dataset itself
        or not isinstance(loader.batch_sampler, BatchSampler)
    ):
        return False
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        sampler.drop_last = True
        sampler.num_samples = math.floor(len(sampler.dataset) / sampler.num_replicas)  # type: ignore[arg-type]
        sampler.total_size = sampler.num_samples * sampler.num_replicas
    loader.batch_sampler.drop_last = True
    return True
