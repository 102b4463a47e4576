"""rankguard callbacks for MosaicML Composer.

Translation only: Composer events become rankguard core events (the table:
docs/design.md#events-the-training-loop-as-the-guards-see-it), and the facts the guards
need (train loader, each evaluator's loader and planned batch count) are read
from Composer's public ``State``.

Example::

    from composer import Trainer
    from rankguard.integrations.composer import RankGuard

    trainer = Trainer(..., callbacks=[RankGuard(hang_watchdog={"timeout_s": 300})])

Requires ``pip install 'rankguard[composer]'``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from rankguard.callbacks.batches.loader_passes import PassCounter
from rankguard.callbacks.checkpoint.plan import register_sharded_setting
from rankguard.callbacks.core.events import Event as CoreEvent
from rankguard.callbacks.core.events import EventFacts, LoaderFacts, ResumeFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.hang.metric_reductions import ReductionCheck, Rows, reduction_rows
from rankguard.integrations import _api
from rankguard.integrations._adapter import Adapter
from rankguard.integrations._common import metric_reduction_check, resolved_checkpoint

try:
    from composer.callbacks import CheckpointSaver
    from composer.core import Callback, Event, State
    from composer.loggers import Logger, RemoteUploaderDownloader
    from composer.utils import format_name_with_dist
    from torch.utils.data import DistributedSampler
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rankguard.integrations.composer needs Composer: pip install 'rankguard[composer]'"
    ) from exc
from rankguard.integrations.private.composer import (
    constructing_trainer,
    event_values,
    resume_request,
    trainer_load_path,
)

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

#: ``_EVENTS`` keyed by each member's ``id``: Composer calls ``run_event`` some 13 times a
#: batch, and its ``StringEnum`` hashes in Python (about 1 us a lookup, 0.2 us by ``id``).
_EVENTS_BY_ID: dict[int, CoreEvent] = {id(event): core for event, core in _EVENTS.items()}
#: The events of every train batch, tested by identity (``is``): Composer calls ``run_event``
#: some 13 times a batch, and an identity test against a module constant costs the least.
_BEFORE_DATALOADER = Event.BEFORE_DATALOADER
_AFTER_DATALOADER = Event.AFTER_DATALOADER
_BATCH_END = Event.BATCH_END
_BATCH_CHECKPOINT = Event.BATCH_CHECKPOINT
_INIT = Event.INIT
_BEFORE_LOAD = Event.BEFORE_LOAD
#: The value of each event of a train batch rankguard has nothing to do at (BATCH_START: it
#: is recorded with AFTER_DATALOADER), tested inline (``private.composer.event_values``): a
#: test that allocates nothing costs a third of one by ``id`` (a new int) in a cold call.
_QUIET = event_values(
    (
        Event.BATCH_START,
        Event.BEFORE_TRAIN_BATCH,
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    )
)
#: The event after a train batch's microbatches, before Composer reduces the loss per key.
_AFTER_TRAIN_BATCH = Event.AFTER_TRAIN_BATCH
#: The loss keys before a fit's first batch (no :func:`loss_keys` result equals it).
_UNSEEN = object()
#: Composer's loss reduction, in rankguard's message when ranks' loss keys differ.
LOSS_REDUCTION = "Composer's loss reduction (one all_reduce per loss key)"
#: What a user changes when the keys of the loss dict differ between ranks.
LOSS_FIX = (
    "return the same keys from the model's loss() on every rank and every batch (a zero "
    "tensor for a term a rank's batch has nothing for, e.g. torch.zeros((), device=...)); "
    "Composer all-reduces each key of the loss dict, in order, after every batch."
)
#: Composer events that start or end a fit.
_FIT_BOUNDS = (CoreEvent.FIT_START, CoreEvent.FIT_END)
RESUMED = CoreEvent.RESUMED

#: The event that starts a pass over a loader, by the event that ends it.
_PASS_ENDS = {CoreEvent.EVAL_END: CoreEvent.EVAL_START, CoreEvent.EPOCH_END: CoreEvent.EPOCH_START}
_PASS_END = {start: end for end, start in _PASS_ENDS.items()}

_EVAL_EVENTS = (
    CoreEvent.EVAL_START,
    CoreEvent.EVAL_BATCH_START,
    CoreEvent.EVAL_BATCH_END,
    CoreEvent.EVAL_END,
)


def _train_loader(state: State) -> LoaderFacts | None:
    loader = state.train_dataloader
    if loader is None:
        return None
    return LoaderFacts("train", loader, is_train=True, num_batches=_as_int(state.dataloader_len))


def _evaluator_loaders(state: State) -> list[LoaderFacts]:
    facts = []
    for evaluator in state.evaluators:
        loader = evaluator.dataloader.dataloader
        planned = None
        subset = evaluator.subset_num_batches
        if subset is not None and subset > 0:
            try:
                planned = min(subset, len(loader))
            except TypeError:
                planned = None
        facts.append(LoaderFacts(evaluator.label, loader, is_train=False, num_batches=planned))
    return facts


def _savers(state: State) -> list[CheckpointSaver]:
    return [cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)]


def save_directories(state: State) -> list[str]:
    """The local folders Composer's checkpoint savers write to (formatted per rank)."""
    return [format_name_with_dist(saver.folder, state.run_name) for saver in _savers(state)]


