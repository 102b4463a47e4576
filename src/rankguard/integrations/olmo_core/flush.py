"""OLMo-core's metric flush, checked before OLMo-core reduces it: the one place that reads how.

Requires ``pip install 'rankguard[olmo-core]'``.
See docs/hang.md#metric-names-checked-before-their-reduction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from olmo_core.train import Trainer

from rankguard.callbacks.hang.metric_reductions import ReductionCheck, Rows, reduction_rows
from rankguard.integrations._common import Unhook, wrap_method
from rankguard.integrations.private.olmo_core import pending_flush, wrap_metric_flush

__all__ = [
    "COLLECTIVE_OF",
    "FLUSH",
    "FLUSH_FIX",
    "FLUSH_NOTES",
    "check_flush",
    "gathered_flush",
    "hook_metric_flush",
    "reduced_names",
]

#: OLMo-core's metric flush, in rankguard's message when ranks' metrics differ.
FLUSH = "OLMo-core's metric flush"
#: What a user changes when a metric with a reduce type is recorded on some ranks only.
FLUSH_FIX = (
    "record a metric that has a reduce type on every rank at the same step (a neutral value "
    "where a rank has nothing to add: 0 for sum or mean), or record it with reduce_type=None "
    "where only some ranks have it. OLMo-core compares ranks' metric names once, at its first "
    "flush; after that each flush is one all_reduce sized by the names each rank recorded."
)
#: Words for the metrics OLMo-core itself records on some ranks only.
FLUSH_NOTES = {
    "checkpoint/save_async_duration_s": (
        "OLMo-core records it when this rank's own asynchronous checkpoint save ends, so "
        "ranks whose saves end at different steps flush it at different steps; save "
        "synchronously (CheckpointerCallback(save_async=False)) until OLMo-core records it "
        "at one step on every rank."
    ),
}


def reduced_names(reduce_types: Mapping[str, Any]) -> tuple[str, ...]:
    """The names OLMo-core's first flush compares across ranks: every name with a reduce type.

    ``check_metrics_consistent`` compares the names ever recorded with a reduce
    type (``Trainer._metrics_reduce_type``), not the steps' names: equal sets make
    every later flush one ``all_reduce`` per reduce kind sized by each rank's own
    steps and names; different sets make it gather the names first, so that only
    the steps size it.
    """
    return tuple(sorted(name for name, kind in reduce_types.items() if kind is not None))


#: OLMo-core's reduce types by the ``all_reduce`` of its flush that reduces them.
COLLECTIVE_OF = {"mean": "sum", "sum": "sum", "l2_norm": "sum", "max": "max"}


def gathered_flush(
    pending: Mapping[int, Mapping[str, Any]], reduce_types: Mapping[str, Any]
) -> tuple[Rows, tuple[tuple[int, ...], tuple[str, ...]]]:
    """What sizes a flush for which OLMo-core gathers every rank's names first.

    Each of its two ``all_reduce`` (one per :data:`COLLECTIVE_OF` value) holds a
    row per step this rank flushes, one column per name any rank recorded; its
    dtype is float64 where this rank has a value recorded as a Python number
    (OLMo-core stores those as float64, tensors as float32), else float32.

    Args:
        pending: This rank's ``Trainer._metrics`` (values per name per step).
        reduce_types: ``Trainer._metrics_reduce_type``.

    Returns:
        ``(rows, compared)``: the float64 names per step (what the message names,
        e.g. ``checkpoint/save_async_duration_s``, a Python float), and what is
        compared: the steps and the collectives that are float64.
    """
    wide = {
        step: [name for name, value in values.items() if value.dtype == torch.float64]
        for step, values in pending.items()
    }
    rows = reduction_rows(wide, reduce_types)
    collectives = {COLLECTIVE_OF.get(kind, kind) for row in rows for _, kind in row.names}
    return rows, (tuple(row.label for row in rows), tuple(sorted(collectives)))


def check_flush(
    check: ReductionCheck,
    pending: Mapping[int, Mapping[str, Any]],
    reduce_types: Mapping[str, Any],
    consistent: bool | None,
) -> None:
    """Compares, on every rank, what the coming OLMo-core flush reduces; raises on every rank.

    ``consistent`` is ``Trainer._metrics_consistent``: ``None`` before the first
    flush that had metrics, where OLMo-core compares :func:`reduced_names` itself
    (compared here first, through the side channel, to know what follows). Where
    they agree (and after a first flush that found them so), each rank's names per
    step size the collective and are compared; where they differ (pipeline
    parallelism, a metric one rank recorded early) OLMo-core gathers the names per
    flush, and :func:`gathered_flush` is compared. A rank with nothing to flush
    issues no collective at all: it differs from one that has steps.

    Raises:
        MetricMismatchError: The ranks' flushes differ (on every rank).
    """
    if consistent is None:
        consistent = check.same(reduced_names(reduce_types))
    if consistent:
        check.check(reduction_rows(pending, reduce_types))
    else:
        rows, compared = gathered_flush(pending, reduce_types)
        check.check(rows, compared=compared)


def hook_metric_flush(trainer: Trainer, check: ReductionCheck) -> Unhook:
    """Runs ``check`` at every metric flush, before OLMo-core reduces the metrics.

    Relies on how OLMo-core reduces its metrics (the private names it reads are
    read in :mod:`rankguard.integrations.private.olmo_core`): its
    private ``Trainer._log_metrics`` starts each flush on the training thread,
    at the same points on every rank; it reduces ``_metrics`` (the names per
    step since the last flush, nothing where this rank has none while another
    may have some) by their ``_metrics_reduce_type``, and ``_metrics_consistent``
    holds its first flush's verdict on the names (see :func:`check_flush`).

    The check runs on the training thread, before OLMo-core hands the metrics
    to its reduction (its bookkeeping thread where bookkeeping is
    asynchronous), so every rank stops at the same flush: raised from the
    bookkeeping thread, the error reached each training thread at a step of
    its own, and a rank one step ahead waited in its gradient all-reduce for
    a rank that had stopped.

    ``Trainer.record_metric`` is wrapped too: a metric recorded from another
    thread (OLMo-core's asynchronous save records
    ``checkpoint/save_async_duration_s`` from the thread that completed the
    save) waits while a flush is checked and OLMo-core takes its metrics, so the
    names compared are the names OLMo-core reduces (recorded between the two, it
    was reduced unchecked: a healthy 2-rank job's first flush paired different
    sizes). ``tests/integrations/test_private_olmo_core.py`` fails if that changes.

    Returns:
        The function that removes both wrappers (safe to call twice).
    """
    flush = threading.RLock()  # re-entered where a flush's reduction records (synchronous)

    def flushing(log_metrics: Callable[..., Any]) -> Callable[..., Any]:
        def _log_metrics(*args: Any, **kwargs: Any) -> Any:
            with flush:
                check_flush(check, *pending_flush(trainer))
                return log_metrics(*args, **kwargs)

        return _log_metrics

    def recording(record_metric: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            with flush:
                return record_metric(*args, **kwargs)

        return record

    unhooks = [
        wrap_metric_flush(trainer, flushing),
        wrap_method(trainer, "record_metric", recording),
    ]

    def unhook() -> None:
        for undo in unhooks:
            undo()

    return unhook
