"""The Lightning adapter: Lightning's hooks as rankguard core events.

:class:`_LightningAdapter` is the event map (the table:
docs/design.md#events-the-training-loop-as-the-guards-see-it): each hook fires
its core events with the facts :mod:`rankguard.integrations.lightning.facts`
reads, and every save and load passes through the checkpoint events. The
public classes (:mod:`rankguard.integrations.lightning`) join it to their
settings.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from rankguard.callbacks.core.events import Event, EventFacts, LoaderFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.step_log import BACKWARD, BACKWARD_END, OPTIMIZER_STEP
from rankguard.callbacks.hang.stop import StopAgreement
from rankguard.integrations._adapter import Adapter, exit_after_stop
from rankguard.integrations.lightning.facts import (
    checkpoint_format,
    data_parallel,
    first_optimizer,
    fit_loaders,
    position,
    preemption_checkpoint,
    resume_facts,
    save_directories,
    split_decisions,
    train_loader,
    val_batch,
    val_loaders,
)
from rankguard.integrations.lightning.words import (
    ENFORCE_UNSUPPORTED,
    LIGHTNING_DEFAULTS,
    SPLIT_DECISIONS,
    UPLOAD_SETTING,
)
from rankguard.integrations.private import lightning as private

#: The parts of a train batch Lightning announces (its backward and optimizer-step hooks run
#: under automatic and manual optimization alike).
PHASES = (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)


def unsupported(guards: list[Guard]) -> str | None:
    """Why Lightning cannot run ``guards`` as they are set (``None``: it can)."""
    for guard in guards:
        if guard.name == "drop_last_guard" and getattr(guard, "mode", None) == "enforce":
            return ENFORCE_UNSUPPORTED
    return None


class _LightningAdapter(Adapter, Callback):
    """Drives the guards from Lightning hooks, at the trainer's step and epoch."""

    #: Lightning's own guard settings, under the user's (``rankguard.integrations._api``).
    framework_defaults = LIGHTNING_DEFAULTS

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        refused = unsupported(guards)
        if refused is not None:
            raise ValueError(refused)
        super().__init__(guards, exchange_timeout_s)
        # Lightning's loggers take metrics at any point: they go there at once, at its step.
        self.driver.log_metrics = self._log_metrics
        self._trainer: pl.Trainer | None = None
        self._val: list[LoaderFacts] = []
        #: ``should_stop`` as last recorded in the step log this fit (``None``: not yet).
        self._should_stop: Any = None
        #: Where ``trainer.global_step`` is read from (:func:`private.step_tracker`), each epoch.
        self._steps_taken: Any = None
        #: The watchdog's preemption agreement, caught from ``on_train_start`` to close.
        self._stop: StopAgreement | None = None
        #: ``trainer.global_step`` at the last save this fit (``None``: none yet).
        self._saved_step: int | None = None
        #: The epoch of the agreed step (the fit's end counts it done).
        self._stopped_epoch = 0

    def _fire(self, trainer: pl.Trainer, event: Event, **facts: Any) -> None:
        """Fires ``event`` at the trainer's step and epoch (FIT_END closes the fit)."""
        if self.driver.handles(event) or event is Event.FIT_END:
            self._trainer = trainer
            step, epoch = trainer.global_step, trainer.current_epoch
            self.driver.dispatch(event, EventFacts(step=step, epoch=epoch, **facts))

    def _fire_val_batch(
        self, trainer: pl.Trainer, event: Event, dataloader_idx: int, batch_idx: int
    ) -> None:
        """``event`` for the batch ``batch_idx`` of the val loader at ``dataloader_idx``."""
        self._fire(trainer, event, **val_batch(self._val, dataloader_idx, batch_idx))

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
                self._saved_step = trainer.global_step
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
        """FIT_START with the train loader and every val loader known now, then RESUMED.

        Then rankguard catches the preemption signals, in place of the handlers Lightning
        registered in ``Trainer._run`` (its SIGTERM handler broadcasts from the signalled
        rank only: docs/hang.md#lightning-and-the-hf-trainer); they are back at close.
        """
        self._should_stop = self._steps_taken = self._saved_step = None
        train = train_loader(trainer)
        state_dict_type, switch, setting = checkpoint_format(trainer.strategy)
        self._fire(
            trainer,
            Event.FIT_START,
            loaders=fit_loaders(trainer, train),
            model=pl_module,
            optimizer=first_optimizer(trainer),
            data_parallel=data_parallel(trainer),
            directories=save_directories(trainer),
            state_dict_type=state_dict_type,
            switch_to_sharded=switch,
            sharded_setting=setting,
            upload_setting=UPLOAD_SETTING,
            decision_probe=functools.partial(split_decisions, trainer),
            split_decisions=SPLIT_DECISIONS,
            phases=PHASES,
        )
        # RESUMED here: Lightning restored the checkpoint and the loops' counters in `_run`, and
        # the train loaders' states in `fit_loop.setup_data()`, both before `on_train_start`, the
        # last hook before the first batch. On every fit: a rank that found no `last` (or SLURM's
        # `hpc`) starts fresh without knowing a resume was asked, so every rank checks.
        self._fire(trainer, Event.RESUMED, resume=resume_facts(trainer, train))
        self._stop = self.install_stop()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EPOCH_START with the train loader."""
        self._steps_taken = private.step_tracker(trainer)
        self._fire(trainer, Event.EPOCH_START, loader=train_loader(trainer))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """DATA_FETCH_END then TRAIN_BATCH_START, in the step log (the step read once)."""
        tracker = self._steps_taken
        steps = self.driver.steps
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
        """TRAIN_BATCH_END, then DATA_FETCH_START for the next batch; a preemption's stop.

        ``should_stop`` goes with the entry when it changed (the first batch's, then
        rarely): the hang watchdog keeps each decision with the step it last changed,
        and a dict a step is one more allocation on a cold cache.
        """
        tracker = self._steps_taken
        step = trainer.global_step if tracker is None else tracker.completed
        should_stop = trainer.should_stop
        if should_stop is self._should_stop:
            self.driver.steps.batch_end_fetch_start(step)
        else:
            self._should_stop = should_stop
            self.driver.steps.batch_end_fetch_start(step, {"should_stop": should_stop})
        stop = self._stop  # a preemption: every rank's fit ends after the agreed batch
        if stop is not None and stop.requested and stop.at_boundary(self.driver.steps.batches):
            trainer.should_stop = True
            self._stopped_epoch = trainer.current_epoch

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        """A backward starts (``manual_backward`` too), in the step log."""
        self.driver.steps.backward()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The backward ended, in the step log."""
        self.driver.steps.backward_end()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """The optimizer steps (its closure, the backward, ran), in the step log."""
        self.driver.steps.optimizer_step()

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
        self._fire_val_batch(trainer, Event.EVAL_BATCH_START, dataloader_idx, batch_idx)

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
        self._fire_val_batch(trainer, Event.EVAL_BATCH_END, dataloader_idx, batch_idx)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EVAL_END for every val loader (with ``should_stop``: early stopping decides here)."""
        stop = {"should_stop": bool(trainer.should_stop)}
        for loader in self._val:
            self._fire(trainer, Event.EVAL_END, loader=loader, decisions=stop)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """EPOCH_END with the train loader."""
        self._fire(trainer, Event.EPOCH_END, loader=train_loader(trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a preemption: the ``ModelCheckpoint``'s save at the agreed step, if it made none.

        Lightning ends the fit on ``should_stop`` through the epoch's end, where the
        ``ModelCheckpoint`` saves on its own schedule (every epoch by default); one set to
        save every N steps, or only after validation, saved nothing at the agreed step:
        its file for that step is written here, on every rank (``save_checkpoint`` is
        collective). ``save_last`` still writes ``last`` after this hook.
        """
        stop = self._stop
        if stop is None or stop.stopped is None or self._saved_step == trainer.global_step:
            return
        path = preemption_checkpoint(trainer, self._stopped_epoch)
        if path is not None:
            trainer.save_checkpoint(path)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """FIT_END."""
        self._fire(trainer, Event.FIT_END)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lets guards explain the error (e.g. a dead data worker), then stops them."""
        # Never raise from an exception hook, whatever state the trainer is in. Explained
        # wherever the trainer raised it: in the sanity check (before FIT_START) too.
        step, epoch = position(trainer)
        self.fail(exception, step, epoch, fitting=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stops every guard and unwraps checkpointing; safe to call twice.

        After a preemption the process exits with 75 when Python exits.
        """
        self.stop()
        stop, self._stop = self._stop, None
        exit_after_stop(stop, "your code that follows `trainer.fit(...)`")
