"""DataConsistencyGuard: every rank sees the same dataset, split and sampler seed.

Holds :class:`DataConsistencyGuard`, the guard; the fingerprints are in ``fingerprint``.
See docs/data.md#how-dataconsistencyguard-works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rankguard.callbacks.core.background_exchange import BackgroundExchange, Pending
from rankguard.callbacks.core.errors import DataInconsistencyError
from rankguard.callbacks.core.events import EventFacts, LoaderFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.core.settings import check_choice, check_int
from rankguard.callbacks.data.fingerprint import DatasetFingerprint, fingerprint_loader
from rankguard.callbacks.data.rng_state import rng_digest
from rankguard.callbacks.data.sharding import (
    BatchPrints,
    ShardFacts,
    batch_prints,
    describe_unsharded,
    duplicated_batches,
    shard_facts,
    sharding_problems,
)

__all__ = ["DataConsistencyGuard", "DataVerdict", "compare_data", "compare_loader", "rng_verdict"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.data_consistency")

FIX_SPLIT = (
    "Fix: build the dataset and its split identically on every rank: pass a seed to every "
    "split and shuffle (Hugging Face `train_test_split(..., seed=42)`, scikit-learn "
    "`random_state=42`), and seed python `random` and numpy as well as torch with the same "
    "value on every rank (`random.seed(s); numpy.random.seed(s); torch.manual_seed(s)`, or "
    "Lightning's `seed_everything(s)`), or build the split once and save it. If each rank "
    "loads its own shard on purpose, set `check_content=False`."
)
FIX_SAMPLER_SEED = (
    "Fix: give the sampler the same `seed` on every rank (a DistributedSampler shuffles with "
    "seed + epoch; the ranks' shares partition the data only when their seeds are equal)."
)
FIX_SAMPLER = "Fix: build the sampler with the same arguments on every rank."
FIX_LOADERS = "Fix: give every rank the same loaders, under the same names."
FIX_STREAMING = (
    "Fix: construct the StreamingDataset with the same arguments on every rank (streams, "
    "split, shuffle, shuffle_seed, num_canonical_nodes, batch_size, epoch size); compute "
    "them from configuration, never from the rank."
)
_MAX_GROUPS = 4
#: The first train batches whose prints every rank exchanges once (``check_sharding``).
BATCHES_COMPARED = 4


@dataclass(frozen=True)
class DataVerdict:
    """What differs between ranks, decided on rank 0.

    Attributes:
        loaders: Per loader name, ``(component, per-rank description)`` pairs for
            each differing component, e.g. ``("content", "rank 0: ...; rank 1: ...")``.
        rng: A warning about inconsistently seeded generators, or ``None``.
        unsharded: What proves that ranks read the same train data (see ``sharding``).
    """

    loaders: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    rng: str | None = None
    unsharded: list[str] = field(default_factory=list)


def _components(fp: DatasetFingerprint, with_content: bool) -> dict[str, Hashable]:
    parts: dict[str, Hashable] = {"dataset type": fp.dataset_type}
    if with_content:
        parts["length"] = fp.length
        parts["content"] = (fp.content_kind, fp.sampled, fp.content)
    sampler = dict(fp.sampler)
    parts["sampler seed"] = sampler.pop("seed", None)
    parts["sampler settings"] = tuple(sampler.items())
    parts.update({f"streaming {name}": value for name, value in fp.streaming})
    parts["hf fingerprint"] = fp.hf_fingerprint
    return parts


def _describe(component: str, value: Any) -> str:
    if component == "length":
        return "no length" if value is None else f"{value} items"
    if component == "content":
        kind, sampled, digest = value
        if digest is None:
            return "not read"
        what = "hash" if kind == "items" else "types/shapes hash"
        return f"{what} {digest[:8]} of {sampled} items"
    if component == "sampler seed":
        return "no seed" if value is None else f"seed {value}"
    return repr(value)


def grouped(values: Mapping[int, Hashable], describe: Callable[[Any], str]) -> str:
    """Like ``format_groups``, but at most a few groups (for thousands of distinct values)."""
    groups = group_ranks(values)
    text = "; ".join(f"{rank_label(r)}: {describe(v)}" for r, v in groups[:_MAX_GROUPS])
    if len(groups) > _MAX_GROUPS:
        text += f"; ... {len(groups) - _MAX_GROUPS} more groups ({len(groups)} distinct values)"
    return text


def compare_loader(
    per_rank: Mapping[int, DatasetFingerprint | None], check_content: bool | str = "auto"
) -> list[tuple[str, str]]:
    """Returns the differing components of one loader's fingerprints, described per rank.

    Length and content are compared when ``check_content`` is ``True``, or when
    it is ``"auto"`` and some rank splits the dataset with a distributed
    sampler (which assumes the same dataset everywhere). Without one, ranks
    that hold different data may be sharding it themselves.

    A difference in the Hugging Face fingerprint alone is not reported: datasets
    assigns a random fingerprint to transforms it cannot hash, so it may differ
    between ranks holding the same data.
    """
    if len({None if fp is None else fp.digest for fp in per_rank.values()}) == 1:
        return []
    if any(fp is None for fp in per_rank.values()):
        present = {rank: fp is not None for rank, fp in per_rank.items()}
        return [("loader", grouped(present, lambda p: "present" if p else "absent"))]
    with_content = check_content is True or (
        check_content == "auto" and any(fp.sharded for fp in per_rank.values() if fp)
    )
    parts = {rank: _components(fp, with_content) for rank, fp in per_rank.items()}
    names = list(dict.fromkeys(name for p in parts.values() for name in p))
    diffs = []
    for name in names:
        values = {rank: p.get(name) for rank, p in parts.items()}
        if len(set(values.values())) > 1:
            diffs.append((name, grouped(values, partial(_describe, name))))
    if all(name == "hf fingerprint" for name, _ in diffs):
        return []
    return diffs


def rng_verdict(per_rank: Mapping[int, Mapping[str, str | None] | None]) -> str | None:
    """Warns when some global generators agree across ranks and others do not.

    Args:
        per_rank: Per rank, :func:`~rankguard.callbacks.data.fingerprint.rng_digest`.

    Returns:
        The warning, or ``None`` when every compared generator agrees, every one
        differs (per-rank seeding), or there is nothing to compare.
    """
    digests = [d for d in per_rank.values() if d is not None]
    if len(digests) < 2:
        return None
    same, differ = [], {}
    for name in digests[0]:
        values = {rank: d.get(name) for rank, d in per_rank.items() if d is not None}
        if any(v is None for v in values.values()):
            continue  # torch never seeded: its default seed is equal everywhere
        if len(set(values.values())) == 1:
            same.append(name)
        else:
            differ[name] = grouped(values, lambda h: f"state {h}")
    if not same or not differ:
        return None
    details = "; ".join(f"{name}: {desc}" for name, desc in differ.items())
    return (
        f"{' and '.join(differ)} {'was' if len(differ) == 1 else 'were'} not seeded the same "
        f"on every rank, while {' and '.join(same)} {'was' if len(same) == 1 else 'were'} "
        f"({details}). Data code that shuffles or splits with {' or '.join(differ)} gives "
        "each rank different data. Fix: seed every generator with the same value on every "
        "rank (`random.seed(s); numpy.random.seed(s); torch.manual_seed(s)`); if per-rank "
        "streams are intended, seed all of them per rank. If code that runs on some ranks "
        "only draws from them before fit start, this is expected: set `check_rng=False`."
    )


def compare_data(
    per_rank: Mapping[int, Mapping[str, Any]],
    check_content: bool | str = "auto",
    data_parallel_size: int | None = None,
) -> DataVerdict:
    """The exchange's ``decide``: per rank ``{"loaders": {name: fingerprint}, "rng": digest}``.

    With ``"shards"`` (per rank, the train loader's name and :class:`ShardFacts`), also
    whether the train data is sharded (``sharding.sharding_problems``).
    """
    names = sorted({name for payload in per_rank.values() for name in payload["loaders"]})
    loaders = {}
    for name in names:
        fps = {rank: payload["loaders"].get(name) for rank, payload in per_rank.items()}
        diffs = compare_loader(fps, check_content)
        if diffs:
            loaders[name] = diffs
    rng = rng_verdict({rank: payload.get("rng") for rank, payload in per_rank.items()})
    unsharded: list[str] = []
    shards = {rank: payload.get("shards") for rank, payload in per_rank.items()}
    if all(shard is not None for shard in shards.values()):
        name = next(iter(shards.values()))[0]
        fps = {rank: payload["loaders"].get(name) for rank, payload in per_rank.items()}
        same = len({fp.digest if fp else None for fp in fps.values()}) == 1
        read = all(fp is not None and fp.content is not None for fp in fps.values())
        facts = {rank: shard[1] for rank, shard in shards.items()}
        unsharded = sharding_problems(facts, same and read, data_parallel_size)
    return DataVerdict(loaders=loaders, rng=rng, unsharded=unsharded)


def _fixes(components: set[str]) -> str:
    fixes = []
    if "loader" in components:
        fixes.append(FIX_LOADERS)
    if components & {"length", "content", "dataset type", "hf fingerprint"}:
        fixes.append(FIX_SPLIT)
    if "sampler seed" in components:
        fixes.append(FIX_SAMPLER_SEED)
    if "sampler settings" in components:
        fixes.append(FIX_SAMPLER)
    if any(c.startswith("streaming ") for c in components):
        fixes.append(FIX_STREAMING)
    return " ".join(fixes)


class DataConsistencyGuard(Guard):
    """Checks that every rank sees the same dataset, split and sampler configuration.

    Args:
        on_violation: ``"raise"`` (default) or ``"warn"``.
        sample_items: Items read with ``dataset[i]`` per map-style dataset (>= 0;
            0 compares length and configuration only). Cost is ``sample_items``
            item reads, whatever the dataset's length.
        check_content: Compare dataset length and sampled content: ``"auto"``
            (default) when the loader splits the dataset between ranks with a
            distributed sampler (``DistributedSampler``, Lightning's default, any
            sampler with ``num_replicas``, or Accelerate's with ``num_processes``,
            as the Hugging Face Trainer's), which assumes every rank holds the
            same dataset; ``True`` always; ``False`` never (each rank loads its
            own shard on purpose).
        check_rng: Warn once at fit start when, of python ``random``, numpy and
            torch, some have the same state on every rank and others do not.
            python ``random`` and numpy are compared by state, so code that draws
            from them on some ranks only before fit start looks unseeded; torch
            is compared by ``torch.initial_seed()``.
        check_sharding: Check that ranks read different parts of the train data: at
            fit start from the loaders' facts (a distributed sampler whose
            ``num_replicas`` is not the data-parallel size, or that gives ranks the
            same share; a map-style DataLoader without one over the same dataset on
            every rank), then from prints of the first ``BATCHES_COMPARED`` train
            batches, exchanged once (ranks with the same batches are a violation;
            ranks whose samples overlap, a warning).
        data_parallel_size: The job's data-parallel size (ranks that read different
            data); ``world_size // data_parallel_size`` ranks may read the same data
            (model-parallel ranks of one replica). ``None`` (default): the world size,
            or the size a loader that shards itself declares (OLMo-core's).

    Raises:
        ValueError: A setting out of range.
        DataInconsistencyError: Ranks hold different datasets or samplers
            (``on_violation="raise"``).

    Example::

        guard = DataConsistencyGuard(on_violation="raise", sample_items=16)
    """

    name = "data_consistency_guard"

    def __init__(
        self,
        *,
        on_violation: str = "raise",
        sample_items: int = 16,
        check_content: bool | str = "auto",
        check_rng: bool = True,
        check_sharding: bool = True,
        data_parallel_size: int | None = None,
    ) -> None:
        super().__init__(on_violation=on_violation)
        self.sample_items = check_int("sample_items", sample_items, 0)
        self.check_content = check_choice("check_content", check_content, (True, False, "auto"))
        self.check_rng = bool(check_rng)
        self.check_sharding = check_choice("check_sharding", check_sharding, (True, False))
        self.data_parallel_size = (
            None
            if data_parallel_size is None
            else check_int("data_parallel_size", data_parallel_size)
        )
        self._prints: list[tuple[str, list[int]]] = []
        self._exchange: BackgroundExchange | None = None
        self._pending: Pending | None = None

    def on_fit_start(self, facts: EventFacts) -> None:
        """Compares every known loader's fingerprint, and the generators' seeding."""
        self.close()
        self._prints = []
        train = next((lf for lf in facts.loaders if lf.is_train), None)
        proven = self._check(
            "fit_start", facts.loaders, "at fit start", with_rng=self.check_rng, train=train
        )
        if self.check_sharding and train is not None and self.channel.is_distributed and not proven:
            self.steps.batch_probe = self._probe
            self.due = BATCHES_COMPARED + 1

    def _probe(self, batch: Any) -> None:
        """Prints one of the first train batches; after the last, posts the exchange."""
        try:
            self._prints.append(batch_prints(batch))
        except Exception as exc:  # a batch it cannot read: every rank still posts
            logger.debug("rankguard: could not print a train batch: %r", exc)
            self._prints.append(("", []))
        if len(self._prints) < BATCHES_COMPARED:
            return
        self.steps.batch_probe = None
        prints = BatchPrints(
            tuple(d for d, _ in self._prints), tuple(s for _, ss in self._prints for s in ss)
        )
        decide = partial(duplicated_batches, data_parallel_size=self.data_parallel_size)
        self._exchange = BackgroundExchange(self.channel, f"{self.name}/first_batches", decide)
        self._pending = self._exchange.post(lambda: prints)

    def on_due(self, batches: int) -> None:
        """Acts on the first batches' verdict (at the first batch it is in)."""
        if self.verdict_late(self._pending, batches):
            self.due = batches + 1
            return
        self.due = math.inf
        pending, self._pending = self._pending, None
        if pending is None:  # the adapter gave no batches (or fewer than compared)
            return
        try:
            problem = pending.result(self.channel.timeout_s)
        except Exception as exc:  # never turn a healthy run into a failed one
            self.warn_once("first_batches", "could not compare the first train batches: %s", exc)
            return
        finally:
            self._close_exchange()
        if problem is None:
            return
        message = describe_unsharded([problem], f"the first {BATCHES_COMPARED} train batches")
        if "the same first" in problem:
            self.violation(DataInconsistencyError(message))
        else:
            self.warn_once("overlap", message)

    def on_fit_end(self, facts: EventFacts) -> None:
        """Acts on the first batches' verdict if the fit ended before the batch after them."""
        if self._pending is not None:
            self.on_due(self.steps.batches)

    def close(self) -> None:
        """Stops reading train batches; safe to call twice, after an error."""
        if self.steps.batch_probe == self._probe:
            self.steps.batch_probe = None
        self._pending = None
        self.due = math.inf
        self._close_exchange()

    def _close_exchange(self) -> None:
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.close()

    def on_eval_start(self, facts: EventFacts) -> None:
        """Compares the eval loader's fingerprint before its first batch."""
        if facts.loader is not None:
            where = f"eval_start/{facts.loader.name}"
            self._check(where, [facts.loader], "before the first eval batch", with_rng=False)

    def _check(
        self,
        where: str,
        loaders: list[LoaderFacts],
        when: str,
        with_rng: bool,
        train: LoaderFacts | None = None,
    ) -> bool:
        """One exchange of fingerprints; returns whether unsharded data was proven."""
        if not self.channel.is_distributed or not (loaders or with_rng):
            return False
        payload: dict[str, Any] = {
            "rng": rng_digest() if with_rng else None,
            "loaders": {lf.name: self._fingerprint(lf) for lf in loaders},
        }
        if self.check_sharding and train is not None:
            payload["shards"] = (train.name, self._shard_facts(train))
        decide = partial(
            compare_data,
            check_content=self.check_content,
            data_parallel_size=self.data_parallel_size,
        )
        verdict: DataVerdict = self.channel.exchange(f"{self.name}/{where}", payload, decide)
        if verdict.rng:
            self.warn_once("rng", verdict.rng)
        if verdict.loaders:
            self.violation(DataInconsistencyError(describe_verdict(verdict, when)))
        if verdict.unsharded:
            self.violation(DataInconsistencyError(describe_unsharded(verdict.unsharded, when)))
        return bool(verdict.unsharded)

    @staticmethod
    def _shard_facts(facts: LoaderFacts) -> ShardFacts | None:
        try:
            return shard_facts(facts.loader)
        except Exception as exc:  # never leave the others waiting in the exchange
            logger.debug("rankguard: reading how loader %r shards failed: %r", facts.name, exc)
            return None

    def _fingerprint(self, facts: LoaderFacts) -> DatasetFingerprint:
        # A rank that raised here would leave the others waiting in the exchange.
        try:
            return fingerprint_loader(facts.loader, self.sample_items)
        except Exception as exc:
            logger.debug("rankguard: fingerprinting loader %r failed: %r", facts.name, exc)
            return DatasetFingerprint(dataset_type=type(facts.loader).__name__)


def describe_verdict(verdict: DataVerdict, when: str) -> str:
    """The error message for a verdict with differing loaders."""
    lines = []
    components: set[str] = set()
    for name, diffs in verdict.loaders.items():
        components |= {c for c, _ in diffs}
        parts = "; ".join(f"{c} differs ({desc})" for c, desc in diffs)
        lines.append(f"loader {name!r}: {parts}")
    return f"Ranks see different data ({when}): {' | '.join(lines)}. {_fixes(components)}"
