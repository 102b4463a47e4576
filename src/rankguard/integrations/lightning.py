"""rankguard callbacks for PyTorch Lightning.

Translation only: Lightning hooks become rankguard core events (the table:
docs/design.md#events-the-training-loop-as-the-guards-see-it), and the facts the guards
need (train loader, each val loader by name with Lightning's planned batch
count) are read from the public ``Trainer`` properties; what only Lightning's
private names say is read in :mod:`rankguard.integrations.private.lightning`.

Every val loader gets its EVAL_START at ``on_validation_start`` and its
EVAL_END at ``on_validation_end``, so each rank reports every loader even
when it has no batch of it. The sanity check counts as an eval.

Example::

    import lightning as L
    from rankguard.integrations.lightning import RankGuard

    trainer = L.Trainer(strategy="ddp", callbacks=[RankGuard()])

Requires ``pip install 'rankguard[lightning]'``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rankguard.callbacks.checkpoint.plan import register_sharded_setting
from rankguard.callbacks.core.events import (
    Event,
    EventFacts,
    LoaderFacts,
    ResumeFacts,
    SplitDecision,
)
from rankguard.callbacks.core.guard import Guard
from rankguard.integrations import _api
from rankguard.integrations._adapter import Adapter

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rankguard.integrations.lightning needs Lightning: pip install 'rankguard[lightning]'"
    ) from exc

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


ENFORCE_UNSUPPORTED = (
    "`drop_last_guard` `mode='enforce'` is not available under Lightning: Lightning counts "
    "the train batches of an epoch before any callback hook runs, so a loader shortened "
    "from a callback ends the epoch early and skips its end-of-epoch validation. Fix: build "
    "the train loader with DataLoader(..., drop_last=True) (Lightning's DistributedSampler "
    "follows it), and keep `mode='check'`."
)

#: Lightning writes checkpoints through an in-memory buffer (``_atomic_save``).
LIGHTNING_DEFAULTS = {"checkpoint_planner": {"writer": "buffer"}}


#: Lightning's settings for sharded checkpoints, named in rankguard's messages.
FSDP_SHARDED_SETTING = "FSDPStrategy(state_dict_type='sharded')"
MODEL_PARALLEL_SHARDED_SETTING = "ModelParallelStrategy(save_distributed_checkpoint=True)"
register_sharded_setting("Lightning", FSDP_SHARDED_SETTING)


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


#: Lightning's remote checkpoint storage, named in rankguard's messages as the fix for
#: node-local checkpoint folders.
UPLOAD_SETTING = (
    "save to and resume from remote storage through fsspec "
    "(`ModelCheckpoint(dirpath='s3://bucket/run/checkpoints')`, "
    "`trainer.fit(..., ckpt_path='s3://bucket/run/checkpoints/last.ckpt')`)"
)


#: How to resume every rank from one checkpoint, and keep each rank's data position, in
#: Lightning's words (the resume check's messages).
RESUME_FIX = (
    "resolve the checkpoint once for every node: `ModelCheckpoint(dirpath=...)` on storage every "
    "node mounts or on remote storage (fsspec, 's3://...') with `ckpt_path='last'`, or pass every "
    "rank the same path, `trainer.fit(..., ckpt_path=...)`"
)
DATA_FIX = (
    "Lightning saves a stateful train loader's `state_dict()` from rank 0 only and loads it on "
    "every rank: return every rank's position from it (e.g. gathered with "
    "`torch.distributed.all_gather_object`, by rank) and take this rank's in `load_state_dict()`"
)


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


#: How the hang verdict tells Lightning's decisions where they split the ranks.
SPLIT_DECISIONS = {
    "should_stop": SplitDecision(
        fix=(
            "reduce the decision across ranks, e.g. Lightning's "
            "`trainer.strategy.reduce_boolean_decision`, or base it on a metric synced across "
            "ranks"
        )
    ),
    "sync_dist_keys": SplitDecision(
        told="logged with sync_dist=True{at}: {value}", now=True, context="sync_dist_loop"
    ),
}


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


class _LightningAdapter(Adapter, Callback):
    """Drives the guards from Lightning hooks, at the trainer's step and epoch."""

    #: Lightning's own guard settings, under the user's (``rankguard.integrations._api``).
    framework_defaults = LIGHTNING_DEFAULTS

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        for guard in guards:
            if guard.name == "drop_last_guard" and getattr(guard, "mode", None) == "enforce":
                raise ValueError(ENFORCE_UNSUPPORTED)
        super().__init__(guards, exchange_timeout_s)
        # Lightning's loggers take metrics at any point: they go there at once, at its step.
        self.driver.log_metrics = self._log_metrics
        self._trainer: pl.Trainer | None = None
        self._val: list[LoaderFacts] = []
        #: ``should_stop`` as last recorded in the step log this fit (``None``: not yet).
        self._should_stop: Any = None
        #: Where ``trainer.global_step`` is read from (:func:`private.step_tracker`), each epoch.
        self._steps_taken: Any = None

    def _fire(self, trainer: pl.Trainer, event: Event, **facts: Any) -> None:
        """Fires ``event`` at the trainer's step and epoch (FIT_END closes the fit)."""
        if self.runner.handles(event) or event is Event.FIT_END:
            self._trainer = trainer
            step, epoch = trainer.global_step, trainer.current_epoch
            self.driver.dispatch(event, EventFacts(step=step, epoch=epoch, **facts))

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        trainer = self._trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=trainer.global_step)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Fires the checkpoint events around every save and before every load, on every rank.

        Every save (``ModelCheckpoint``, ``OnExceptionCheckpoint``, the user's own) goes
        through the public ``Trainer.save_checkpoint`` on every rank, before the state is
        gathered (``on_save_checkpoint`` runs after, and never for ``save_weights_only``);
        every resume (``trainer.fit(ckpt_path=...)``) through ``Strategy.load_checkpoint``,
        before the file is read. Both are wrapped on these two instances until
        ``teardown``; ``tests/integrations/test_adapters.py`` fails if Lightning stops
        calling them.
        """
        if self.wrapped:
            return
        fire = functools.partial(self._fire, trainer)

        def saving(save: Callable[..., Any]) -> Callable[..., Any]:
            def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
                directories = [os.path.dirname(str(filepath))]
                model = trainer.lightning_module
                fire(Event.CHECKPOINT_SAVE_START, model=model, directories=directories)
                result = save(filepath, *args, **kwargs)
                fire(Event.CHECKPOINT_SAVE_END)
                return result

            return save_checkpoint

        def loading(load: Callable[..., Any]) -> Callable[..., Any]:
            def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
                path = str(checkpoint_path)
                fire(Event.CHECKPOINT_LOAD_START, load_path=path, upload_setting=UPLOAD_SETTING)
                return load(checkpoint_path, *args, **kwargs)

            return load_checkpoint

        self.wrap(trainer, "save_checkpoint", saving)
        self.wrap(trainer.strategy, "load_checkpoint", loading)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """FIT_START with the train loader and every val loader known now, then RESUMED."""
        self._should_stop = self._steps_taken = None
        train = train_loader(trainer)
        loaders = [train] if train else []
        # Lightning loads the val loaders before on_train_start when val is due in the
        # first epoch (or the sanity check ran); else EVAL_START checks them later.
        if trainer.val_dataloaders is not None:
            loaders += val_loaders(trainer)
        state_dict_type, switch, setting = checkpoint_format(trainer.strategy)
        self._fire(
            trainer,
            Event.FIT_START,
            loaders=loaders,
            model=pl_module,
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            directories=save_directories(trainer),
            state_dict_type=state_dict_type,
            switch_to_sharded=switch,
            sharded_setting=setting,
            upload_setting=UPLOAD_SETTING,
            decision_probe=functools.partial(split_decisions, trainer),
            split_decisions=SPLIT_DECISIONS,
        )
        # RESUMED here: Lightning restored the checkpoint and the loops' counters in `_run`, and
        # the train loaders' states in `fit_loop.setup_data()`, both before `on_train_start`, the
        # last hook before the first batch. On every fit: a rank that found no `last` (or SLURM's
        # `hpc`) starts fresh without knowing a resume was asked, so every rank checks.
        self._fire(trainer, Event.RESUMED, resume=resume_facts(trainer, train))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EPOCH_START with the train loader."""
        self._steps_taken = private.step_tracker(trainer)
        self._fire(trainer, Event.EPOCH_START, loader=train_loader(trainer))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """DATA_FETCH_END then TRAIN_BATCH_START, in the step log (the step read once)."""
        tracker = self._steps_taken
        steps = self.runner.steps
        steps.fetch_end_batch_start(
            trainer.global_step if tracker is None else tracker.completed, batch
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """TRAIN_BATCH_END, then DATA_FETCH_START for the next batch.

        ``should_stop`` goes with the entry when it changed (the first batch's, then
        rarely): the hang watchdog keeps each decision with the step it last changed,
        and a dict a step is one more allocation on a cold cache.
        """
        tracker = self._steps_taken
        step = trainer.global_step if tracker is None else tracker.completed
        should_stop = trainer.should_stop
        if should_stop is self._should_stop:
            self.runner.steps.batch_end_fetch_start(step)
            return
        self._should_stop = should_stop
        self.runner.steps.batch_end_fetch_start(step, {"should_stop": should_stop})

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EVAL_START for every val loader, in Lightning's order."""
        self._val = val_loaders(trainer)
        for loader in self._val:
            self._fire(trainer, Event.EVAL_START, loader=loader)

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """EVAL_BATCH_START for the loader at ``dataloader_idx``."""
        self._fire(trainer, Event.EVAL_BATCH_START, **self._val_batch(dataloader_idx, batch_idx))

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """EVAL_BATCH_END for the loader at ``dataloader_idx``."""
        self._fire(trainer, Event.EVAL_BATCH_END, **self._val_batch(dataloader_idx, batch_idx))

    def _val_batch(self, dataloader_idx: int, batch_idx: int) -> dict[str, Any]:
        loader = self._val[dataloader_idx] if dataloader_idx < len(self._val) else None
        return {"loader": loader, "batch_index": batch_idx}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EVAL_END for every val loader (with ``should_stop``: early stopping decides here)."""
        stop = {"should_stop": bool(trainer.should_stop)}
        for loader in self._val:
            self._fire(trainer, Event.EVAL_END, loader=loader, decisions=stop)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EPOCH_END with the train loader."""
        self._fire(trainer, Event.EPOCH_END, loader=train_loader(trainer))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """FIT_END."""
        self._fire(trainer, Event.FIT_END)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lets guards explain the error (e.g. a dead data worker), then stops them."""
        # Never raise from an exception hook, whatever state the trainer is in. Explained
        # wherever the trainer raised it: in the sanity check (before FIT_START) too.
        step, epoch = getattr(trainer, "global_step", 0), getattr(trainer, "current_epoch", 0)
        self.fail(exception, step, epoch, fitting=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stops every guard and unwraps checkpointing; safe to call twice."""
        self.stop()


class RankGuard(_api.RankGuardSettings, _LightningAdapter):
    """Every rankguard guard with sound defaults, as a Lightning callback."""


class HangWatchdog(_api.HangWatchdogSettings, _LightningAdapter):
    """The hang watchdog, as a Lightning callback."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _LightningAdapter):
    """The data consistency guard, as a Lightning callback."""


class DropLastGuard(_api.DropLastGuardSettings, _LightningAdapter):
    """The drop-last guard, as a Lightning callback."""


class BatchParityGuard(_api.BatchParityGuardSettings, _LightningAdapter):
    """The batch parity guard, as a Lightning callback."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _LightningAdapter):
    """The shared-directory barrier, as a Lightning callback."""


class ResumeGuard(_api.ResumeGuardSettings, _LightningAdapter):
    """The resume check, as a Lightning callback."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _LightningAdapter):
    """The checkpoint planner, as a Lightning callback."""


class DataStallMonitor(_api.DataStallMonitorSettings, _LightningAdapter):
    """The data stall monitor, as a Lightning callback."""


class StragglerMonitor(_api.StragglerMonitorSettings, _LightningAdapter):
    """The straggler monitor, as a Lightning callback."""


__all__ = [*_api.CLASS_NAMES]
