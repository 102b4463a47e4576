"""Core events in the documented order, from adapters that see the training loop point by point.

Composer and Lightning announce every point of the loop themselves. A
hand-written loop (wrapped by :mod:`rankguard.integrations.torch`) and the
Hugging Face Trainer's callback hooks do not: a train batch's end is known only
when the next fetch, eval or save starts, and the Trainer has no hook when it
starts fetching. :class:`EventDriver` takes what the adapter knows, fills in the
ends the loop cannot announce, and fires each core event with the step and
epoch, in the order
docs/design.md#events-the-training-loop-as-the-guards-see-it documents:

* a train batch ends (TRAIN_BATCH_END) at the next fetch, epoch start or end,
  eval start, save start or fit end, whichever comes first;
* a fetch window (DATA_FETCH_START) opens once, however many times the adapter
  says so, and an eval, epoch start or epoch end abandons a window that was open;
* evaluations may announce several loaders at once (Lightning and the Trainer
  start every eval loader together), and end one at a time.

The driver checks its own invariants (``RuntimeError``); the adapters check
their users' calls and name them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from rankguard.callbacks.core.events import (
    Event,
    EventFacts,
    LoaderFacts,
    LoaderPass,
    ResumeFacts,
)
from rankguard.callbacks.core.guard import Guard, GuardRunner, MetricSink

__all__ = ["EventDriver", "inspection_limits"]

logger = logging.getLogger(__name__)


def inspection_limits(facts: LoaderFacts) -> str | None:
    """What the guards cannot read from a loader, or ``None`` if it is fully inspectable.

    A loader without ``__len__`` (an iterable, a generator) has no planned batch
    count; one that is neither a ``DataLoader`` nor a dataset has no dataset to
    fingerprint.
    """
    from rankguard.callbacks.data.fingerprint import loader_dataset

    limits = []
    if facts.num_batches is None:
        try:
            len(facts.loader)
        except (TypeError, NotImplementedError):
            limits.append("no __len__: batch counts are compared only after each eval")
    if loader_dataset(facts.loader) is None:
        limits.append("no dataset: its data is not fingerprinted")
    return "; ".join(limits) or None


class EventDriver:
    """Fires core events on a :class:`GuardRunner` in order, filling in the implied ones.

    Args:
        runner: The guards' runner.
        log_metrics: Where the guards' metrics go.

    The one door through which an adapter reaches the guards: the events, the step log,
    the guards themselves (to find one), their state and their close.

    Attributes:
        steps: The step log, where an adapter's hooks write a step's parts (a batch's
            start and end, a backward pass, an optimizer step): the hot path.
        step: Train batches ended so far in this fit (the index of the next one).
        epoch: The current epoch, from 0 (-1 before the first).
        fitting: Between :meth:`fit_start` and :meth:`fit_end` / :meth:`abandon`.
        saving: Between :meth:`save_start` and :meth:`save_end`.
        evals: The eval loaders started and not yet ended, in order.
        eval_batches: Eval batches started of ``evals[0]``.
        batch_open: Whether a train batch started and has not ended.
        fetching: Whether a fetch window is open. The usual step goes from a fetch
            (``fetching``, no ``batch_open``) to a batch and back, one step-log entry
            each (:meth:`fetch_end_batch_start`'s and :meth:`fetch_start`'s first branches);
            an adapter whose hook runs on a cold cache may make those moves itself, the
            two flags and then the step log's paired entry (the HF Trainer's does).
    """

    def __init__(self, runner: GuardRunner, log_metrics: MetricSink | None = None) -> None:
        self.runner = runner
        self.log_metrics = log_metrics
        self.steps = runner.steps  # where a step's parts go: the hot path
        self.fitting = False
        self._reset()
        self._noted: set[str] = set()

    def _reset(self) -> None:
        self.step = 0
        self.epoch = -1
        self.saving = False
        self.evals: list[LoaderFacts] = []
        self.eval_batches = 0
        self.batch_open = False
        self._eval_batch_open = False
        self.fetching = False

    @property
    def guards(self) -> tuple[Guard, ...]:
        """The guards, in run order (an adapter looks one up: the stop agreement, a check)."""
        return tuple(self.runner.guards)

    def handles(self, event: Event) -> bool:
        """Whether a guard handles ``event`` (an adapter skips reading its facts if not)."""
        return self.runner.handles(event)

    def close(self) -> None:
        """Stops every guard; safe to call twice."""
        self.runner.close()

    def state_dict(self) -> dict[str, Any]:
        """The guards' state (plain values) to save with a checkpoint."""
        return self.runner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Gives the guards what :meth:`state_dict` saved."""
        self.runner.load_state_dict(state)

    def fire(self, event: Event, **facts: Any) -> None:
        """Fires ``event`` with the current step and epoch and ``facts``."""
        if self.runner.handles(event):
            event_facts = EventFacts(step=self.step, epoch=max(self.epoch, 0), **facts)
            self.runner.fire(event, event_facts, self.log_metrics)

    def dispatch(
        self, event: Event, facts: EventFacts, log_metrics: MetricSink | None = None
    ) -> None:
        """Fires ``event`` with facts the adapter read itself (a framework that announces each).

        FIT_START and FIT_END open and close the fit as :meth:`fit_start` and
        :meth:`fit_end` do; ``log_metrics`` defaults to the driver's sink.
        """
        if event is Event.FIT_START:
            self._reset()
            self.fitting = True
        elif event is Event.FIT_END:
            self.fitting = False
        if self.runner.handles(event):
            self.runner.fire(event, facts, log_metrics or self.log_metrics)

    def note_limits(self, loaders: Iterable[LoaderFacts]) -> None:
        """Says once per loader name, at INFO, what the guards cannot read from it."""
        for facts in loaders:
            limits = inspection_limits(facts)
            if limits and facts.name not in self._noted:
                self._noted.add(facts.name)
                logger.info(
                    "rankguard: loader %r (%s) is checked as far as it can be: %s",
                    facts.name,
                    type(facts.loader).__name__,
                    limits,
                )

    # -- fit -----------------------------------------------------------------------------

    def fit_start(self, **facts: Any) -> None:
        """FIT_START with ``facts`` (loaders, model, optimizer, directories, ...)."""
        if self.fitting:
            raise RuntimeError("rankguard: FIT_START while a fit is running (expected FIT_END)")
        self._reset()
        self.fitting = True
        self.note_limits(facts.get("loaders", ()))
        self.fire(Event.FIT_START, **facts)

    def fit_end(self) -> None:
        """Ends what is open, then FIT_END."""
        self.end_train_batch()
        self.fitting = False
        self.fire(Event.FIT_END)

    def abandon(
        self, exc: BaseException | None = None, step: int | None = None, epoch: int | None = None
    ) -> None:
        """Ends the fit without FIT_END (an error, or a framework restarting its loop).

        Guards that explain errors see ``exc`` first, at ``step`` and ``epoch`` (default:
        the driver's); then every guard stops. The one place of that sequence.
        """
        self.fitting = False
        try:
            if exc is not None:
                facts = EventFacts(
                    step=self.step if step is None else int(step),
                    epoch=max(self.epoch, 0) if epoch is None else int(epoch),
                )
                self.runner.error(exc, facts)
        finally:
            self.runner.close()

    # -- train -------------------------------------------------------------------------

    def epoch_start(self, loader: LoaderFacts | None) -> None:
        """EPOCH_START; a fetch window open before it is abandoned."""
        self.end_train_batch()
        self.fetching = False
        self.epoch += 1
        self.fire(Event.EPOCH_START, loader=loader)

    def epoch_end(self, loader: LoaderFacts | None, loader_pass: LoaderPass | None = None) -> None:
        """EPOCH_END of the current epoch (its last train batch ends; a fetch window is dropped)."""
        self.end_train_batch()
        self.fetching = False
        self.fire(Event.EPOCH_END, loader=loader, loader_pass=loader_pass)

    def fetch_start(self) -> None:
        """DATA_FETCH_START, once per fetch (ends the train batch before it)."""
        if self.batch_open:
            if not self.fetching:  # the usual step: its end and the next fetch in one entry
                self.batch_open, self.fetching = False, True
                self.step = step = self.step + 1
                self.steps.batch_end_fetch_start(step - 1, fetch_step=step)
                return
            self.end_train_batch()
        if not self.fetching:
            self.fetching = True
            self.steps.fetch_start(self.step)

    def fetch_end(self) -> None:
        """DATA_FETCH_END (a window nobody opened opens here, empty)."""
        if self.batch_open or not self.fetching:
            self.fetch_start()
        self.fetching = False
        self.steps.fetch_end(self.step)

    def fetch_end_batch_start(self, batch: Any = None) -> None:
        """DATA_FETCH_END (as :meth:`fetch_end`), then TRAIN_BATCH_START.

        ``batch``: the batch, where the adapter has it (the guards that read the first
        train batches get it through the step log's ``batch_probe``).
        """
        if self.fetching and not self.batch_open:  # the usual step (train_batch_start's too)
            self.fetching, self.batch_open = False, True
            self.steps.fetch_end_batch_start(self.step, batch)
            return
        self.fetch_end()  # no fetch open: it opens here, empty
        self.train_batch_start(batch)

    def train_batch_start(self, batch: Any = None) -> None:
        """TRAIN_BATCH_START of batch :attr:`step`; an open fetch ends first.

        ``batch``: as :meth:`fetch_end_batch_start`'s.
        """
        if self.fetching and not self.batch_open:  # the usual step: both in one entry
            self.fetching, self.batch_open = False, True
            self.steps.fetch_end_batch_start(self.step, batch)
            return
        if self.fetching:
            self.fetch_end()
        self.batch_open = True
        self.steps.batch_start(self.step, batch)

    def end_train_batch(self) -> None:
        """TRAIN_BATCH_END of the open train batch, if one is open."""
        if self.batch_open:
            self.batch_open = False
            self.steps.batch_end(self.step)
            self.step += 1

    # -- eval --------------------------------------------------------------------------

    def eval_start(self, loaders: list[LoaderFacts]) -> None:
        """EVAL_START of each loader (before its first batch); they end one at a time."""
        if self.evals:
            raise RuntimeError("rankguard: EVAL_START while an eval is running (expected EVAL_END)")
        self.end_train_batch()
        self.fetching = False
        self.evals = list(loaders)
        self.eval_batches = 0
        self._eval_batch_open = False
        self.note_limits(loaders)
        for facts in self.evals:
            self.fire(Event.EVAL_START, loader=facts)

    def eval_batch_start(self) -> None:
        """EVAL_BATCH_START of the next batch of the current eval loader."""
        self._eval_batch_open = True
        self.fire(Event.EVAL_BATCH_START, loader=self.evals[0], batch_index=self.eval_batches)

    def eval_batch_end(self) -> None:
        """EVAL_BATCH_END of the current eval batch."""
        self._eval_batch_open = False
        self.fire(Event.EVAL_BATCH_END, loader=self.evals[0], batch_index=self.eval_batches)
        self.eval_batches += 1

    def eval_end(
        self, loader_pass: LoaderPass | None = None, planned: int | None = None
    ) -> LoaderFacts:
        """EVAL_END of the current eval loader, with what its pass did if seen; returns it.

        ``planned``: the batches that stand for its plan where the loop left it early.
        """
        if not self.evals:
            raise RuntimeError("rankguard: EVAL_END without EVAL_START")
        if planned is not None:  # the open batch's end carries the plan too
            facts = self.evals[0]
            self.evals[0] = LoaderFacts(facts.name, facts.loader, facts.is_train, planned)
        if self._eval_batch_open:
            self.eval_batch_end()
        facts = self.evals.pop(0)
        self.eval_batches = 0
        self.fire(Event.EVAL_END, loader=facts, loader_pass=loader_pass)
        return facts

    # -- checkpoint --------------------------------------------------------------------

    def load_start(self, load_path: str, upload_setting: str | None = None) -> None:
        """CHECKPOINT_LOAD_START before ``load_path`` is read (before the fit, or during it)."""
        if not self.fitting:  # a resume: no step of an earlier fit applies
            self._reset()
        self.fire(Event.CHECKPOINT_LOAD_START, load_path=load_path, upload_setting=upload_setting)

    def resumed(self, resume: ResumeFacts) -> None:
        """RESUMED: the resumed state is in place, before the first train batch of the fit."""
        self.fire(Event.RESUMED, resume=resume)

    def save_start(
        self,
        directories: list[str],
        model: Any = None,
        positions: dict[str, Any] | None = None,
    ) -> None:
        """CHECKPOINT_SAVE_START before a save into ``directories``.

        ``positions``: data positions the framework holds beside the train loader.
        """
        if self.saving:
            raise RuntimeError("rankguard: CHECKPOINT_SAVE_START during a save")
        self.end_train_batch()
        self.fetching = False
        self.saving = True
        try:
            self.fire(
                Event.CHECKPOINT_SAVE_START,
                directories=list(directories),
                model=model,
                positions=positions or {},
            )
        except BaseException:  # a guard stopped the save before it started
            self.saving = False
            raise

    def save_end(self, saved: bool = True) -> None:
        """CHECKPOINT_SAVE_END; ``saved=False``: the save failed, and ends without it."""
        self.saving = False
        if saved:
            self.fire(Event.CHECKPOINT_SAVE_END)
