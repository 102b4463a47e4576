"""Straggler scores: pure functions from every rank's interval times to one verdict.

Each rank sends its :class:`RankTimes` for the interval; the deciding rank
applies :func:`straggler_verdict` (rank, node and own scores, noise judged on
the gap, at most :data:`MAX_LISTED` named). See docs/straggler.md#scores.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rankguard.callbacks.core.ranks import rank_label

__all__ = [
    "MAX_LISTED",
    "RankTimes",
    "Slow",
    "StragglerVerdict",
    "advance_streaks",
    "describe_straggler",
    "is_slow",
    "straggler_verdict",
]

#: Slow ranks and nodes listed in one verdict, at most (the slowest first).
MAX_LISTED = 16

CHECK_RANK = (
    "Check that rank's device and host: GPU clocks and throttling reasons "
    "(`nvidia-smi -q -d PERFORMANCE,CLOCK`), temperature and power, ECC or Xid errors "
    "(`dmesg`), other processes on its GPU or CPU cores, its CPU affinity and frequency "
    "governor; if it stays slow, leave that GPU or node out of the job's host list."
)
CHECK_NODE = (
    "Check that node: other jobs or processes on it (a noisy neighbour: `top`, "
    "`nvidia-smi`), its GPUs' clocks and throttling reasons "
    "(`nvidia-smi -q -d PERFORMANCE,CLOCK`), its CPU frequency and NUMA binding, the "
    "data-loader workers competing for its cores; if it stays slow, leave it out of the "
    "job's host list."
)


@dataclass(frozen=True)
class RankTimes:
    """One rank's times over one interval (medians over its measured steps, seconds).

    Attributes:
        node: The node the rank runs on (hostname, plus ``/node<NODE_RANK>`` when set).
        steps: Train batches measured in the interval.
        forward_s: Time in the model's forward pass per batch: its own compute.
        rest_s: The rest of the batch: backward, optimizer step and waiting at
            collectives for other ranks.
        between_s: From one batch's end to the next one's start (loading data,
            callbacks), or ``None`` when no measured batch had a batch before it.
        baseline_s: This rank's forward time in its first scored intervals, or
            ``None`` until known.
    """

    node: str
    steps: int
    forward_s: float
    rest_s: float
    between_s: float | None = None
    baseline_s: float | None = None

    @property
    def own_score(self) -> float | None:
        """Baseline forward time / forward time now (1.0 = as fast as it was)."""
        if self.baseline_s is None or self.forward_s <= 0:
            return None
        return self.baseline_s / self.forward_s


@dataclass(frozen=True)
class Slow:
    """A rank or node below the threshold in one interval.

    Attributes:
        kind: ``"rank"`` or ``"node"``.
        key: The rank (as a string) or the node's name.
        ranks: Its global ranks.
        score: Its score against the median rank (or node).
        own_score: A rank's score against its own baseline (``None`` for a node
            or before the baseline is known).
        times: Its times (a node's: those of its rank with the median forward time).
    """

    kind: str
    key: str
    ranks: tuple[int, ...]
    score: float
    own_score: float | None
    times: RankTimes

    @property
    def label(self) -> str:
        """``"rank 3 (node gpu-1)"`` or ``"node gpu-1 (ranks 0-7)"``."""
        if self.kind == "node":
            return f"node {self.key} ({rank_label(self.ranks)})"
        return f"rank {self.key} (node {self.times.node})"


@dataclass(frozen=True)
class StragglerVerdict:
    """One interval's cross-rank summary, the same on every rank.

    Attributes:
        steps: The most train batches any rank measured in the interval.
        scored: Whether scores were computed (some rank measured a step with a
            forward, and the median forward time reached the deprecated
            ``min_forward_s``, 0 unless set).
        reference: The times of the median rank: the rank whose forward time is the
            median (the lower middle one, with an even number of ranks).
        score_min: The lowest rank score.
        slowest_rank: The rank with it (-1 when not scored).
        nodes: Nodes that measured a step.
        node_score_min: The lowest node score (``None`` with fewer than 2 nodes).
        slowest_node: The index of that node, nodes ordered by their lowest rank.
        slow: The ranks and nodes below the threshold, slowest first (at most
            :data:`MAX_LISTED`); a slow node's own slow ranks are not listed again.
    """

    steps: int = 0
    scored: bool = False
    reference: RankTimes | None = None
    score_min: float = 1.0
    slowest_rank: int = -1
    nodes: int = 0
    node_score_min: float | None = None
    slowest_node: int | None = None
    slow: tuple[Slow, ...] = ()


def _median_rank(measured: Mapping[int, RankTimes]) -> RankTimes:
    """The times of the rank with the median forward time (the lower middle one)."""
    ranks = sorted(measured, key=lambda r: (measured[r].forward_s, r))
    return measured[ranks[(len(ranks) - 1) // 2]]


def is_slow(
    score: float, forward_s: float, against_s: float, *, threshold: float, min_excess_s: float
) -> bool:
    """Whether a score marks a rank or node slow: below ``threshold`` and not noise.

    Args:
        score: ``against_s / forward_s``.
        forward_s: Its forward time per batch (seconds).
        against_s: The forward time it is scored against: the median rank's or
            node's, or its own baseline.
        threshold: Scores below it are slow, in (0, 1).
        min_excess_s: The least excess of ``forward_s`` over ``against_s``
            (seconds per batch) that is not scheduling noise.
    """
    return score < threshold and forward_s - against_s >= min_excess_s


def straggler_verdict(
    per_rank: Mapping[int, RankTimes],
    *,
    threshold: float,
    min_excess_s: float,
    min_forward_s: float = 0.0,
) -> StragglerVerdict:
    """Scores every rank and node for one interval (runs on the deciding rank).

    Args:
        per_rank: Each rank's times.
        threshold: Scores below it are slow, in (0, 1).
        min_excess_s: A score below ``threshold`` marks a rank or node slow only
            when its forward time exceeds the one it is scored against by at
            least this much (seconds per batch): smaller gaps are scheduling noise.
        min_forward_s: Deprecated: below this median forward time (seconds)
            nothing is scored. 0 (default) scores every interval.

    Returns:
        The verdict.
    """
    steps = max((t.steps for t in per_rank.values()), default=0)
    measured = {r: t for r, t in sorted(per_rank.items()) if t.steps > 0 and t.forward_s > 0}
    if not measured:
        return StragglerVerdict(steps=steps)
    reference = _median_rank(measured)
    forward = reference.forward_s
    if forward < min_forward_s:  # deprecated floor on the reference's own time
        return StragglerVerdict(steps=steps, reference=reference)
    if len(measured) == 1:  # nobody to compare with (world size 1)
        [rank] = measured
        return StragglerVerdict(steps, True, reference, 1.0, rank, nodes=1)
    scores = {r: forward / t.forward_s for r, t in measured.items()}
    slowest = min(scores, key=lambda r: (scores[r], r))
    own = {r: s for r, t in measured.items() if (s := t.own_score) is not None}
    job_own = statistics.median_high(own.values()) if own else None

    by_node: dict[str, list[int]] = {}
    for rank, times in measured.items():
        by_node.setdefault(times.node, []).append(rank)
    node_rows = sorted(by_node.items(), key=lambda item: item[1][0])
    slow: list[Slow] = []
    node_min: float | None = None
    slowest_node: int | None = None
    absorbed: set[int] = set()
    if len(node_rows) >= 2:
        node_times = {
            name: _median_rank({r: measured[r] for r in ranks}) for name, ranks in node_rows
        }
        node_forward = _median_rank(dict(enumerate(node_times.values()))).forward_s
        node_scores = {name: node_forward / t.forward_s for name, t in node_times.items()}
        slowest_node, (node_name, _) = min(
            enumerate(node_rows), key=lambda item: (node_scores[item[1][0]], item[0])
        )
        node_min = node_scores[node_name]
        for name, ranks in node_rows:
            if is_slow(
                node_scores[name],
                node_times[name].forward_s,
                node_forward,
                threshold=threshold,
                min_excess_s=min_excess_s,
            ):
                slow.append(
                    Slow("node", name, tuple(ranks), node_scores[name], None, node_times[name])
                )
                absorbed.update(ranks)
    for rank, score in scores.items():
        times = measured[rank]
        own_score = own.get(rank)
        degraded = (
            own_score is not None
            and times.baseline_s is not None
            and is_slow(
                own_score,
                times.forward_s,
                times.baseline_s,
                threshold=threshold,
                min_excess_s=min_excess_s,
            )
            and job_own is not None
            and job_own >= threshold
        )
        behind = is_slow(
            score, times.forward_s, forward, threshold=threshold, min_excess_s=min_excess_s
        )
        if rank not in absorbed and (behind or degraded):
            slow.append(Slow("rank", str(rank), (rank,), score, own_score, times))
    slow.sort(key=lambda s: (min(s.score, s.own_score or math.inf), s.ranks[0]))
    return StragglerVerdict(
        steps=steps,
        scored=True,
        reference=reference,
        score_min=scores[slowest],
        slowest_rank=slowest,
        nodes=len(node_rows),
        node_score_min=node_min,
        slowest_node=slowest_node,
        slow=tuple(slow[:MAX_LISTED]),
    )


def advance_streaks(
    streaks: Mapping[tuple[str, str], int], slow: Iterable[Slow], window: int
) -> tuple[dict[tuple[str, str], int], list[Slow]]:
    """Counts each rank's and node's consecutive slow intervals after one more verdict.

    Args:
        streaks: Consecutive slow intervals so far, per ``(kind, key)``.
        slow: The verdict's slow ranks and nodes.
        window: Slow intervals in a row that get one named.

    Returns:
        The new counts (one that was not slow this interval starts again from
        0) and the ranks and nodes that reached ``window`` with this verdict:
        named once, and again only after they recovered.
    """
    now = {(s.kind, s.key): s for s in slow}
    counts = {key: streaks.get(key, 0) + 1 for key in now}
    return counts, [now[key] for key, count in counts.items() if count == window]


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{1000 * seconds:.1f} ms"


def describe_straggler(
    slow: Slow, reference: RankTimes, *, threshold: float, window: int, interval: int
) -> str:
    """The warning or error message for one rank or node slow for ``window`` intervals."""
    times = slow.times
    who = "its ranks' median" if slow.kind == "node" else "its"
    against = "the median node's" if slow.kind == "node" else "the median rank's"
    parts = [
        f"Straggler: {slow.label} has been slow for {window} intervals of {interval} train "
        f"batches in a row."
    ]
    if slow.score < threshold:
        parts.append(
            f"It is slow at compute: {who} forward pass takes {_ms(times.forward_s)} per batch, "
            f"{against} {_ms(reference.forward_s)} (score {slow.score:.2f} < threshold "
            f"{threshold:g})."
        )
    if slow.own_score is not None and slow.own_score < threshold and slow.score >= threshold:
        parts.append(
            f"It is slower than it was: its forward pass takes {_ms(times.forward_s)} per "
            f"batch, {_ms(times.baseline_s)} in its first measured intervals (own score "
            f"{slow.own_score:.2f} < threshold {threshold:g}), while the other ranks kept "
            "their speed."
        )
    if reference.rest_s > times.rest_s:
        parts.append(
            "The others wait for it at the collectives: the rest of the median rank's batch "
            f"(backward, optimizer step, waiting for other ranks) takes {_ms(reference.rest_s)}, "
            f"{'its' if slow.kind == 'rank' else 'its ranks'} {_ms(times.rest_s)}."
        )
    if (
        times.between_s is not None
        and reference.between_s is not None
        and times.between_s > reference.between_s / threshold
        and times.between_s - reference.between_s > 0.1 * reference.forward_s
    ):
        parts.append(
            f"It also takes longer between batches ({_ms(times.between_s)} against "
            f"{_ms(reference.between_s)}: loading data, callbacks); DataStallMonitor "
            "(rankguard/data_wait_*) says whether it waits for data."
        )
    parts.append("The whole job runs at its pace.")
    parts.append(CHECK_NODE if slow.kind == "node" else CHECK_RANK)
    return " ".join(parts)
