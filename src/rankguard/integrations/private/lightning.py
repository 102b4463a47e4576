"""Every private name of PyTorch Lightning that rankguard reads.

Each function reads one thing Lightning's public API does not give; the
adapter (:mod:`rankguard.integrations.lightning`) calls them and reads nothing
private itself. ``tests/integrations/test_private_lightning.py`` calls each
against the installed Lightning and fails if Lightning renames or moves what it
reads.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

__all__ = [
    "next_batch_index",
    "saves_sharded",
    "step_tracker",
    "switch_to_sharded",
    "synced_metric_names",
]


def _sharded_attribute(strategy: Any) -> tuple[str, Any] | None:
    """The private attribute that makes ``strategy`` save sharded and its value, or ``None``."""
    if isinstance(strategy, FSDPStrategy):
        return "_state_dict_type", "sharded"
    if isinstance(strategy, ModelParallelStrategy):
        return "_save_distributed_checkpoint", True
    return None


def saves_sharded(strategy: Any) -> bool | None:
    """Whether ``strategy``'s next save writes sharded; ``None`` where it cannot (e.g. DDP).

    Reads ``FSDPStrategy._state_dict_type`` (``"sharded"``) or
    ``ModelParallelStrategy._save_distributed_checkpoint`` (``True``), which their
    ``save_checkpoint`` reads at every save. Lightning takes both as constructor
    settings only and exposes neither.
    """
    found = _sharded_attribute(strategy)
    if found is None:
        return None
    attribute, sharded = found
    return bool(getattr(strategy, attribute) == sharded)


def switch_to_sharded(strategy: Any) -> str:
    """Makes ``strategy``'s later saves sharded; returns what it set, for the guard's message.

    Sets the attribute :func:`saves_sharded` reads: Lightning has no public way to
    change a strategy's checkpoint format after it is built. Only for a strategy
    :func:`saves_sharded` does not answer ``None`` for.
    """
    found = _sharded_attribute(strategy)
    if found is None:
        raise ValueError(f"{type(strategy).__name__} cannot save sharded checkpoints")
    attribute, sharded = found
    setattr(strategy, attribute, sharded)
    return f"set {type(strategy).__name__}.{attribute} to {sharded!r}"


def synced_metric_names(trainer: Any) -> list[str]:
    """The names the running loop logged with ``sync_dist=True`` (each reduced across ranks).

    Reads ``trainer._results`` (the running loop's ``_ResultCollection``) and each
    value's ``meta.name`` and ``meta.sync.should``: Lightning exposes the logged values
    (``callback_metrics``) but not which of them it reduces. Called from the hang
    watchdog's thread: it copies what it reads; the caller catches a change under its feet.
    """
    results = getattr(trainer, "_results", None)
    metrics = list(results.values()) if results else []
    return sorted({m.meta.name for m in metrics if m.meta.sync.should})


def next_batch_index(trainer: Any) -> int:
    """The index in its epoch of the next train batch to run (after a resume, the restored one).

    Reads ``trainer.fit_loop.epoch_loop.batch_progress.current.ready`` (the private
    ``_TrainingEpochLoop``'s progress tracker, which Lightning restores from the
    checkpoint): no public property gives the batch a resumed epoch starts at.
    """
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def step_tracker(trainer: Any) -> Any:
    """Lightning's own tracker whose ``completed`` is ``trainer.global_step``, or ``None``.

    ``trainer.global_step`` is a chain of five properties, a cold-cache call each at
    every batch's start and end; the tracker it ends at (inside the private
    ``_TrainingEpochLoop``'s optimization loops) is one attribute away. The tracker is
    the one the property reads now (automatic or manual optimization), kept only
    where it reads the same value; ``None`` (read ``global_step`` itself) where
    Lightning's loops are built otherwise.
    """
    try:
        loop = trainer.fit_loop.epoch_loop
        module = trainer.lightning_module
        if module is None or module.automatic_optimization:
            tracker = loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            tracker = loop.manual_optimization.optim_step_progress.total
        if tracker.completed == trainer.global_step:
            return tracker
    except Exception:  # another Lightning: its own property it is
        pass
    return None
