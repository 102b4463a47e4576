"""Metric names that feed one reduction, compared across ranks before it runs.

A framework that reduces many metrics with one collective sizes its tensor
by the names each rank recorded: OLMo-core's metric flush stacks, per step,
every metric recorded with a reduce type and all-reduces the lot. When one
rank recorded a name the others did not (a callback's debug metric, a
metric recorded when an asynchronous save ends), the tensors differ: gloo
aborts the process a second later, NCCL hangs or reduces the wrong numbers.

:func:`reduction_rows` describes what a rank is about to reduce,
:func:`first_difference` and :func:`describe` are the pure decision and its
words, and :class:`ReductionCheck` compares the ranks' rows through the side
channel (never a collective) on the thread about to issue the reduction.
See docs/hang.md#metric-names-checked-before-their-reduction.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, NoReturn

from rankguard.callbacks.core.errors import MetricMismatchError
from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.core.side_channel import SideChannel

__all__ = [
    "CHANGE_WARN_AFTER_S",
    "ReductionCheck",
    "Row",
    "RowDifference",
    "Rows",
    "describe",
    "digest",
    "first_difference",
    "reduction_rows",
]

logger = logging.getLogger(__name__)

#: How long a rank whose names changed waits for the others' before it says so.
CHANGE_WARN_AFTER_S = 2.0


class Row(NamedTuple):
    """What one rank reduces for one step: its label and the names, sorted.

    Attributes:
        label: Where the values come from, e.g. the step (``12``).
        names: ``(name, reduce type)`` of every value reduced, sorted.
    """

    label: int
    names: tuple[tuple[str, str], ...]


Rows = tuple[Row, ...]


def _kind(reduce_type: Any) -> str:
    """A reduce type's short name: ``ReduceType.max`` and ``"max"`` both give ``"max"``."""
    return str(getattr(reduce_type, "value", reduce_type))


def reduction_rows(metrics: Mapping[int, Iterable[str]], reduce_types: Mapping[str, Any]) -> Rows:
    """The rows one flush reduces: per step (ascending), the names that have a reduce type.

    Every step is a row, even one with no reduced name: a framework that
    stacks its steps sizes the collective by their number too.

    Args:
        metrics: Names recorded per step since the last flush (none: this rank
            has nothing to reduce while others may).
        reduce_types: Reduce type per name; ``None`` (or absent) means not reduced.

    Returns:
        The rows, e.g. ``(Row(12, (("loss", "mean"), ("save_s", "max"))),)``.
    """
    rows = []
    for step in sorted(metrics):
        names = [
            (name, _kind(reduce_types[name]))
            for name in metrics[step]
            if reduce_types.get(name) is not None
        ]
        rows.append(Row(int(step), tuple(sorted(names))))
    return tuple(rows)


def digest(rows: Rows) -> bytes:
    """16 bytes that differ (but for a 2**-128 chance) where ``rows`` differ."""
    return hashlib.blake2b(repr(rows).encode(), digest_size=16).digest()


class RowDifference(NamedTuple):
    """The first step where the ranks' rows differ.

    Attributes:
        label: The step.
        rows: What each rank reduces for that step (``None``: no values of that step).
        extra: Per ``(name, reduce type)`` that only some ranks reduce there, those ranks.
        labels: Every step each rank's reduction holds.
    """

    label: int
    rows: dict[int, tuple[tuple[str, str], ...] | None]
    extra: dict[tuple[str, str], list[int]]
    labels: dict[int, tuple[int, ...]]


def first_difference(rows: Mapping[int, Rows]) -> RowDifference | None:
    """Where the ranks' reductions first differ, or ``None`` if every rank reduces the same.

    Args:
        rows: Each rank's :func:`reduction_rows`.

    Returns:
        The lowest step where the ranks' names differ (or which only some
        ranks have), with what each rank has there and which names are not
        everyone's.
    """
    if len({digest(r) for r in rows.values()}) <= 1:
        return None
    per_rank = {rank: {row.label: row.names for row in rs} for rank, rs in rows.items()}
    labels = sorted({label for steps in per_rank.values() for label in steps})
    for label in labels:
        at = {rank: steps.get(label) for rank, steps in per_rank.items()}
        if len(set(at.values())) > 1:
            everyone = len(at)
            holders: dict[tuple[str, str], list[int]] = {}
            for rank, names in sorted(at.items()):
                for name in names or ():
                    holders.setdefault(name, []).append(rank)
            extra = {n: ranks for n, ranks in sorted(holders.items()) if len(ranks) < everyone}
            steps = {rank: tuple(sorted(s)) for rank, s in per_rank.items()}
            return RowDifference(label, at, extra, steps)
    return None  # not reached: rows are sorted, so different digests differ at some step


