"""What a loader really yields on this rank, beyond what its ``__len__`` says.

A rank whose loader holds more batches than another's, while the counts the
loaders report agree, silently skips the rest: Composer stops every rank as
soon as the first runs out, Lightning stops at the count it planned from
``__len__``. Two plain facts let :class:`~rankguard.callbacks.BatchParityGuard`
name that rank:

* :func:`count_batches`, before the first batch: the batches a map-style
  ``DataLoader`` will yield, from its batch sampler iterated for indices only
  (no sample is read), with every random generator it could draw from put
  back as it was. Bounded by ``max_samples`` indices; a larger loader is
  skipped (the caller says so at INFO).
* :class:`PassCounter`, during a pass: an adapter hands the framework this
  wrapper instead of the loader and afterwards reads how many batches the
  loader's iterator returned and whether it ran out
  (:class:`~rankguard.callbacks.core.events.LoaderPass`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from rankguard.callbacks.core.events import LoaderPass
from rankguard.callbacks.core.ranks import format_groups
from rankguard.callbacks.data.rng_state import preserved_rng

__all__ = [
    "DEFAULT_MAX_SAMPLES",
    "BatchCount",
    "LoaderYield",
    "PassCounter",
    "PassRun",
    "count_batches",
    "left_behind",
    "yield_mismatches",
]

#: Samples (dataset length, sampler length, indices walked) :func:`count_batches`
#: handles at most per loader: 0.3-1 s at the cap on a busy 2-core machine
#: (``benchmarks/count_batches.py``).
DEFAULT_MAX_SAMPLES = 1_000_000


@dataclass(frozen=True)
class BatchCount:
    """The batches a loader yields on this rank in one pass, if they could be counted.

    Attributes:
        batches: The count, or ``None`` if not counted.
        skipped: Why not counted (``None`` when counted, or when the loader is
            not a map-style ``DataLoader``, where counting cannot be done
            without reading data).
    """

    batches: int | None
    skipped: str | None = None


def count_batches(loader: Any, *, max_samples: int = DEFAULT_MAX_SAMPLES) -> BatchCount:
    """Counts the batches a map-style ``DataLoader`` yields, reading no data.

    Iterates the loader's batch sampler (or sampler, without automatic
    batching) for indices only. Python ``random``, numpy's global generator,
    torch's CPU generator and every generator held by the samplers are
    restored afterwards, and so are the samplers' attributes (an epoch or
    position counter), so the training's own pass draws exactly what it
    would have.

    Args:
        loader: The loader (anything else gives ``BatchCount(None)``).
        max_samples: A loader whose dataset or sampler holds more samples, or
            whose batch sampler yields more indices, is not counted.

    Returns:
        The count, or why there is none.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return BatchCount(None)
    batched = loader.batch_sampler is not None
    indices = loader.batch_sampler if batched else loader.sampler
    # A DistributedSampler shuffles the whole dataset to pick this rank's share.
    for what, sized in (("dataset", loader.dataset), ("sampler", loader.sampler)):
        try:
            size = len(sized)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            continue
        if size > max_samples:
            return BatchCount(None, f"its {what} holds {size} samples (over {max_samples})")
    batches = walked = 0
    with preserved_rng(), _preserved_samplers(indices):
        for batch in indices:
            batches += 1
            walked += _size(batch) if batched else 1
            if walked > max_samples:
                return BatchCount(None, f"its sampler yields over {max_samples} indices")
    return BatchCount(batches)


def _size(batch: Any) -> int:
    try:
        return len(batch)
    except TypeError:
        return 1


def _samplers(root: Any, depth: int = 3) -> list[Any]:
    """``root`` and the samplers it holds (a batch sampler's sampler, a wrapper's inner one)."""
    found, todo = [], [(root, 0)]
    while todo:
        obj, level = todo.pop()
        if any(obj is f for f in found):
            continue
        found.append(obj)
        if level < depth:
            attributes = getattr(obj, "__dict__", {})
            todo += [(v, level + 1) for v in attributes.values() if isinstance(v, Sampler)]
    return found


@contextlib.contextmanager
def _preserved_samplers(root: Any) -> Iterator[None]:
    """Puts back every sampler's attributes and the state of every generator they hold."""
    saved = []
    for sampler in _samplers(root):
        if not hasattr(sampler, "__dict__"):
            continue
        attributes = dict(vars(sampler))
        states = [(g, _get_state(g)) for g in attributes.values() if _is_generator(g)]
        saved.append((sampler, attributes, states))
    try:
        yield
    finally:
        for sampler, attributes, states in saved:
            vars(sampler).clear()
            vars(sampler).update(attributes)
            for generator, state in states:
                _set_state(generator, state)


