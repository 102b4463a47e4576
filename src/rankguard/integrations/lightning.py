"""rankguard callbacks for PyTorch Lightning.

Translation only: Lightning hooks become rankguard core events (the table:
docs/design.md#events-the-training-loop-as-the-guards-see-it), and the facts the guards
need (train loader, each val loader by name with Lightning's planned batch
count) are read from the public ``Trainer`` properties.

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
from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.integrations import _api

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rankguard.integrations.lightning needs Lightning: pip install 'rankguard[lightning]'"
    ) from exc


def _planned(value: float | int | None) -> int | None:
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return None
    return int(value)


def _flatten(loaders: Any, prefix: str) -> list[tuple[str, Any]]:
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

    The two strategies that save sharded keep the choice in a private attribute
    their ``save_checkpoint`` reads at every save; this is the one place
    rankguard touches them (a test fails if Lightning renames them).
    """
    sharded: str | bool
    if isinstance(strategy, FSDPStrategy):
        attribute, sharded, setting = "_state_dict_type", "sharded", FSDP_SHARDED_SETTING
    elif isinstance(strategy, ModelParallelStrategy):
        attribute, sharded = "_save_distributed_checkpoint", True
        setting = MODEL_PARALLEL_SHARDED_SETTING
    else:
        return "full", None, FSDP_SHARDED_SETTING
    now = "sharded" if getattr(strategy, attribute) == sharded else "full"

    def switch() -> str:
        setattr(strategy, attribute, sharded)
        return f"set {type(strategy).__name__}.{attribute} to {sharded!r}"

    return now, switch, setting


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


def resume_facts(trainer: pl.Trainer, train: LoaderFacts | None) -> ResumeFacts:
    """What this rank resumed from, once Lightning restored it (at ``on_train_start``).

    ``trainer.ckpt_path`` is the checkpoint as this rank resolved it (``None``: it
    found none, e.g. no ``last`` in its ``ModelCheckpoint`` folder, and started fresh).
    Lightning does not save or restore random states.
    """
    ckpt = trainer.ckpt_path
    folders = save_directories(trainer)  # where ckpt_path="last" is looked up
    folder = (
        folders[0]
        if folders and (ckpt is None or os.path.dirname(str(ckpt)) == folders[0])
        else None
    )
    batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # the next batch to run
    counters = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "batch_idx": batch,
    }
    return ResumeFacts(
        asked="trainer.fit(ckpt_path=...)",
        checkpoint=None if ckpt is None else str(ckpt),
        counters=counters,
        loader=train.loader if train else None,
        folder=folder,
        fix=RESUME_FIX,
        data_fix=DATA_FIX,
    )


def hook_checkpoint_io(
    trainer: pl.Trainer,
    before_save: Callable[[str], None],
    after_save: Callable[[], None],
    before_load: Callable[[str], None],
) -> Callable[[], None]:
    """Calls ``before_save``/``after_save`` around every save, ``before_load`` before loads.

    All three run on every rank, with the checkpoint's path where there is one.
    ``on_save_checkpoint`` runs after the state is gathered, and never for
    ``ModelCheckpoint(save_weights_only=True)``. Every save (``ModelCheckpoint``,
    ``OnExceptionCheckpoint``, the user's own) goes through the public
    ``Trainer.save_checkpoint`` on every rank, before the state is gathered;
    every resume (``trainer.fit(ckpt_path=...)``) through
    ``Strategy.load_checkpoint`` on every rank, before the file is read. Both
    are wrapped on these two instances only; this is the one place rankguard
    wraps Lightning methods, and ``tests/integrations/test_adapters.py`` fails if Lightning
    stops calling them.

    Returns:
        A function that removes the wrappers (safe to call twice).
    """
    save, strategy = trainer.save_checkpoint, trainer.strategy
    load = strategy.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
        before_save(str(filepath))
        result = save(filepath, *args, **kwargs)
        after_save()
        return result

    @functools.wraps(load)
    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        before_load(str(checkpoint_path))
        return load(checkpoint_path, *args, **kwargs)

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    strategy.load_checkpoint = load_checkpoint  # type: ignore[method-assign]

    def unhook() -> None:
        if vars(trainer).get("save_checkpoint") is save_checkpoint:
            del trainer.save_checkpoint
        if vars(strategy).get("load_checkpoint") is load_checkpoint:
            del strategy.load_checkpoint

    return unhook


