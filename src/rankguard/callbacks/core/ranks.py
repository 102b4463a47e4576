"""Compact, deterministic descriptions of rank sets and per-rank values.

A message about 1024 ranks in two groups must stay two lines long:
``"ranks 0-511: 2 batches; ranks 512-1023: 3 batches"``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TypeVar

__all__ = ["format_groups", "format_ranks", "group_ranks", "rank_label"]

V = TypeVar("V", bound=Hashable)


def format_ranks(ranks: Iterable[int]) -> str:
    """Formats a set of ranks as comma-separated runs, e.g. ``"0-3,6,8-9"``.

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
    return ",".join(runs)


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