def _steps(labels: tuple[int, ...]) -> str:
    if not labels:
        return "nothing"
    if len(labels) == 1:
        return f"step {labels[0]}"
    return f"steps {labels[0]}-{labels[-1]}"


def _values(names: tuple[tuple[str, str], ...] | None) -> str:
    count = len(names or ())
    return f"{count} value{'s' if count != 1 else ''}"


def describe(
    difference: RowDifference,
    *,
    where: str,
    fix: str,
    notes: Mapping[str, str] | None = None,
    world_size: int | None = None,
) -> str:
    """The error's words: the lead sentence, what differs per rank, the fix.

    Args:
        difference: :func:`first_difference`'s result.
        where: The reduction, e.g. ``"OLMo-core's metric flush"``.
        fix: What the user changes.
        notes: Words for names the framework itself records, keyed by name.
        world_size: Ranks taking part (for "rank 1 did not"; default: those in ``difference``).

    Returns:
        The message (lead sentence first).
    """
    step = difference.label
    everyone = set(range(world_size)) if world_size else set(difference.rows)
    what = {
        rank: (_steps(labels), _values(difference.rows[rank]))
        for rank, labels in difference.labels.items()
    }
    lines = [f"Ranks would reduce different metrics in one collective ({where}, step {step})."]
    for (name, kind), holders in difference.extra.items():
        others = sorted(everyone - set(holders))
        lines.append(
            f"  {rank_label(holders)} recorded '{name}' ({kind}) at step {step}; "
            f"{rank_label(others)} did not."
        )
    absent = sorted(r for r, names in difference.rows.items() if names is None)
    if absent and not difference.extra:
        lines.append(f"  {rank_label(absent)} recorded nothing at step {step}.")
    for group, (steps, values) in group_ranks(what):
        if steps == "nothing":
            lines.append(f"  {rank_label(group)} would reduce nothing: no collective at all.")
        else:
            lines.append(f"  {rank_label(group)} would reduce {steps}, {values} at step {step}.")
    lines.append(
        "  One collective sized by each rank's names aborts the process on gloo and hangs "
        "or reduces the wrong numbers on NCCL; rankguard stopped every rank before it."
    )
    for name, _ in difference.extra:
        if notes and name in notes:
            lines.append(f"  '{name}': {notes[name]}")
    lines.append(f"  Fix: {fix}")
    return "\n".join(lines)


def _log_and_raise(error: MetricMismatchError) -> NoReturn:
    logger.error("rankguard: %s", error)
    raise error