def checkpoint_uploads(state: State, logger: Logger) -> dict[str, str]:
    """The save folders whose checkpoints Composer also uploads, and where to.

    A remote ``save_folder`` (``s3://bucket/run``) makes the saver stage each
    checkpoint in a local temporary folder and upload it; a
    ``RemoteUploaderDownloader`` logger uploads what a saver with a
    ``remote_file_name`` saves.
    """
    remote = [d for d in logger.destinations if isinstance(d, RemoteUploaderDownloader)]
    uploads = {}
    for saver in _savers(state):
        folder = format_name_with_dist(saver.folder, state.run_name)
        if saver.remote_uploader is not None:
            uploads[folder] = str(saver.remote_uploader.remote_folder)
        elif saver.remote_file_name is not None and remote:
            uploads[folder] = f"{remote[0].remote_backend_name}://{remote[0].remote_bucket_name}"
    return uploads


#: Composer's remote checkpoint storage, named in rankguard's messages as the fix for
#: node-local checkpoint folders.
UPLOAD_SETTING = (
    "save to and resume from remote storage: Composer uploads every checkpoint with a remote "
    "`save_folder` (e.g. `save_folder='s3://bucket/run/checkpoints'`) and downloads on every "
    "node with a remote `load_path`"
)


#: How to resume every rank from one checkpoint, and keep each rank's data position, in Composer.
RESUME_FIX = (
    "give every node the same newest checkpoint: autoresume loads rank 0's "
    "`<save_folder>/latest-rank0.pt` as each node sees it, so save to remote storage (a remote "
    "`save_folder`, which Composer downloads on every node) or a folder every node mounts"
)
DATA_FIX = (
    "Composer saves the train dataset's `state_dict(num_samples, from_beginning)` of the rank "
    "that writes the checkpoint and loads it into every rank's dataset: return a state that "
    "holds for every rank (a global sample count, as StreamingDataset does)"
)


def dataset_positions(state: State) -> dict[str, Any]:
    """Composer's own train data position: what it saves as ``dataset_state['train']``."""
    method = getattr(getattr(state.train_dataloader, "dataset", None), "state_dict", None)
    if not callable(method):
        return {}
    try:  # a state_dict() without Composer's arguments is read by the guard itself
        return {"train dataset_state": method(int(state.timestamp.sample_in_epoch), True)}
    except TypeError:
        return {}


#: Composer's setting for sharded checkpoints (FSDP), named in rankguard's messages.
SHARDED_SETTING = "parallelism_config={'fsdp': {'state_dict_type': 'sharded'}}"
register_sharded_setting("Composer", SHARDED_SETTING)


def sharded_switch(state: State) -> Callable[[], str] | None:
    """How to make this job's later saves sharded, or ``None`` without FSDP.

    Composer reads ``fsdp_config.state_dict_type`` at every save, so changing it
    at FIT_START changes every save of this fit.
    """
    config = state.fsdp_config
    if config is None or not state.fsdp_enabled:
        return None

    def switch() -> str:
        config.state_dict_type = "sharded"
        return f"set Composer's {type(config).__name__}.state_dict_type to 'sharded'"

    return switch


def observe_pass(state: State) -> PassCounter | None:
    """Hands Composer a :class:`PassCounter` for the loader it iterates next, if it may.

    Called at ``EPOCH_START`` and ``EVAL_START``, after which Composer iterates
    ``state.dataloader`` (public: ``State.set_dataloader`` replaces it, with
    the same label and batch count). Composer stops every rank as soon as one
    runs out of data, so only the loader's own iterator tells a rank that ran
    out from one that still had data. A loader with a ``DistributedSampler``
    is left as it is: Composer looks for that sampler on a ``DataLoader`` (to
    set its epoch), and its batches are counted before the first batch anyway.

    Returns:
        The counter now in ``state.dataloader``, or ``None``.
    """
    loader = state.dataloader
    if not countable(loader):
        return None
    counter = PassCounter(loader)
    length = state.dataloader_len
    state.set_dataloader(counter, state.dataloader_label, -1 if length is None else int(length))
    return counter


def countable(loader: Any) -> bool:
    """Whether a :class:`PassCounter` may stand in for ``loader`` (see :func:`observe_pass`)."""
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


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


