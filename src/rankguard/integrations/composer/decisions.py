"""What the Composer adapter decides, as functions of what it read (each with a unit test).

Whether a checkpoint saver saves at an event, what Composer's loss reduction
all-reduces, whether a loader's passes may be counted, which checkpoint a
resume loaded, which exception is ending the run. The adapter reads Composer's
objects and keeps what it caches; these say what that means.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.core import Event, State
from composer.utils import format_name_with_dist
from torch.utils.data import DistributedSampler

from rankguard.callbacks.batches.loader_passes import PassCounter
from rankguard.callbacks.hang.metric_reductions import Rows, reduction_rows
from rankguard.integrations._common import resolved_checkpoint

__all__ = [
    "countable",
    "escaping_exception",
    "loss_keys",
    "loss_rows",
    "resumed_from",
    "saves_at",
    "unsaved_at_stop",
]


def saves_at(savers: Iterable[CheckpointSaver], state: State, event: Event) -> bool:
    """Whether one of Composer's checkpoint ``savers`` will save at this ``*_CHECKPOINT`` event.

    Composer fires BATCH_CHECKPOINT after every batch; a save happens only when
    a saver's ``save_interval`` says so. That scheduler only records the last
    batch it answered ``True`` for, so asking it first (rankguard runs before
    the savers, which Composer appends after user callbacks) does not change
    the saver's answer. Asks in order and stops at the first ``True``.
    """
    for saver in savers:
        if saver.save_interval(state, event):
            return True
    return False


def unsaved_at_stop(savers: Iterable[CheckpointSaver], batch: int) -> list[CheckpointSaver]:
    """The ``savers`` that did not save ``batch``, the last of a fit an agreed preemption ended.

    ``state.stop_training()`` makes that batch's BATCH_CHECKPOINT the end of training,
    where a saver whose ``save_interval`` Composer built from a time string saves
    (``create_interval_scheduler(include_end_of_training=True)``); a callable of the
    user's may not. A saver records the batch it last saved (``last_checkpoint_batch``).
    """
    unsaved = []
    for saver in savers:
        last = saver.last_checkpoint_batch
        if last is None or int(last) != batch:
            unsaved.append(saver)
    return unsaved


def loss_keys(loss: Any) -> tuple[str, ...] | int | None:
    """What names Composer's loss reduction, cheaply: a dict's keys, a tuple's length, or ``None``.

    Read after every batch and compared with the last batch's; never compares
    the tensors themselves.
    """
    if isinstance(loss, dict):
        return tuple(loss)
    if isinstance(loss, (tuple, list)):
        return len(loss)
    return None


def loss_rows(loss: Any, batch: int) -> Rows:
    """What Composer all-reduces after a train batch: ``loss/train/<key>`` per key of the loss.

    A dict without ``"total"`` gets Composer's sum of its terms as ``total``; a
    tuple of losses is ``loss0``, ``loss1``... and ``total``; a tensor is the total
    alone. (Composer takes the keys of every microbatch; this reads the last
    one's, ``state.loss`` at ``AFTER_TRAIN_BATCH``.)
    """
    keys = loss_keys(loss)
    if isinstance(keys, int):
        names = [f"loss{i}" for i in range(keys)] if keys > 1 else []
    else:
        names = list(keys or ())
    if "total" not in names:
        names.append("total")
    reduced = [f"loss/train/{name}" for name in names]
    return reduction_rows({batch: reduced}, dict.fromkeys(reduced, "sum"))


def countable(loader: Any) -> bool:
    """Whether a :class:`PassCounter` may stand in for ``loader`` (see ``facts.observe_pass``)."""
    if loader is None or isinstance(loader, PassCounter):
        return False
    samplers = (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None))
    return not any(isinstance(s, DistributedSampler) for s in samplers)


def resumed_from(loaded: str | None, folder: str | None, run_name: str) -> tuple[Any, Any]:
    """The checkpoint a resume loaded and the folder it resumed from, as every rank sees them.

    ``loaded``: ``State.load_path``; ``folder``: the ``save_folder`` of an autoresume.
    Every node loads rank 0's path (see composer.utils.checkpoint); an autoresume that
    loaded nothing names its own (formatted) folder.
    """
    if loaded:
        folder = os.path.dirname(loaded) if folder else None
        return resolved_checkpoint(loaded.format(rank=0, local_rank=0, node_rank=0)), folder
    return loaded, format_name_with_dist(folder, run_name) if folder else folder


def escaping_exception() -> BaseException | None:
    """The exception that is ending the run, seen from ``Callback.close``.

    Composer has no exception event: an error raised in ``fit`` propagates, and
    callbacks are closed from the caller's ``finally: trainer.close()`` (the
    exception is then being handled: ``sys.exc_info``) or at interpreter exit
    (``Engine`` registers its close with ``atexit``, after Python printed the
    traceback and kept the exception in ``sys.last_exc``/``sys.last_value``).
    """
    current = sys.exc_info()[1]
    if current is not None:
        return current
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
