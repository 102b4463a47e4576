"""What a rank's data wait says: per-interval totals, the cross-rank stall verdict, its words.

Pure values; :class:`~rankguard.callbacks.data.data_stall_monitor.DataStallMonitor` measures.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from rankguard.callbacks.core.ranks import RankSet, rank_label

__all__ = [
    "FIX",
    "IntervalStats",
    "StallVerdict",
    "describe_raise",
    "describe_stall",
    "is_stalled",
    "stall_verdict",
]

FIX = (
    "Fix: make data loading faster than a training step: raise the DataLoader's "
    "num_workers and prefetch_factor, set persistent_workers=True (no worker restart per "
    "epoch) and pin_memory=True; read from local disk or same-region storage; for "
    "streaming data, raise predownload and cache_limit and keep the local cache on fast disk."
)

#: Measured steps below which the early verdicts name no rank (a step is measured
#: from one train batch's start to the next: batch 3's start closes the second).
EARLY_MIN_STEPS = 2
#: Wait per batch under which an early verdict names no rank. Over a fit's first steps a
#: wait of a few milliseconds can be most of a short step (workers starting, the first
#: batches' page faults) and starves nothing, and a busy host's scheduler alone can hold a
#: loader's return for tens of milliseconds (seen: 30 ms in two steps in a row, of a
#: healthy 2-rank job on a twice-loaded machine). An early verdict reads two steps, so it
#: names only waits above that noise; the starved loaders it is for wait tenths of a second
#: per batch. Later verdicts, after ``window`` slow steps in a row, have no floor.
EARLY_MIN_WAIT_S = 0.05


@dataclass(frozen=True)
class IntervalStats:
    """One rank's data-wait totals since the last exchange.

    Attributes:
        wait_s: Seconds spent waiting for batches.
        step_s: Seconds of measured steps (train batch start to the next).
        steps: Measured steps.
        longest_run: Longest run of consecutive slow steps (carried over exchanges).
        batch_size: Samples per batch, if known.
        fit_steps: Measured steps since the fit's start.
        fit_slow: Slow steps among them.
    """

    wait_s: float
    step_s: float
    steps: int
    longest_run: int
    batch_size: int | None = None
    fit_steps: int = 0
    fit_slow: int = 0

    @property
    def wait_per_batch(self) -> float:
        """Mean wait per measured step of the interval (0.0 before any)."""
        return self.wait_s / self.steps if self.steps else 0.0

    @property
    def fraction(self) -> float | None:
        """Wait time over step time, or ``None`` before any measured step."""
        return self.wait_s / self.step_s if self.step_s > 0 else None

    def throughput(self) -> str:
        """Samples/s when the batch size is known, else batches/s."""
        if self.step_s <= 0:
            return "unknown throughput"
        rate = self.steps / self.step_s
        if self.batch_size:
            return f"{rate * self.batch_size:.1f} samples/s"
        return f"{rate:.2f} batches/s"


#: Stalled ranks a verdict carries the statistics of, and a message details: those that waited
#: longest per batch. The others are counted (every rank reads the verdict, and where every
#: rank's loader starves, as where all share one short configuration, it would otherwise grow
#: with the world size: 221 KB read by each of 4,096 ranks, a warning of 491,000 characters).
MAX_DETAILED = 3


@dataclass(frozen=True)
class StallVerdict:
    """Cross-rank summary of one interval, the same on every rank.

    Its size does not grow with the world size: ranks travel as runs, and statistics
    for at most :data:`MAX_DETAILED` ranks.

    Attributes:
        fraction_max: The largest wait fraction of any rank (0.0 if none measured).
        slowest_rank: The rank with that fraction (-1 if none measured).
        stalled: The stalled ranks (a :class:`RankSet`).
        detailed: The interval statistics of the stalled ranks that waited longest per
            batch, at most :data:`MAX_DETAILED`, by rank.
        recovered: The ranks that are not stalled and waited at most ``threshold``
            of their measured step time (a :class:`RankSet`: every rank reads it, as runs).
        others_wait_s: The median wait per batch of the ranks not stalled (of every
            rank where all are), over the interval.
        stalled_wait_s: The median wait per batch of the stalled ranks.
        early: Every stalled rank was judged on the fit's first steps (fewer than ``window``).
        world: The ranks that took part.
    """

    fraction_max: float = 0.0
    slowest_rank: int = -1
    stalled: RankSet = field(default_factory=RankSet)
    detailed: dict[int, IntervalStats] = field(default_factory=dict)
    recovered: frozenset[int] = frozenset()
    others_wait_s: float = 0.0
    stalled_wait_s: float = 0.0
    early: bool = False
    world: int = 0

    @property
    def undetailed(self) -> int:
        """How many stalled ranks the verdict counts without their statistics."""
        return len(self.stalled) - len(self.detailed)


def stall_verdict(
    per_rank: Mapping[int, IntervalStats], window: int, threshold: float
) -> StallVerdict:
    """Finds the slowest rank, the stalled ranks and the ranks that kept up.

    A rank is stalled when its longest run of slow steps reached ``window``, or,
    while fewer than ``window`` steps of the fit were measured (the early
    verdicts, :data:`EARLY_POSTS`), when most of its steps so far were slow.

    Args:
        per_rank: Every rank's statistics of the interval.
        window: Consecutive slow steps that make a stall.
        threshold: Wait fraction at or under which a rank that is not stalled kept up.

    Returns:
        The verdict, the same on every rank.
    """
    measured = {r: s.fraction for r, s in per_rank.items() if s.fraction is not None}
    slowest = max(sorted(measured), key=lambda r: measured[r], default=-1)
    stalled = {r: s for r, s in sorted(per_rank.items()) if is_stalled(s, window)}
    longest = sorted(stalled, key=lambda r: (-stalled[r].wait_per_batch, r))[:MAX_DETAILED]
    recovered = RankSet(r for r, f in measured.items() if f <= threshold and r not in stalled)
    others = [s.wait_per_batch for r, s in per_rank.items() if r not in stalled and s.steps]
    others = others or [s.wait_per_batch for s in per_rank.values() if s.steps]
    return StallVerdict(
        fraction_max=measured.get(slowest, 0.0),
        slowest_rank=slowest,
        stalled=RankSet(stalled),
        detailed={r: stalled[r] for r in sorted(longest)},
        recovered=recovered,
        others_wait_s=statistics.median(others) if others else 0.0,
        stalled_wait_s=statistics.median(s.wait_per_batch for s in stalled.values())
        if stalled
        else 0.0,
        early=bool(stalled) and all(s.fit_steps < window for s in stalled.values()),
        world=len(per_rank),
    )


def is_stalled(stats: IntervalStats, window: int) -> bool:
    """``window`` slow steps in a row; or, early in a fit, most of the steps so far slow.

    Early, the rank must also wait at least :data:`EARLY_MIN_WAIT_S` per batch.
    """
    if stats.longest_run >= window:
        return True
    early = EARLY_MIN_STEPS <= stats.fit_steps < window
    waits = stats.wait_per_batch >= EARLY_MIN_WAIT_S
    return early and waits and 2 * stats.fit_slow > stats.fit_steps


def _rest(verdict: StallVerdict) -> str:
    """The stalled ranks a message does not detail, counted (``""`` where there are none)."""
    rest = verdict.undetailed
    if rest <= 0:
        return ""
    return (
        f"; {rest:,} more stalled rank{'s' if rest > 1 else ''} "
        f"(all stalled ranks: a median {verdict.stalled_wait_s:.2f} s per batch)"
    )


def describe_stall(verdict: StallVerdict, threshold: float, window: int) -> str:
    """The warning or error message for the verdict's stalled ranks.

    Every rank's loader starving (a world of more than one) is said so: no other rank
    is waiting for them, the loaders all are short.
    """
    details = "; ".join(
        f"rank {r}: waited {s.fraction or 0.0:.0%} of step time, {s.wait_per_batch:.2f} s per "
        f"batch, {s.longest_run} slow steps in a row"
        + (f" ({s.fit_slow} of the fit's first {s.fit_steps})" if s.fit_steps < window else "")
        + f", {s.throughput()}"
        for r, s in verdict.detailed.items()
    )
    everyone = verdict.world > 1 and len(verdict.stalled) == verdict.world
    how = (
        "in most of the fit's first steps"
        if verdict.early
        else f"for at least {window} consecutive steps"
    )
    if everyone:
        where = f"every rank ({rank_label(verdict.stalled)})"
        others = ""
        effect = "no rank waits for another: every rank's own loader is short."
    else:
        where = rank_label(verdict.stalled)
        others = f"; other ranks {verdict.others_wait_s:.2f} s per batch"
        them = "it" if len(verdict.stalled) == 1 else "them"
        effect = f"in a multi-rank job every other rank waits for {them} at each collective."
    return (
        f"Data loading cannot keep up on {where}: waited for the next batch "
        f"more than {threshold:.0%} of step time {how} ({details}{_rest(verdict)}{others}); "
        f"{effect} {FIX}"
    )


def describe_raise(
    rank: int, batch: int, own: IntervalStats, others_wait_s: float | None, seen_at: int | None
) -> str:
    """What rankguard measured before a rank's loader raised (``own``: its fit totals)."""
    others = (
        "no exchange with the other ranks yet"
        if others_wait_s is None
        else f"other ranks {others_wait_s:.2f} s at the exchange of batch {seen_at}"
    )
    measured = (
        f"after waiting {own.fraction or 0.0:.0%} of its step time in {own.steps} measured "
        f"steps ({own.wait_per_batch:.2f} s per batch, {own.fit_slow} steps slow; {others})"
        if own.steps
        else f"before a step was measured ({others})"
    )
    return (
        f"rank {rank}'s loader raised at batch {batch} {measured}. A loader that waits most "
        f"of each step for data is starved: the error above is its failure. {FIX}"
    )
