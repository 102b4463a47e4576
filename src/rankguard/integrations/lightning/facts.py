"""The facts the guards need, read from Lightning's objects.

Each function reads the public ``Trainer`` (or strategy) into rankguard's core
facts: the train loader and each val loader by name with Lightning's planned
batch count, the checkpoint format and folders, what a rank resumed from, the
decisions that can split the ranks. What only Lightning's private names say is
read in :mod:`rankguard.integrations.private.lightning`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

from rankguard.callbacks.core.events import LoaderFacts, ResumeFacts
from rankguard.integrations.lightning.words import (
    DATA_FIX,
    FSDP_SHARDED_SETTING,
    MODEL_PARALLEL_SHARDED_SETTING,
    RESUME_FIX,
)
from rankguard.integrations.private import lightning as private


def _planned(value: float | int | None) -> int | None:
    """Lightning's planned batch count as a count (``None``: unknown, ``inf``)."""
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return None
    return int(value)


def _flatten(loaders: Any, prefix: str) -> list[tuple[str, Any]]:
    """Lightning's loaders (one, a sequence or a mapping) by name: ``prefix``, ``prefix/key``."""
    if loaders is None:
        return []
    if isinstance(loaders, Mapping):
        return [(f"{prefix}/{key}", loader) for key, loader in loaders.items()]
    if isinstance(loaders, Sequence):
        return [(f"{prefix}/{i}", loader) for i, loader in enumerate(loaders)]
    return [(prefix, loaders)]


def val_loaders(trainer: pl.Trainer) -> list[LoaderFacts]:
    """The val loaders with Lightning's planned batch count for the current run."""
    planned = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
    flat = _flatten(trainer.val_dataloaders, "val")
    return [
        LoaderFacts(name, loader, is_train=False, num_batches=_planned(n))
        for (name, loader), n in zip(flat, planned, strict=False)
    ]


def train_loader(trainer: pl.Trainer) -> LoaderFacts | None:
    """The train loader with Lightning's planned batch count."""
    flat = _flatten(trainer.train_dataloader, "train")
    if len(flat) != 1:
        return None
    return LoaderFacts(
        "train", flat[0][1], is_train=True, num_batches=_planned(trainer.num_training_batches)
    )


def fit_loaders(trainer: pl.Trainer, train: LoaderFacts | None) -> list[LoaderFacts]:
    """The loaders known at ``on_train_start``: ``train``, then each val loader loaded by then.

    Lightning loads the val loaders before ``on_train_start`` when val is due in the
    first epoch (or the sanity check ran); else EVAL_START checks them later.
    """
    loaders = [train] if train else []
    if trainer.val_dataloaders is not None:
        loaders += val_loaders(trainer)
    return loaders


def val_batch(val: list[LoaderFacts], dataloader_idx: int, batch_idx: int) -> dict[str, Any]:
    """A val batch's facts: the loader at ``dataloader_idx`` of ``val`` (``None`` past it)."""
    loader = val[dataloader_idx] if dataloader_idx < len(val) else None
    return {"loader": loader, "batch_index": batch_idx}


def first_optimizer(trainer: pl.Trainer) -> Any:
    """The trainer's first optimizer, the one the guards read (``None``: it has none)."""
    return trainer.optimizers[0] if trainer.optimizers else None


def data_parallel(trainer: pl.Trainer) -> Any:
    """What makes the module data parallel: the strategy's model (a DDP wrapper under ``ddp``)."""
    return trainer.strategy.model


def position(trainer: pl.Trainer | None) -> tuple[int, int]:
    """The trainer's step and epoch, ``0`` for what it does not have (e.g. ``None``)."""
    return getattr(trainer, "global_step", 0), getattr(trainer, "current_epoch", 0)


def checkpoint_format(strategy: Any) -> tuple[str, Callable[[], str] | None, str]:
    """What the strategy saves, how to make it save sharded, and the user's setting for that.

    Returns:
        ``"full"`` or ``"sharded"``; a function that switches later saves to
        sharded (``None`` where the strategy cannot save sharded, e.g. DDP);
        the constructor setting that does the same.
    """
    sharded = private.saves_sharded(strategy)
    if sharded is None:
        return "full", None, FSDP_SHARDED_SETTING
    parallel = isinstance(strategy, ModelParallelStrategy)
    setting = MODEL_PARALLEL_SHARDED_SETTING if parallel else FSDP_SHARDED_SETTING
    switch = functools.partial(private.switch_to_sharded, strategy)
    return "sharded" if sharded else "full", switch, setting


def save_directories(trainer: pl.Trainer) -> list[str]:
    """The local directories of the trainer's ``ModelCheckpoint`` callbacks."""
    return [str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]


def preemption_checkpoint(trainer: pl.Trainer, epoch: int) -> str | None:
    """The file the trainer's ``ModelCheckpoint`` names for this step, or ``None`` (none set).

    Its own name for the step of ``epoch`` (``filename``, default ``{epoch}-{step}``, in
    its ``dirpath``), so a restart finds it where the callback's saves go.
    """
    callback = trainer.checkpoint_callback
    if callback is None or not getattr(callback, "dirpath", None):
        return None
    step = {"epoch": epoch, "step": trainer.global_step}
    return str(callback.format_checkpoint_name({**trainer.callback_metrics, **step}))


def resume_folder(checkpoint: str | None, folders: list[str]) -> str | None:
    """The ``ModelCheckpoint`` folder a resume was looked up in (``ckpt_path="last"``), if any.

    The first folder, where the checkpoint is in it or none was found there.
    """
    if folders and (checkpoint is None or os.path.dirname(checkpoint) == folders[0]):
        return folders[0]
    return None


def resume_facts(trainer: pl.Trainer, train: LoaderFacts | None) -> ResumeFacts:
    """What this rank resumed from, once Lightning restored it (at ``on_train_start``).

    ``trainer.ckpt_path`` is the checkpoint as this rank resolved it (``None``: it
    found none, e.g. no ``last`` in its ``ModelCheckpoint`` folder, and started fresh).
    Lightning does not save or restore random states.
    """
    ckpt = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
    counters = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "batch_idx": private.next_batch_index(trainer),
    }
    return ResumeFacts(
        asked="trainer.fit(ckpt_path=...)",
        checkpoint=ckpt,
        counters=counters,
        loader=train.loader if train else None,
        folder=resume_folder(ckpt, save_directories(trainer)),
        fix=RESUME_FIX,
        data_fix=DATA_FIX,
    )


def split_decisions(trainer: pl.Trainer) -> dict[str, Any]:
    """Decisions that can split the ranks, as this rank's trainer holds them now.

    Called from the hang watchdog's thread; the caller catches a change under its feet.
    """
    stage = trainer.state.stage
    return {
        "should_stop": bool(trainer.should_stop),
        "sync_dist_keys": tuple(private.synced_metric_names(trainer)),
        # The loop those keys were logged in: a rank in validation and one in training log
        # different keys without any split between them.
        "sync_dist_loop": stage.value if stage is not None else None,
    }