def event_facts(event: CoreEvent, state: State, logger: Logger) -> EventFacts:
    """Reads the facts a core event needs from Composer's ``State``."""
    timestamp = state.timestamp
    step, epoch = timestamp.batch.value, timestamp.epoch.value
    facts = EventFacts(step=step, epoch=epoch)
    if event is CoreEvent.CHECKPOINT_LOAD_START:
        facts.load_path = trainer_load_path()
        facts.upload_setting = UPLOAD_SETTING
    elif event is CoreEvent.FIT_START:
        train = _train_loader(state)
        facts.loaders = ([train] if train else []) + _evaluator_loaders(state)
        facts.model = state.model
        facts.optimizer = state.optimizers[0] if state.optimizers else None
        facts.directories = save_directories(state)
        facts.state_dict_type = state.fsdp_state_dict_type or "full"
        facts.switch_to_sharded = sharded_switch(state)
        facts.sharded_setting = SHARDED_SETTING
        facts.uploads = checkpoint_uploads(state, logger)
        facts.upload_setting = UPLOAD_SETTING
    elif event is CoreEvent.CHECKPOINT_SAVE_START:
        facts.model = state.model
        facts.directories = save_directories(state)
        facts.positions = dataset_positions(state)  # as saved
    elif event is CoreEvent.EPOCH_END:
        facts.epoch -= 1  # Composer counts the epoch as done before EPOCH_END
        facts.loader = _train_loader(state)
    elif event in (CoreEvent.EPOCH_START, CoreEvent.DATA_FETCH_START):
        # DATA_FETCH_START: Composer's window also holds an all_reduce over the ranks, so
        # the data-stall monitor times the loader's own return (see callbacks/data/data_fetch.py).
        facts.loader = _train_loader(state)
    elif event in _EVAL_EVENTS:
        loader = state.dataloader
        facts.loader = LoaderFacts(
            str(state.dataloader_label),
            loader.loader if isinstance(loader, PassCounter) else loader,
            is_train=False,
            num_batches=_as_int(state.dataloader_len),
        )
        # Composer counts the batch as done before EVAL_BATCH_END: it ran the one before.
        done = int(state.eval_timestamp.batch)
        facts.batch_index = done - 1 if event is CoreEvent.EVAL_BATCH_END else done
    return facts


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


