"""Compact, deterministic descriptions of rank sets and per-rank values.

A message about 1024 ranks in two groups must stay two lines long:
``"ranks 0-511: 2 batches; ranks 512-1023: 3 batches"``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

__all__ = [
    "MAX_RUNS",
    "RankSet",
    "format_groups",
    "format_ranks",
    "group_ranks",
    "rank_label",
    "rank_runs",
]

V = TypeVar("V", bound=Hashable)

#: Runs a description of ranks shows at most: a verdict that names ranks scattered over a
#: world of 16,384 (every odd rank, say) stays a line, not 60 KB that every rank reads.
MAX_RUNS = 16


def format_ranks(ranks: Iterable[int]) -> str:
    """Formats a set of ranks as comma-separated runs, e.g. ``"0-3,6,8-9"``.

    At most :data:`MAX_RUNS` runs are written; the others are counted:
    ``"0,2,4,...,30 and 8,176 more (8,192 in all)"`` (without the dots).

    Args:
        ranks: Ranks in any order; duplicates are ignored.

    Returns:
        The runs, ascending. An empty input gives ``""``.
    """
    ordered = sorted(set(ranks))
    runs: list[str] = []
    start = prev = None
    for rank in ordered:
        if start is None:
            start = prev = rank
        elif rank == prev + 1:
            prev = rank
        else:
            runs.append(_run(start, prev))
            start = prev = rank
    if start is not None:
        runs.append(_run(start, prev))
    if len(runs) <= MAX_RUNS:
        return ",".join(runs)
    shown = runs[:MAX_RUNS]
    count = sum(_size(run) for run in shown)
    return f"{','.join(shown)} and {len(ordered) - count:,} more ({len(ordered):,} in all)"


def _size(run: str) -> int:
    """How many ranks a run written by :func:`_run` holds."""
    if "-" in run:
        first, last = run.split("-")
        return int(last) - int(first) + 1
    return run.count(",") + 1


def rank_runs(ranks: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Ranks as sorted ``(first, last)`` runs: ``[0, 1, 2, 5]`` is ``((0, 2), (5, 5))``."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return tuple(runs)


def _from_runs(runs: Iterable[tuple[int, int]]) -> RankSet:
    return RankSet(r for first, last in runs for r in range(first, last + 1))


class RankSet(frozenset):
    """A frozenset of ranks that travels as its runs: ``{0, ..., 16383}`` pickles in a few bytes.

    A verdict every rank reads that holds a set of ranks (those that kept up, those
    missing) would otherwise grow with the world size, and each exchange with its square.
    """

    def __reduce__(self) -> tuple:
        return (_from_runs, (rank_runs(self),))


def _run(start: int, end: int) -> str:
    if start == end:
        return str(start)
    if end == start + 1:
        return f"{start},{end}"
    return f"{start}-{end}"


def rank_label(ranks: Iterable[int]) -> str:
    """Returns ``"rank 3"`` or ``"ranks 0-2,5"`` for a set of ranks."""
    ordered = sorted(set(ranks))
    word = "rank" if len(ordered) == 1 else "ranks"
    return f"{word} {format_ranks(ordered)}"


def group_ranks(values: Mapping[int, V]) -> list[tuple[list[int], V]]:
    """Groups ranks by equal value.

    Args:
        values: Value per rank.

    Returns:
        ``(ranks, value)`` pairs, largest group first, ties broken by the
        lowest rank, so the output is the same on every rank.
    """
    groups: dict[V, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(values[rank], []).append(rank)
    return sorted(((r, v) for v, r in groups.items()), key=lambda g: (-len(g[0]), g[0][0]))


def format_groups(
    values: Mapping[int, V], describe: Callable[[V], str] = str, *, sep: str = "; "
) -> str:
    """Describes per-rank values grouped by equal value.

    Args:
        values: Value per rank.
        describe: Renders one value, e.g. ``lambda n: f"{n} batches"``.
        sep: Separator between groups.

    Returns:
        For example ``"ranks 0,2: 2 batches; ranks 1,3: 4 batches"``.
    """
    return sep.join(
        f"{rank_label(ranks)}: {describe(value)}" for ranks, value in group_ranks(values)
    )