class ReductionCheck:
    """Compares what every rank is about to reduce, through the side channel, before it does.

    Every rank calls :meth:`check` at each reduction, in the same order (the
    framework reduces on every rank at the same steps). Each rank sends 16
    bytes; only when they differ do the ranks send their names, so the error
    can say which. One store exchange per reduction, on the thread that
    issues it: the collective that follows waits for every rank anyway.

    Args:
        channel: The side channel (a local one checks nothing).
        name: The exchange's name, e.g. ``"metric_reduction/olmo_core_flush"``.
        where: The reduction, in the message.
        fix: The message's fix.
        notes: Words for names the framework itself records.
        timeout_s: How long rank 0 waits for every rank's row digest.
        on_mismatch: Raises the error on every rank (default: logs it and raises it).
        on_names: Told this rank's names and step each time :meth:`check_changed`
            sees them change (the hang watchdog's "what split them").

    Attributes:
        checks: Reductions compared so far.
    """

    def __init__(
        self,
        channel: SideChannel,
        *,
        name: str,
        where: str,
        fix: str,
        notes: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        on_mismatch: Callable[[MetricMismatchError], NoReturn] | None = None,
        on_names: Callable[[tuple[str, ...], int], None] | None = None,
    ) -> None:
        self.channel = channel
        self.name = name
        self.where = where
        self.fix = fix
        self.notes = dict(notes or {})
        self.timeout_s = timeout_s
        self.on_mismatch = on_mismatch or _log_and_raise
        self.on_names = on_names
        self.checks = 0
        self._agreed: tuple[tuple[tuple[str, str], ...], ...] | None = None

    def same(self, value: Any) -> bool:
        """Whether every rank holds the same ``value`` (by its repr), through the side channel.

        Every rank calls it at the same points, as :meth:`check`; ``True`` on one rank.
        """
        if not self.channel.is_distributed:
            return True
        return self.channel.exchange(
            f"{self.name}/same",
            hashlib.blake2b(repr(value).encode(), digest_size=16).digest(),
            lambda digests: len(set(digests.values())) == 1,
            timeout_s=self.timeout_s,
        )

    def check(self, rows: Rows, *, compared: Any = None) -> None:
        """Returns when every rank reduces the same rows; else raises on every rank.

        Args:
            rows: What this rank is about to reduce (:func:`reduction_rows`).
            compared: What sizes the reduction where it is not ``rows`` (a
                framework that gathers the names first: its steps, say); ``rows``
                then only say, in the message, what differs.

        Raises:
            MetricMismatchError: The ranks' rows differ; the message names the
                step, the names only some ranks have, and those ranks.
            RanksMissingError: Some ranks never reached this reduction within
                ``timeout_s`` (the hang watchdog, if running, sees it first).
        """
        self.checks += 1
        if not self.channel.is_distributed:
            return
        same = self.channel.exchange(
            self.name,
            digest(rows) if compared is None else digest(compared),
            lambda digests: len(set(digests.values())) == 1,
            timeout_s=self.timeout_s,
        )
        if same:
            return
        world = self.channel.world_size
        message = self.channel.exchange(
            f"{self.name}/names",
            rows,
            lambda every: self._message(every, world),
            timeout_s=self.timeout_s,
        )
        self.on_mismatch(MetricMismatchError(message))

    def _message(self, rows: Mapping[int, Rows], world_size: int) -> str:
        difference = first_difference(rows)
        if difference is None:  # digests differ, rows agree: cannot be, but say so
            return f"Ranks' metric digests differ at {self.where} while their names agree."
        return describe(
            difference, where=self.where, fix=self.fix, notes=self.notes, world_size=world_size
        )

    def check_changed(self, rows: Rows, *, warn_after_s: float = CHANGE_WARN_AFTER_S) -> None:
        """Compares only where this rank's names differ from the ones every rank last agreed on.

        For a reduction made every step (Composer's loss, one ``all_reduce`` per
        key): the first call compares, then a rank compares again only when its
        names change. Ranks whose names changed alike agree at once; a rank whose
        names changed alone waits here while the others go on into the
        collective, which the hang watchdog proves a deadlock (every rank waits,
        at different rendezvous). That rank says, after ``warn_after_s``, which
        names changed, so the proof's report comes with them.

        Raises:
            MetricMismatchError: The ranks that compared hold different names.
        """
        names = tuple(row.names for row in rows)
        if names == self._agreed:
            return
        if self.on_names is not None and rows:
            self.on_names(tuple(sorted({n for row in rows for n, _ in row.names})), rows[0].label)
        timer = None
        if self._agreed is not None and self.channel.is_distributed:
            timer = threading.Timer(
                warn_after_s, self._warn_changed, (rows, self._agreed, warn_after_s)
            )
            timer.daemon = True
            timer.start()
        try:
            self.check(rows)
        finally:
            if timer is not None:
                timer.cancel()
        self._agreed = names

    def _warn_changed(
        self, rows: Rows, agreed: tuple[tuple[tuple[str, str], ...], ...], after_s: float
    ) -> None:
        was = {name for names in agreed for name in names}
        now = {name for row in rows for name in row.names}
        change = [f"+'{n}' ({k})" for n, k in sorted(now - was)]
        change += [f"-'{n}' ({k})" for n, k in sorted(was - now)]
        step = rows[0].label if rows else "?"
        logger.warning(
            "rankguard: rank %d's names for %s changed at step %s (%s) and the other ranks "
            "have not confirmed the same change within %.0f s.\n  If they kept the old "
            "names, one collective per name pairs different values: gloo aborts, NCCL hangs "
            "(the hang watchdog proves it). Fix: %s",
            self.channel.rank,
            self.where,
            step,
            ", ".join(change) or "reordered",
            after_s,
            self.fix,
        )
