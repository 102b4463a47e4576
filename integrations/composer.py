"""rankguard callbacks for MosaicML Composer.

Translation only: Composer events become rankguard core events (see
:mod:`rankguard.callbacks.events` for the table), and the facts the guards
need (train loader, each evaluator's loader and planned batch count) are read
from Composer's public ``State``.

Example::

    from composer import Trainer
    from rankguard.integrations.composer import RankGuard

    trainer = Trainer(..., callbacks=[RankGuard(hang_watchdog={"timeout_s": 300})])

Requires ``pip install 'rankguard[composer]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from rankguard.callbacks.events import Event as CoreEvent
from rankguard.callbacks.events import EventFacts, LoaderFacts
from rankguard.callbacks.guard import Guard, GuardRunner
from rankguard.integrations._common import bundle_guards, expose_signatures, single_guard

try:
    from composer.callbacks import CheckpointSaver
    from composer.core import Callback, Event, State
    from composer.loggers import Logger
    from composer.utils import format_name_with_dist
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rankguard.integrations.composer needs Composer: pip install 'rankguard[composer]'"
    ) from exc

__all__ = [
    "BatchParityGuard",
    "CheckpointPlanner",
    "DataConsistencyGuard",
    "DataStallMonitor",
    "DropLastGuard",
    "HangWatchdog",
    "RankGuard",
    "SharedDirBarrier",
]

_EVENTS: dict[Event, CoreEvent] = {
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
    Event.FIT_END: CoreEvent.FIT_END,
}

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


def save_due(state: State, event: Event) -> bool:
    """Whether a checkpoint saver will save at this ``*_CHECKPOINT`` event.

    Composer fires BATCH_CHECKPOINT after every batch; a save happens only when
    a saver's ``save_interval`` says so. That scheduler only records the last
    batch it answered ``True`` for, so asking it first (rankguard runs before
    the savers, which Composer appends after user callbacks) does not change
    the saver's answer.
    """
    return any(saver.save_interval(state, event) for saver in _savers(state))


#: Composer's setting for sharded checkpoints (FSDP), named in rankguard's messages.
SHARDED_SETTING = "parallelism_config={'fsdp': {'state_dict_type': 'sharded'}}"


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


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


def event_facts(event: CoreEvent, state: State) -> EventFacts:
    """Reads the facts a core event needs from Composer's ``State``."""
    timestamp = state.timestamp
    facts = EventFacts(step=int(timestamp.batch), epoch=int(timestamp.epoch))
    if event is CoreEvent.FIT_START:
        train = _train_loader(state)
        facts.loaders = ([train] if train else []) + _evaluator_loaders(state)
        facts.model = state.model
        facts.optimizer = state.optimizers[0] if state.optimizers else None
        facts.directories = save_directories(state)
        facts.state_dict_type = state.fsdp_state_dict_type or "full"
        facts.switch_to_sharded = sharded_switch(state)
        facts.sharded_setting = SHARDED_SETTING
    elif event is CoreEvent.CHECKPOINT_SAVE_START:
        facts.model = state.model
        facts.directories = save_directories(state)
    elif event in (CoreEvent.EPOCH_START, CoreEvent.DATA_FETCH_START):
        # DATA_FETCH_START: Composer's window also holds an all_reduce over the ranks, so
        # the data-stall monitor times the loader's own return (see callbacks/data_fetch.py).
        facts.loader = _train_loader(state)
    elif event in _EVAL_EVENTS:
        facts.loader = LoaderFacts(
            str(state.dataloader_label),
            state.dataloader,
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


class _ComposerAdapter(Callback):
    """Drives a :class:`GuardRunner` from Composer events."""

    def __init__(self, guards: list[Guard], exchange_timeout_s: float = 300.0) -> None:
        self.runner = GuardRunner(guards, exchange_timeout_s=exchange_timeout_s)
        self._fitting = False

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """Translates a Composer event and dispatches it to the guards."""
        if event in (Event.FIT_START, Event.FIT_END):
            self._fitting = event is Event.FIT_START
        core_event = _EVENTS.get(event)
        if core_event is None or not self.runner.handles(core_event):
            return
        if core_event is CoreEvent.CHECKPOINT_SAVE_START and not save_due(state, event):
            return
        self.runner.fire(core_event, event_facts(core_event, state), logger.log_metrics)

    def state_dict(self) -> dict[str, Any]:
        """The guards' state (the hang watchdog's calibration), saved in Composer checkpoints."""
        return self.runner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the guards' state when Composer loads a checkpoint (load_path, autoresume)."""
        self.runner.load_state_dict(state)

    def close(self, state: State, logger: Logger) -> None:
        """Lets guards explain an error that ended fit (a dead data worker), then stops them.

        Safe to call twice and after an exception.
        """
        del logger
        if self._fitting:  # fit started and did not end: an exception is ending the run
            self._fitting = False
            exc = escaping_exception()
            if exc is not None:
                timestamp = state.timestamp
                facts = EventFacts(step=int(timestamp.batch), epoch=int(timestamp.epoch))
                self.runner.error(exc, facts)
        self.runner.close()


class RankGuard(_ComposerAdapter):
    """Every rankguard guard with sound defaults, as one Composer callback.

    Args:
        exchange_timeout_s: How long a cross-rank check waits for every rank
            before naming the ones that did not arrive (seconds; grows by 5 ms
            per rank with the world size, see ``docs/scale.md``). The hang
            watchdog's own exchanges use its settings.
        **per_guard_config: Per guard, by snake-case name, a dict of its
            settings or ``False`` to leave it out, e.g.
            ``RankGuard(batch_parity_guard={"on_violation": "warn"}, drop_last_guard=False)``.
    """

    def __init__(
        self, exchange_timeout_s: float = 300.0, **per_guard_config: dict[str, Any] | bool
    ) -> None:
        super().__init__(bundle_guards(per_guard_config), exchange_timeout_s)


class BatchParityGuard(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.BatchParityGuard` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("batch_parity_guard", settings))


class DropLastGuard(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.DropLastGuard` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("drop_last_guard", settings))


class SharedDirBarrier(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.SharedDirBarrier` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("shared_dir_barrier", settings))


class CheckpointPlanner(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.CheckpointPlanner` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("checkpoint_planner", settings))


class HangWatchdog(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.HangWatchdog` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("hang_watchdog", settings))


class DataConsistencyGuard(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.DataConsistencyGuard` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("data_consistency_guard", settings))


class DataStallMonitor(_ComposerAdapter):
    """Composer callback for :class:`rankguard.callbacks.DataStallMonitor` (same arguments)."""

    def __init__(self, **settings: Any) -> None:
        super().__init__(single_guard("data_stall_monitor", settings))


expose_signatures(globals())
