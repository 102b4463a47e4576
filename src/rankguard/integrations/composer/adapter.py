"""The Composer adapter: Composer's events, as rankguard core events, drive the guards.

Its event table (``run_event``: each Composer event's row, found by its value
string; Composer calls it some 13 times a batch) and its hooks.
The facts each event needs are read in :mod:`.facts`; what they mean is
decided in :mod:`.decisions`. Every other module of the package is imported
after this one's Composer imports (the package's ``__init__`` imports it first),
so a missing Composer is named here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from composer.callbacks import CheckpointSaver
from composer.core import Callback, Event, State
from composer.loggers import Logger

from rankguard.callbacks.batches.loader_passes import PassCounter
from rankguard.callbacks.core.events import Event as CoreEvent
from rankguard.callbacks.core.events import EventFacts, LoaderFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.hang.metric_reductions import ReductionCheck
from rankguard.callbacks.hang.stop import StopAgreement
from rankguard.integrations._adapter import Adapter, exit_after_stop
from rankguard.integrations._common import (
    metric_reduction_check,
)
from rankguard.integrations.composer.decisions import (
    escaping_exception,
    loss_keys,
    loss_rows,
    resumed_from,
    saves_at,
    unsaved_at_stop,
)
from rankguard.integrations.composer.facts import (
    checkpoint_savers,
    dataset_positions,
    event_facts,
    observe_pass,
    train_loader_facts,
)
from rankguard.integrations.composer.messages import (
    DATA_FIX,
    LOSS_FIX,
    LOSS_REDUCTION,
    RESUME_FIX,
)
from rankguard.integrations.private.composer import (
    constructing_trainer,
    event_value,
    resume_request,
)

log = logging.getLogger(__name__)

_EVENTS: dict[Event, CoreEvent] = {
    Event.BEFORE_LOAD: CoreEvent.CHECKPOINT_LOAD_START,
    Event.FIT_START: CoreEvent.FIT_START,
    Event.EPOCH_START: CoreEvent.EPOCH_START,
    Event.BEFORE_DATALOADER: CoreEvent.DATA_FETCH_START,
    Event.AFTER_DATALOADER: CoreEvent.DATA_FETCH_END,
    Event.BATCH_START: CoreEvent.TRAIN_BATCH_START,
    Event.BATCH_END: CoreEvent.TRAIN_BATCH_END,
    Event.EVAL_START: CoreEvent.EVAL_START,
    Event.EVAL_BATCH_START: CoreEvent.EVAL_BATCH_START,
    Event.EVAL_BATCH_END: CoreEvent.EVAL_BATCH_END,
    Event.EVAL_END: CoreEvent.EVAL_END,
    Event.BATCH_CHECKPOINT: CoreEvent.CHECKPOINT_SAVE_START,
    Event.EPOCH_CHECKPOINT: CoreEvent.CHECKPOINT_SAVE_START,
    Event.EPOCH_END: CoreEvent.EPOCH_END,
    Event.FIT_END: CoreEvent.FIT_END,
}

#: The loss keys before a fit's first batch (no :func:`loss_keys` result equals it).
_UNSEEN = object()
#: Composer events that start or end a fit.
_FIT_BOUNDS = (CoreEvent.FIT_START, CoreEvent.FIT_END)
RESUMED = CoreEvent.RESUMED

#: The event that starts a pass over a loader, by the event that ends it.
_PASS_ENDS = {CoreEvent.EVAL_END: CoreEvent.EVAL_START, CoreEvent.EPOCH_END: CoreEvent.EPOCH_START}
_PASS_END = {start: end for end, start in _PASS_ENDS.items()}


class _ComposerAdapter(Adapter, Callback):
    """Drives the guards from Composer events (:class:`Adapter`: its driver, the wrapped fit)."""

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        super().__init__(guards, exchange_timeout_s)
        self._passes: dict[str, tuple[PassCounter, Any]] = {}
        #: The step, with the timestamp it was read from (Composer replaces it as time advances).
        self._timestamp: Any = None
        self._step = 0
        #: The train loader's facts, with the loader and batch count they were read from.
        self._train: tuple[Any, Any, LoaderFacts | None] = (None, None, None)
        #: Composer's checkpoint savers, with the callback list and length they were read from.
        self._savers: tuple[Any, int, list[CheckpointSaver]] = (None, 0, [])
        #: The loss keys' check while fitting (see :func:`loss_rows`), and the last keys seen.
        self._loss_check: ReductionCheck | None = None
        self._loss_keys: object = _UNSEEN
        self._state: State | None = None  # the state of the Trainer whose fit is wrapped
        #: How the Trainer asked for a resume (BEFORE_LOAD); its data position at FIT_START.
        self._resume: tuple[str, str | None] | None = None
        self._resume_due: dict[str, Any] | None = None
        #: The preemption agreement (from FIT_START, with a hang watchdog), and the batch
        #: count at FIT_START (the agreement counts the steps of this fit).
        self._stop: StopAgreement | None = None
        self._first_batch = 0
        self._table = self._event_table()

    def _train_facts(self, state: State) -> LoaderFacts | None:
        """The train loader's facts, built again only when Composer's loader or length changes."""
        loader, length = state.train_dataloader, state.dataloader_len
        cached_loader, cached_length, facts = self._train
        if loader is not cached_loader or length is not cached_length:
            facts = train_loader_facts(loader, length)
            self._train = (loader, length, facts)
        return facts

    def _save_due(self, state: State, event: Event) -> bool:
        """Whether a checkpoint saver will save at this ``*_CHECKPOINT`` event (:func:`saves_at`).

        Composer fires BATCH_CHECKPOINT after every batch. The savers are read again
        only when the callback list changes.
        """
        callbacks = state.callbacks
        cached, count, savers = self._savers
        if callbacks is not cached or len(callbacks) != count:
            savers = checkpoint_savers(state)
            self._savers = (callbacks, len(callbacks), savers)
        if not savers:  # most runs' BATCH_CHECKPOINT, every batch
            return False
        return saves_at(savers, state, event)

    def _event_table(self) -> dict[str, Callable[[Event, State, Logger], None]]:
        """What each Composer event does, by its value string; an event absent does nothing.

        The events of every train batch rankguard has no use for (BATCH_START is recorded
        with AFTER_DATALOADER; the forward and the loss) and Composer's events without a
        core event are absent, so they cost one lookup.
        """
        table: dict[Event, Callable[[Event, State, Logger], None]] = {
            event: self._core_event for event in _EVENTS
        }
        del table[Event.BATCH_START]
        table |= {
            Event.INIT: self._init,
            Event.BEFORE_DATALOADER: self._fetch_start,
            Event.AFTER_DATALOADER: self._fetch_end,
            Event.BATCH_END: self._batch_end,
            Event.BEFORE_BACKWARD: self._backward,
            Event.AFTER_BACKWARD: self._backward_end,
            Event.AFTER_TRAIN_BATCH: self._after_train_batch,
            Event.BATCH_CHECKPOINT: self._batch_checkpoint,
            Event.BEFORE_LOAD: self._before_load,
        }
        return {event_value(event): row for event, row in table.items()}

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """Translates a Composer event and dispatches it to the guards (its row of the table).

        Composer calls it some 13 times a batch: the row is found by the event's value
        string (``private.composer.EVENT_VALUE``), whose hash Composer has just computed.
        """
        row = self._table.get(event._value_)
        if row is not None:
            row(event, state, logger)

    # -- the rows of every train batch: the step log's clock read and one entry -----------

    def _step_of(self, state: State) -> int:
        """The batch count, read again only when Composer replaced its timestamp."""
        timestamp = state.timestamp
        if timestamp is not self._timestamp:
            self._timestamp = timestamp
            self._step = timestamp.batch.value
        return self._step

    def _fetch_start(self, event: Event, state: State, logger: Logger) -> None:
        # The window also holds an all_reduce: the loader goes with it (see
        # callbacks/data/data_fetch.py), read again only when it may be watched.
        steps = self.driver.steps
        train = self._train[2]
        if train is None or steps.fetch_clock is not None:
            train = self._train_facts(state)
        steps.fetch_start(self._step_of(state), train)

    def _fetch_end(self, event: Event, state: State, logger: Logger) -> None:
        # The fetch ends and the batch starts: Composer fires BATCH_START next, with
        # nothing between them, so one entry holds both (see step_log.PAIRS).
        self.driver.steps.fetch_end_batch_start(self._step_of(state), state.batch)
        if self._resume_due is not None:  # the fit's first BATCH_START: see _resumed
            self._resumed(state)

    def _batch_end(self, event: Event, state: State, logger: Logger) -> None:
        self.driver.steps.batch_end(self._step_of(state))
        stop = self._stop  # a preemption: every rank stops after the agreed step
        if stop is not None and stop.requested:
            self._stop_if_agreed(stop, state)

    def _backward(self, event: Event, state: State, logger: Logger) -> None:
        self.driver.steps.backward()  # each microbatch's

    def _backward_end(self, event: Event, state: State, logger: Logger) -> None:
        self.driver.steps.backward_end()

    def _after_train_batch(self, event: Event, state: State, logger: Logger) -> None:
        """The microbatches ran, the optimizer steps next; then Composer reduces the loss."""
        self.driver.steps.optimizer_step()
        check = self._loss_check
        if check is not None:
            loss = state.loss
            keys = loss_keys(loss)
            if keys != self._loss_keys:
                self._loss_keys = keys
                check.check_changed(loss_rows(loss, self._step + 1))

    def _batch_checkpoint(self, event: Event, state: State, logger: Logger) -> None:
        if self._save_due(state, event):  # every batch: a save only when a saver says so
            self._save(state, logger)

    # -- the rows of the fit's other events: a core event dispatched ----------------------

    def _init(self, event: Event, state: State, logger: Logger) -> None:
        self._hook_fit(state)

    def _before_load(self, event: Event, state: State, logger: Logger) -> None:
        self._resume = resume_request()
        self._core_event(event, state, logger)

    def _save(self, state: State, logger: Logger) -> None:
        """A checkpoint save a saver makes now, where a guard handles it."""
        if self.driver.handles(CoreEvent.CHECKPOINT_SAVE_START):
            self._dispatch(CoreEvent.CHECKPOINT_SAVE_START, state, logger)

    def _core_event(self, event: Event, state: State, logger: Logger) -> None:
        core_event = _EVENTS[event]
        if core_event is CoreEvent.CHECKPOINT_SAVE_START:  # EPOCH_CHECKPOINT
            if self._save_due(state, event):
                self._save(state, logger)
            return
        if core_event in _FIT_BOUNDS:
            self.driver.fitting = core_event is CoreEvent.FIT_START
            self._passes.clear()
            self._timestamp, self._train, self._savers = None, (None, None, None), (None, 0, [])
        if self.driver.handles(core_event):
            self._dispatch(core_event, state, logger)

    def _dispatch(self, core_event: CoreEvent, state: State, logger: Logger) -> None:
        """``core_event``'s facts to the guards, and what the adapter does around it."""
        driver = self.driver
        facts = event_facts(core_event, state, logger)
        if core_event is CoreEvent.CHECKPOINT_LOAD_START and facts.load_path is None:
            return
        if core_event in _PASS_ENDS:
            facts.loader_pass = self._pass_end(state, core_event)
        self.driver.dispatch(core_event, facts, logger.log_metrics)
        if core_event in _FIT_BOUNDS:
            self._loss_check, self._loss_keys = None, _UNSEEN
            self._resume_due = None
            if core_event is CoreEvent.FIT_START and self._resume and driver.handles(RESUMED):
                self._resume_due = dataset_positions(state)  # as loaded, before any batch
            if core_event is CoreEvent.FIT_START:
                self._loss_check = metric_reduction_check(
                    driver.guards, "composer_loss", where=LOSS_REDUCTION, fix=LOSS_FIX
                )
                self._first_batch = int(state.timestamp.batch)
                self._stop = self.install_stop()  # Composer sets its own at import
            elif self._stop is not None and self._stop.stopped is not None:
                self._warn_unsaved(state)
        if core_event in _PASS_ENDS.values() and driver.handles(_PASS_END[core_event]):
            original = state.dataloader
            counter = observe_pass(state)
            if counter is not None:
                self._passes[str(state.dataloader_label)] = (counter, original)

    def _stop_if_agreed(self, stop: StopAgreement, state: State) -> None:
        """At BATCH_END once a stop was asked: at the agreed step, every rank stops training.

        ``state.stop_training()`` ends the fit after this batch; its BATCH_CHECKPOINT then
        counts as the end of training, where a ``CheckpointSaver`` saves (the default
        ``save_interval`` includes it); the process exits with 75 when Python exits.
        """
        if stop.stopped is None and stop.at_boundary(self._step - self._first_batch):
            state.stop_training()
            exit_after_stop(stop, "the checkpoint savers' last save and the code after fit()")

    def _warn_unsaved(self, state: State) -> None:
        """At FIT_END after an agreed stop: names the savers that did not save its last batch."""
        unsaved = unsaved_at_stop(checkpoint_savers(state), int(state.timestamp.batch))
        if unsaved:
            log.warning(
                "rankguard hang_watchdog: preempted, and the CheckpointSaver(s) saving to %s did "
                "not save the last batch (%d): their `save_interval` does not include the end of "
                "training (a time string such as '100ba' does); the restart resumes from an "
                "earlier checkpoint",
                ", ".join(repr(str(saver.folder)) for saver in unsaved),
                int(state.timestamp.batch),
            )

    def _resumed(self, state: State) -> None:
        """RESUMED, once per fit that resumes, on every rank, at its first BATCH_START.

        ``Trainer.__init__`` loaded the checkpoint (``state.load_path``); ``_train_loop``
        restores the random state after FIT_START, at once where ``batch_in_epoch == 0``,
        else while spinning the loader to the resumed batch, before that batch is fetched
        (composer/trainer/trainer.py, 0.32: ``_train_loop``). Composer fires BATCH_START
        right after this AFTER_DATALOADER: the first point where all of it is in place.
        """
        (asked, folder), positions = self._resume or ("", None), self._resume_due or {}
        self._resume = self._resume_due = None  # once: a later fit() of this Trainer goes on
        time = state.timestamp
        loaded, folder = resumed_from(state.load_path, folder, state.run_name)
        counters = {
            c: int(getattr(time, c)) for c in ("epoch", "batch", "batch_in_epoch", "sample")
        }
        facts = ResumeFacts(asked, loaded, counters, state.train_dataloader, positions, folder)
        facts.restores_rng, facts.fix, facts.data_fix = True, RESUME_FIX, DATA_FIX
        self.driver.dispatch(RESUMED, EventFacts(step=int(time.batch), resume=facts))

    def _hook_fit(self, state: State) -> None:
        """At ``INIT``: an error that leaves the Trainer's ``fit`` reaches the guards there.

        That is before the caller's ``finally`` (``trainer.close()``, a teardown that may wait).
        """
        trainer = constructing_trainer()
        if trainer is None:
            return
        self.unwrap()
        self._state = state
        self.watch_raise(trainer, "fit", self._fit_raised)

    def _pass_end(self, state: State, event: CoreEvent) -> Any:
        """What the pass that ends now did; puts the train loader back at its epoch end."""
        counter, original = self._passes.pop(str(state.dataloader_label), (None, None))
        if counter is None:
            return None
        if event is CoreEvent.EPOCH_END and state.dataloader is counter:
            length = state.dataloader_len
            label = state.dataloader_label
            state.set_dataloader(original, label, -1 if length is None else int(length))
        return counter.result()

    def _fit_raised(self, exc: BaseException) -> None:
        """An error left ``fit`` (wrapped at ``INIT``): the guards explain it, then stop.

        The step and epoch are the Trainer's; an error outside a fit leaves the guards
        as they are (:meth:`close` stops them).
        """
        if self.driver.fitting and self._state is not None:
            time = self._state.timestamp
            self.fail(exc, int(time.batch), int(time.epoch))

    def close(self, state: State, logger: Logger) -> None:
        """Lets guards explain an error that ended fit (a dead data worker), then stops them.

        Safe to call twice and after an exception.
        """
        del logger
        exc = escaping_exception() if self.driver.fitting else None
        if exc is None:
            self.stop()
        else:  # fit started and did not end: an exception is ending the run
            self.unwrap()
            time = state.timestamp
            self.fail(exc, int(time.batch), int(time.epoch))