def step_tracker(trainer: pl.Trainer) -> Any:
    """Lightning's own tracker whose ``completed`` is ``trainer.global_step``, or ``None``.

    ``trainer.global_step`` is a chain of five properties, a cold-cache call each
    at every batch's start and end; the tracker it ends at is one attribute away.
    The tracker is the one the property reads now (automatic or manual
    optimization), kept only where it reads the same value; ``None`` (read
    ``global_step`` itself) where Lightning's loops are built otherwise.
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

    ``should_stop`` is public; the metric names logged with ``sync_dist=True``
    are read from ``trainer._results`` (the running loop's logged values), a
    private attribute: this is the one place (``tests/integrations/test_adapters.py`` fails
    when Lightning changes it). Called from the hang watchdog's thread, so it
    copies what it reads and lets the caller catch a change under its feet.
    """
    results = getattr(trainer, "_results", None)
    metrics = list(results.values()) if results else []
    keys = sorted({m.meta.name for m in metrics if m.meta.sync.should})
    stage = trainer.state.stage
    return {
        "should_stop": bool(trainer.should_stop),
        "sync_dist_keys": tuple(keys),
        # The loop those keys were logged in: a rank in validation and one in training log
        # different keys without any split between them.
        "sync_dist_loop": stage.value if stage is not None else None,
    }


class _LightningAdapter(Callback):
    """Drives a :class:`GuardRunner` from Lightning hooks."""

    #: Lightning's own guard settings, under the user's (``rankguard.integrations._api``).
    framework_defaults = LIGHTNING_DEFAULTS

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        for guard in guards:
            if guard.name == "drop_last_guard" and getattr(guard, "mode", None) == "enforce":
                raise ValueError(ENFORCE_UNSUPPORTED)
        self.runner = GuardRunner(guards, exchange_timeout_s=exchange_timeout_s)
        self._trainer: pl.Trainer | None = None
        self._val: list[LoaderFacts] = []
        self._unhook: Callable[[], None] | None = None
        #: ``should_stop`` as last recorded in the step log this fit (``None``: not yet).
        self._should_stop: Any = None
        #: Where ``trainer.global_step`` is read from (:func:`step_tracker`), each epoch.
        self._steps_taken: Any = None

    def _fire(self, trainer: pl.Trainer, event: Event, **facts: Any) -> None:
        """Fires ``event`` at the trainer's step and epoch."""
        if not self.runner.handles(event):
            return
        self._trainer = trainer
        event_facts = EventFacts(step=trainer.global_step, epoch=trainer.current_epoch, **facts)
        self.runner.fire(event, event_facts, self._log_metrics)

    def _log_metrics(self, metrics: Mapping[str, float]) -> None:
        trainer = self._trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=trainer.global_step)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Hooks every checkpoint save and load (see :func:`hook_checkpoint_io`)."""
        if self._unhook is not None:
            return

        def before_save(filepath: str) -> None:
            self._fire(
                trainer,
                Event.CHECKPOINT_SAVE_START,
                model=trainer.lightning_module,
                directories=[os.path.dirname(filepath)],
            )

        def before_load(path: str) -> None:
            self._fire(
                trainer, Event.CHECKPOINT_LOAD_START, load_path=path, upload_setting=UPLOAD_SETTING
            )

        after_save = functools.partial(self._fire, trainer, Event.CHECKPOINT_SAVE_END)
        self._unhook = hook_checkpoint_io(trainer, before_save, after_save, before_load)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """FIT_START with the train loader and every val loader known now."""
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
        self._steps_taken = step_tracker(trainer)
        self._fire(trainer, Event.EPOCH_START, loader=train_loader(trainer))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """DATA_FETCH_END then TRAIN_BATCH_START, in the step log (the step read once)."""
        tracker = self._steps_taken
        steps = self.runner.steps
        steps.fetch_end_batch_start(trainer.global_step if tracker is None else tracker.completed)
        if steps.batch_probe is not None:  # the first train batches, for the guards that read them
            steps.batch_probe(batch)

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
        # Never raise from an exception hook, whatever state the trainer is in.
        step, epoch = getattr(trainer, "global_step", 0), getattr(trainer, "current_epoch", 0)
        self.runner.error(exception, EventFacts(step=step, epoch=epoch))
        self.runner.close()

    def state_dict(self) -> dict[str, Any]:
        """The guards' state (the hang watchdog's calibration), saved in Lightning checkpoints."""
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the guards' state when Lightning resumes (``fit(ckpt_path=...)``)."""
        self.runner.load_state_dict(state_dict)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stops every guard and unhooks checkpointing; safe to call twice."""
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        self.runner.close()


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


__all__ = [
    "BatchParityGuard",
    "CheckpointPlanner",
    "DataConsistencyGuard",
    "DataStallMonitor",
    "DropLastGuard",
    "HangWatchdog",
    "RankGuard",
    "ResumeGuard",
    "SharedDirBarrier",
    "StragglerMonitor",
]