class _ComposerAdapter(Adapter, Callback):
    """Drives the guards from Composer events (:class:`Adapter`: runner, driver, wrapped fit)."""

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

    def _train_facts(self, state: State) -> LoaderFacts | None:
        """The train loader's facts, built again only when Composer's loader or length changes."""
        loader, length = state.train_dataloader, state.dataloader_len
        cached_loader, cached_length, facts = self._train
        if loader is not cached_loader or length is not cached_length:
            facts = None
            if loader is not None:
                facts = LoaderFacts("train", loader, is_train=True, num_batches=_as_int(length))
            self._train = (loader, length, facts)
        return facts

    def _save_due(self, state: State, event: Event) -> bool:
        """Whether a checkpoint saver will save at this ``*_CHECKPOINT`` event.

        Composer fires BATCH_CHECKPOINT after every batch; a save happens only when
        a saver's ``save_interval`` says so. That scheduler only records the last
        batch it answered ``True`` for, so asking it first (rankguard runs before
        the savers, which Composer appends after user callbacks) does not change
        the saver's answer. The savers are read again only when the callback list
        changes.
        """
        callbacks = state.callbacks
        cached, count, savers = self._savers
        if callbacks is not cached or len(callbacks) != count:
            savers = _savers(state)
            self._savers = (callbacks, len(callbacks), savers)
        if not savers:  # most runs' BATCH_CHECKPOINT, every batch
            return False
        return any(saver.save_interval(state, event) for saver in savers)

    def run_event(
        self, event: Event, state: State, logger: Logger, _quiet: frozenset[str] = _QUIET
    ) -> None:
        """Translates a Composer event and dispatches it to the guards.

        ``_quiet`` is :data:`_QUIET`, a local here (a module global is one more cold
        cache line in each of Composer's some 13 calls a batch).
        """
        if event._value_ in _quiet:
            return
        if (
            event is _BATCH_END or event is _BEFORE_DATALOADER or event is _AFTER_DATALOADER
        ):  # the hot path, three times a step: the step log's clock read and append
            timestamp = state.timestamp
            if timestamp is not self._timestamp:  # Composer replaces it as time advances
                self._timestamp = timestamp
                self._step = timestamp.batch.value
            steps = self.runner.steps
            if event is _BATCH_END:
                steps.batch_end(self._step)
            elif event is _AFTER_DATALOADER:
                # The fetch ends and the batch starts: Composer fires BATCH_START next,
                # with nothing between them, so one entry holds both (see step_log.PAIRS).
                steps.fetch_end_batch_start(self._step, state.batch)
                if self._resume_due is not None:  # the fit's first BATCH_START: see _resumed
                    self._resumed(state)
            else:
                # The window also holds an all_reduce: the loader goes with it (see
                # callbacks/data/data_fetch.py), read again only when it may be watched.
                train = self._train[2]
                if train is None or steps.fetch_clock is not None:
                    train = self._train_facts(state)
                steps.fetch_start(self._step, train)
            return
        if event is _AFTER_TRAIN_BATCH:  # before Composer reduces the loss, key by key
            check = self._loss_check
            if check is not None:
                loss = state.loss
                keys = loss_keys(loss)
                if keys != self._loss_keys:
                    self._loss_keys = keys
                    check.check_changed(loss_rows(loss, self._step + 1))
            return
        if event is _BATCH_CHECKPOINT and not self._save_due(state, event):
            return  # every batch: a save only when a saver says so
        if event is _BEFORE_LOAD:
            self._resume = resume_request()
        core_event = _EVENTS_BY_ID.get(id(event))
        if core_event is None:  # Composer's other events: rankguard has no use for them
            if event is _INIT:
                self._hook_fit(state)
            return
        runner = self.runner
        if core_event is CoreEvent.CHECKPOINT_SAVE_START and not (
            runner.handlers[core_event]
            and (event is _BATCH_CHECKPOINT or self._save_due(state, event))
        ):
            return  # a save only when a guard handles it and a saver says so (asked above
            # for BATCH_CHECKPOINT, not twice)
        if core_event in _FIT_BOUNDS:
            self.driver.fitting = core_event is CoreEvent.FIT_START
            self._passes.clear()
            self._timestamp, self._train, self._savers = None, (None, None, None), (None, 0, [])
        if not self.runner.handles(core_event):
            return
        facts = event_facts(core_event, state, logger)
        if core_event is CoreEvent.CHECKPOINT_LOAD_START and facts.load_path is None:
            return
        if core_event in _PASS_ENDS:
            facts.loader_pass = self._pass_end(state, core_event)
        self.driver.dispatch(core_event, facts, logger.log_metrics)
        if core_event in _FIT_BOUNDS:
            self._loss_check, self._loss_keys = None, _UNSEEN
            self._resume_due = None
            if core_event is CoreEvent.FIT_START and self._resume and runner.handles(RESUMED):
                self._resume_due = dataset_positions(state)  # as loaded, before any batch
            if core_event is CoreEvent.FIT_START:
                self._loss_check = metric_reduction_check(
                    self.runner.guards, "composer_loss", where=LOSS_REDUCTION, fix=LOSS_FIX
                )
        if core_event in _PASS_ENDS.values() and self.runner.handles(_PASS_END[core_event]):
            original = state.dataloader
            counter = observe_pass(state)
            if counter is not None:
                self._passes[str(state.dataloader_label)] = (counter, original)

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
        self.watch_raise(trainer, "fit")

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

    def fail(
        self,
        exc: BaseException,
        step: int | None = None,
        epoch: int | None = None,
        *,
        fitting: bool | None = None,
    ) -> None:
        """An error left ``fit`` (wrapped at ``INIT``): the guards explain it, then stop.

        The step and epoch are the Trainer's; an error outside a fit leaves the guards
        as they are (:meth:`close` stops them).
        """
        if not (self.driver.fitting if fitting is None else fitting):
            return
        if step is None and self._state is not None:
            time = self._state.timestamp
            step, epoch = int(time.batch), int(time.epoch)
        super().fail(exc, step, epoch, fitting=True)

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


class RankGuard(_api.RankGuardSettings, _ComposerAdapter):
    """Every rankguard guard with sound defaults, as a Composer callback."""


class HangWatchdog(_api.HangWatchdogSettings, _ComposerAdapter):
    """The hang watchdog, as a Composer callback."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _ComposerAdapter):
    """The data consistency guard, as a Composer callback."""


class DropLastGuard(_api.DropLastGuardSettings, _ComposerAdapter):
    """The drop-last guard, as a Composer callback."""


class BatchParityGuard(_api.BatchParityGuardSettings, _ComposerAdapter):
    """The batch parity guard, as a Composer callback."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _ComposerAdapter):
    """The shared-directory barrier, as a Composer callback."""


class ResumeGuard(_api.ResumeGuardSettings, _ComposerAdapter):
    """The resume check, as a Composer callback."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _ComposerAdapter):
    """The checkpoint planner, as a Composer callback."""


class DataStallMonitor(_api.DataStallMonitorSettings, _ComposerAdapter):
    """The data stall monitor, as a Composer callback."""


class StragglerMonitor(_api.StragglerMonitorSettings, _ComposerAdapter):
    """The straggler monitor, as a Composer callback."""


__all__ = [*_api.CLASS_NAMES]