def _is_generator(value: Any) -> bool:
    if isinstance(value, torch.Generator | random.Random):
        return True
    return type(value).__module__.startswith("numpy.random") and hasattr(value, "bit_generator")


def _get_state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    return generator.bit_generator.state  # numpy.random.Generator


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        generator.bit_generator.state = state


class PassCounter:
    """Wraps a loader and records, per pass, what its iterator returned and whether it ran out.

    Everything else (``len``, ``sampler``, ``dataset``...) is the wrapped
    loader's. A pass that the consumer stops early (a framework's batch limit,
    or all ranks stopping when one runs out) is not exhausted.

    Args:
        loader: The loader to wrap.

    Example::

        counter = PassCounter(loader)
        for batch in counter: ...
        counter.result()   # LoaderPass(yielded=8, exhausted=True)
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._yielded = 0
        self._exhausted = False
        self._started = False

    def __iter__(self) -> Iterator[Any]:
        self._yielded, self._exhausted, self._started = 0, False, True
        return self._count(iter(self.loader))

    def _count(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._yielded += 1
            yield batch
        self._exhausted = True

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def result(self) -> LoaderPass | None:
        """The latest pass (``None`` before the first)."""
        return LoaderPass(self._yielded, self._exhausted) if self._started else None


@dataclass(frozen=True)
class LoaderYield:
    """What one rank's loader is planned to run, promises and yields, before its first batch.

    Attributes:
        planned: Batches the framework plans to run (its own limit, else ``__len__``).
        promised: What the loader's ``__len__`` says.
        actual: What :func:`count_batches` counted.
    """

    planned: int
    promised: int
    actual: int

    @property
    def problem(self) -> bool:
        """Runs out before the plan, or holds batches past a plan made from ``__len__``.

        A plan below ``__len__`` is the framework's own limit (Composer's
        ``eval_subset_num_batches``, Lightning's ``limit_val_batches``, a
        sanity check): batches past it are cut on purpose.
        """
        return self.actual < self.planned or (
            self.actual > self.promised and self.planned >= self.promised
        )

    def __str__(self) -> str:
        says = f"__len__ {_batches(self.promised)}, yields {self.actual}"
        if self.actual < self.planned:
            short = self.planned - self.actual
            return f"{says} (runs out {short} short of the {self.planned} planned)"
        return f"{says} ({self.actual - self.planned} never run)"


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def yield_mismatches(per_rank: Mapping[int, Mapping[str, LoaderYield]]) -> dict[str, str]:
    """Finds loaders that, on some rank, yield other than what is planned from ``__len__``.

    Args:
        per_rank: For each rank, the counted loaders by name.

    Returns:
        For each such loader, the ranks concerned and their counts, e.g.
        ``{"eval": "rank 1: __len__ 2 batches, yields 4 (2 never run)"}``.
    """
    names = sorted({name for loaders in per_rank.values() for name in loaders})
    found = {}
    for name in names:
        odd = {r: y[name] for r, y in per_rank.items() if name in y and y[name].problem}
        if odd:
            found[name] = format_groups(odd)
    return found


@dataclass(frozen=True)
class PassRun:
    """What one rank's pass over a loader ran, for the after-pass checks.

    Attributes:
        ran: Batches that ran (counted from the framework's batch events).
        exhausted: Whether the loader's iterator ran out (``None``: not seen).
        yielded: Batches the iterator returned (``None``: not seen).
        total: Batches :func:`count_batches` counted before the pass, if any.
    """

    ran: int
    exhausted: bool | None = None
    yielded: int | None = None
    total: int | None = None

    def left(self) -> str:
        """What this rank left behind, as far as it is known."""
        if self.total is not None and self.total > self.ran:
            return f"{self.total - self.ran} more left (its loader yields {self.total})"
        if self.yielded is not None and self.yielded > self.ran:
            return f"at least {self.yielded - self.ran} more left"
        return "more left"


def left_behind(per_rank: Mapping[int, PassRun]) -> str:
    """Describes ranks that still had data when others ran out, or returns ``""``.

    Args:
        per_rank: Each rank's pass (ranks whose exhaustion was not seen are
            left out of the comparison).

    Returns:
        For example ``"rank 0 ran out of data after 3 batches, while rank 1
        still had data: it ran 3 batches, at least 1 more left"``.
    """
    out = {r: run.ran for r, run in per_rank.items() if run.exhausted is True}
    left = {r: run for r, run in per_rank.items() if run.exhausted is False}
    if not out or not left:
        return ""
    ran_out = format_groups(out, lambda n: f"ran out after {_batches(n)}")
    still = format_groups(
        {r: (run.ran, run.left()) for r, run in left.items()},
        lambda v: f"ran {_batches(v[0])}, {v[1]}",
    )
    return f"{ran_out}; still had data: {still}"
