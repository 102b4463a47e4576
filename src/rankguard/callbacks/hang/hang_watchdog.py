"""HangWatchdog: names the rank that stopped, where, with its stack, within a minute by default.

The guard's settings and events; its reading of the heartbeats is ``heartbeats``, its thread
``watchdog_thread``, the decisions beside it.
See docs/hang.md#how-hangwatchdog-works.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rankguard.callbacks.core.errors import (
    HangDetectedError,
    MetricMismatchError,
    RanksMissingError,
)
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.guard import Guard, MetricSink
from rankguard.callbacks.core.settings import (
    check_choice,
    check_int,
    check_positive,
    check_seconds,
)
from rankguard.callbacks.core.side_channel import SideChannel, own_missing_ranks
from rankguard.callbacks.core.step_log import Entry, StepLog
from rankguard.callbacks.hang.calibration import (
    KIND_LABELS,
    MIN_SAMPLES,
    IntervalHistory,
    save_estimate_s,
)
from rankguard.callbacks.hang.deadlines import DEFAULT_DEADLINES
from rankguard.callbacks.hang.heartbeats import HeartbeatReader
from rankguard.callbacks.hang.incident_state import IncidentState
from rankguard.callbacks.hang.job import RESTART_ENV, attempt_dir, process_group_timeout
from rankguard.callbacks.hang.metric_reductions import ReductionCheck
from rankguard.callbacks.hang.phases import Beat, ClosestCall, Decision
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, HANG_EXIT_CODE
from rankguard.callbacks.hang.stop import StopAgreement, check_signals
from rankguard.callbacks.hang.verdict_text import NAMES_DECISION
from rankguard.callbacks.hang.watchdog_settings import DEFAULT_PERIOD_S, FITTED, WatchdogSettings
from rankguard.callbacks.hang.watchdog_thread import CONFIRM_AFTER_S as CONFIRM_AFTER_S
from rankguard.callbacks.hang.watchdog_thread import PROBE_PERIOD_S as PROBE_PERIOD_S
from rankguard.callbacks.hang.watchdog_thread import READ_PERIOD_S as READ_PERIOD_S
from rankguard.callbacks.hang.watchdog_thread import WatchdogThread

__all__ = [
    "DEADLOCK_EXIT_CODE",
    "HANG_EXIT_CODE",
    "RESTART_ENV",
    "HangWatchdog",
    "attempt_dir",
    "process_group_timeout",
]

# The name users filter by and recorded outputs show, kept when the module moved
# (watchdog_thread.py logs through it too).
logger = logging.getLogger("rankguard.callbacks.hang_watchdog")


#: Looks at a ``report_dir`` that seems not writable, this far apart (seconds): another
#: rank on the node may be making or removing the folder as this one looks.
REPORT_DIR_LOOKS = (0.0, 0.05, 0.2)


def _unwritable_above(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` that is there and not writable, else ``None``.

    A folder that is not there (any more) is the folder above's to decide; one that
    is there is looked at twice before it is blamed.
    """

    def writable(folder: Path) -> bool:
        return os.access(folder, os.W_OK | os.X_OK) and folder.is_dir()

    for folder in (path, *path.parents):
        if writable(folder):
            return None
        if folder.exists() and not writable(folder):
            return folder
    return path  # not even the root folder was there


def _check_report_dir(report_dir: Any) -> str:
    if not isinstance(report_dir, str | os.PathLike) or not str(report_dir):
        raise ValueError(f"`report_dir` must be a directory path; got {report_dir!r}.")
    path = Path(report_dir).absolute()
    for pause in REPORT_DIR_LOOKS:
        time.sleep(pause)
        blamed = _unwritable_above(path)
        if blamed is None:
            return str(report_dir)
    raise ValueError(f"`report_dir` {str(report_dir)!r} is not writable (checked {blamed}).")


def _num_params(model: Any) -> int | None:
    try:
        return sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError, RuntimeError):
        return None


def _heartbeat_handler(event: Event) -> Callable[[HangWatchdog, EventFacts], None]:
    """The ``on_<event>`` handler of an event the watchdog only records a heartbeat for."""

    def handler(self: HangWatchdog, facts: EventFacts) -> None:
        self._heartbeat(event, facts)

    handler.__name__ = handler.__qualname__ = f"on_{event.value}"
    handler.__doc__ = "Records a heartbeat."
    return handler


class HangWatchdog(Guard):
    """Reports which ranks stopped making progress, where, and their Python stacks.

    Each phase has a deadline, calibrated from the intervals this rank has seen
    in it, and a ceiling, the deadline argument of its phase. Past the calibrated
    deadline every rank logs the verdict (``logging.WARNING``) and writes its
    stacks; training goes on (stage 1). Past the ceiling, or when a rankguard check
    gives up waiting for a rank, every rank reports again (``logging.ERROR``) and
    with ``action="abort"`` exits with :data:`HANG_EXIT_CODE` (stage 2). A proven
    deadlock (every rank waits at a rendezvous, not all at one) ends the job at once
    with :data:`DEADLOCK_EXIT_CODE`. Under NCCL, ceilings left at their default fit
    inside the process group's timeout. The calibration is saved with checkpoints
    (:meth:`state_dict`). How and why: docs/hang.md#the-verdict,
    docs/hang.md#proven-deadlocks-code-paths-that-split-the-ranks,
    docs/hang.md#calibrated-deadlines-the-numbers-and-why.

    Args:
        timeout_s: Ceiling of train steps and data fetches (seconds; default 600).
        eval_timeout_s: Ceiling of eval phases (default 600).
        post_eval_timeout_s: Ceiling from eval end back to the train loop (default 600).
        checkpoint_timeout_s: Ceiling of a checkpoint save (default 1800).
        first_step_timeout_s: Deadline of everything before the first train batch ends.
        action: ``"abort"`` (stage 2 exits with :data:`HANG_EXIT_CODE`) or
            ``"report"`` (stage 2 reports again and keeps waiting).
        abort_at: ``"ceiling"`` (default: report at the calibrated deadline,
            abort at the ceiling) or ``"calibrated"`` (abort at the calibrated deadline).
        report_dir: Directory for the report files; must be writable.
        exchange_period_s: Time between status exchanges: a stuck rank is reported
            within its deadline + ``exchange_period_s``. The default, 10 s, grows with
            the world beyond 2,560 ranks (``world_size / 256`` s: 64 s at 16,384), so that
            every rank's exchange asks the job's store for a bounded rate (docs/scale.md).
        auto_calibrate: Calibrate deadlines below the ceilings (else each
            phase's deadline is its ceiling: one stage).
        warmup_steps: Train steps before intervals are recorded.
        calibration_factor: A deadline is at least this multiple of the 99th
            percentile of its phase's recent intervals (> 1).
        floor_s: Lowest calibrated deadline.
        deadlock_action: ``"abort"`` (a proven deadlock ends the job at once with
            :data:`DEADLOCK_EXIT_CODE`) or ``"report"`` (report it, keep the two stages).
        deadlock_after_s: How long a rank's loop must wait at one rendezvous
            before it counts toward a deadlock.
        collective_mismatch: Ranks that paired different collectives at one count:
            ``"warn"`` (a WARNING, once each) or ``"abort"`` (exit as a proven deadlock).
        check_metric_reductions: Compare the metric names every rank is about to reduce
            before a framework reduces them by name (OLMo-core's flush, Composer's loss).
        teardown_timeout_s: A rank whose training raised tells the others at once
            (they end within seconds); if its own process is still running this long
            after (a teardown that waits for a peer), it is ended with the fault's exit
            code (docs/hang.md#a-rank-that-raises-or-dies). ``0`` turns the bound off.
        stop_signals: Signal names that preempt the job (``[]``: none): every rank
            stops after one agreed train step, then exits with :data:`HANG_EXIT_CODE`
            (docs/hang.md#preemption-every-rank-stops-at-one-step).
        stop_grace_s: How long a rank waits for the agreed step once it knows of the
            preemption; past it, it stops where it is (default 20, under torchelastic's
            30 s from SIGTERM to SIGKILL).

    Raises:
        ValueError: A setting out of range, or a ``report_dir`` that is not writable.
        MetricMismatchError: Ranks would reduce different metrics in one collective
            (``check_metric_reductions``).
        HangDetectedError: A rankguard check gave up waiting for a rank while the
            watchdog runs, with ``action`` other than ``"abort"`` (which exits with
            :data:`HANG_EXIT_CODE`, or :data:`DEADLOCK_EXIT_CODE` for a proven deadlock).

    Attributes:
        exchange_timeout_s: How long rank 0 waits for every rank's status,
            ``max(2, exchange_period_s)``.
        incidents: Incidents reported by this rank so far.
        ceilings_reached: Incidents that reached stage 2 on this rank.
        last_incident: The last report as a :class:`HangDetectedError` (its
            message is the logged report), or ``None``.
        history: The intervals seen per phase, which calibrate the deadlines.
        closest_call: The healthy interval closest to its deadline since fit
            start: a :class:`ClosestCall` ``(share of the deadline, kind, seconds,
            deadline)``, or ``None``.
        stop_agreement: The preemption agreed across ranks (its ``stopped`` says
            where and why this rank stopped). An adapter whose loop stops on it calls its
            ``install()`` at fit start and reads its ``requested`` at each step boundary;
            under the others the signals keep their own handlers.

    Metrics: none (the verdict comes from a background thread; framework
    loggers are not thread-safe). Exit code: :data:`HANG_EXIT_CODE`. Files:
    see :mod:`rankguard.callbacks.hang.report`.

    Example::

        watchdog = HangWatchdog(timeout_s=300, post_eval_timeout_s=120, action="abort")
        # log: rank 1 stuck 31 s in after eval of 'eval' (deadline 30 s, calibrated;
        #      ceiling 120 s); ranks 0,2,3 waiting 29 s in train batch 2001
    """

    name = "hang_watchdog"
    #: It reads a batch's parts where the adapter announces them (its history).
    reads_phases = True
    tells_peers_on_error = True
    step_events = (
        Event.DATA_FETCH_START,
        Event.DATA_FETCH_END,
        Event.TRAIN_BATCH_START,
        Event.TRAIN_BATCH_END,
    )

    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        eval_timeout_s: float | None = None,
        post_eval_timeout_s: float | None = None,
        checkpoint_timeout_s: float | None = None,
        first_step_timeout_s: float = 1800.0,
        action: str = "abort",
        abort_at: str = "ceiling",
        report_dir: str = "./rankguard_reports",
        exchange_period_s: float = DEFAULT_PERIOD_S,
        auto_calibrate: bool = True,
        warmup_steps: int = 10,
        calibration_factor: float = 10.0,
        floor_s: float = 30.0,
        deadlock_action: str = "abort",
        deadlock_after_s: float = 3.0,
        collective_mismatch: str = "warn",
        check_metric_reductions: bool = True,
        teardown_timeout_s: float = 30.0,
        stop_signals: list[str] | tuple[str, ...] = ("SIGTERM",),
        stop_grace_s: float = 20.0,
    ) -> None:
        given = {
            "timeout_s": timeout_s,
            "eval_timeout_s": eval_timeout_s,
            "post_eval_timeout_s": post_eval_timeout_s,
            "checkpoint_timeout_s": checkpoint_timeout_s,
        }
        #: Ceiling arguments left at their default, which fit under NCCL's timeout.
        self.defaulted = {name for name, value in given.items() if value is None}
        for name, value in given.items():
            value = DEFAULT_DEADLINES[name] if value is None else check_positive(name, value)
            setattr(self, name, value)
        self.first_step_timeout_s = check_positive("first_step_timeout_s", first_step_timeout_s)
        self.action = check_choice("action", action, ("abort", "report"))
        self.abort_at = check_choice("abort_at", abort_at, ("ceiling", "calibrated"))
        self.report_dir = _check_report_dir(report_dir)
        self.exchange_period_s = check_positive("exchange_period_s", exchange_period_s)
        self.auto_calibrate = bool(check_choice("auto_calibrate", auto_calibrate, (True, False)))
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.calibration_factor = check_positive("calibration_factor", calibration_factor)
        if self.calibration_factor <= 1:
            raise ValueError(f"`calibration_factor` must be > 1; got {calibration_factor!r}.")
        self.floor_s = check_positive("floor_s", floor_s)
        self.deadlock_action = check_choice("deadlock_action", deadlock_action, ("abort", "report"))
        self.deadlock_after_s = check_positive("deadlock_after_s", deadlock_after_s)
        self.collective_mismatch = check_choice(
            "collective_mismatch", collective_mismatch, ("warn", "abort")
        )
        self.check_metric_reductions = bool(
            check_choice("check_metric_reductions", check_metric_reductions, (True, False))
        )
        self.teardown_timeout_s = check_seconds("teardown_timeout_s", teardown_timeout_s)
        self.stop_signals = check_signals(stop_signals)
        self.stop_grace_s = check_positive("stop_grace_s", stop_grace_s)
        self.exchange_timeout_s = max(2.0, self.exchange_period_s)
        #: What the heartbeats say: the step log (the per-step events, and the others this
        #: guard appends) and what is read from it, by the watchdog thread.
        self.heartbeats = self._new_heartbeats()
        super().__init__()
        self.stop_agreement = StopAgreement(
            self.stop_signals, self.stop_grace_s, self._next_boundary
        )
        self._release_owner = _no_owner
        self._incident = IncidentState()
        # The thread, its deadlines, its reports and exit.
        self._watch = self._new_thread()
        self._reset()

    def _new_heartbeats(self) -> HeartbeatReader:
        """The reader of this guard's step log (before ``Guard.__init__`` gives it the log)."""
        return HeartbeatReader(measure=self.auto_calibrate, warmup=self.warmup_steps)

    def _new_thread(self) -> WatchdogThread:
        """The watchdog's thread (not started), on this guard's settings and heartbeats."""
        return WatchdogThread(
            self.name,
            self.current_settings(),
            self.heartbeats,
            self._incident,
            warn_once=self.warn_once,
            stop_agreement=self.stop_agreement,
        )

    def current_settings(self) -> WatchdogSettings:
        """The settings as they are now, frozen: what the watchdog's thread reads."""
        return WatchdogSettings(
            timeout_s=self.timeout_s,
            eval_timeout_s=self.eval_timeout_s,
            post_eval_timeout_s=self.post_eval_timeout_s,
            checkpoint_timeout_s=self.checkpoint_timeout_s,
            first_step_timeout_s=self.first_step_timeout_s,
            action=self.action,
            abort_at=self.abort_at,
            report_dir=self.report_dir,
            exchange_period_s=self.exchange_period_s,
            exchange_timeout_s=self.exchange_timeout_s,
            auto_calibrate=self.auto_calibrate,
            warmup_steps=self.warmup_steps,
            calibration_factor=self.calibration_factor,
            floor_s=self.floor_s,
            deadlock_action=self.deadlock_action,
            deadlock_after_s=self.deadlock_after_s,
            collective_mismatch=self.collective_mismatch,
            teardown_timeout_s=self.teardown_timeout_s,
            defaulted=frozenset(self.defaulted),
        )

    def _adopt(self, settings: WatchdogSettings) -> None:
        """Keeps the values the watchdog fitted to the job (``FITTED``) as this guard's."""
        for name in FITTED:
            setattr(self, name, getattr(settings, name))

    @property
    def steps(self) -> StepLog:
        """The step log this guard's events go to (the runner's): its heartbeats' to read."""
        return self.heartbeats.steps

    @steps.setter
    def steps(self, steps: StepLog) -> None:
        self.heartbeats.steps = steps

    @property
    def history(self) -> IntervalHistory:
        """The intervals seen per phase, which calibrate the deadlines."""
        return self.heartbeats.intervals

    @property
    def incidents(self) -> int:
        """Incidents reported by this rank so far."""
        return self._incident.incidents

    @property
    def ceilings_reached(self) -> int:
        """Incidents that reached stage 2 on this rank."""
        return self._incident.ceilings_reached

    @property
    def last_incident(self) -> HangDetectedError | None:
        """The last report as a :class:`HangDetectedError`, or ``None``."""
        return self._incident.last_incident

    def bind(self, channel: SideChannel, log_metrics: MetricSink | None = None) -> None:
        """Gives the guard its side channel and metric sink (at FIT_START), and its thread."""
        super().bind(channel, log_metrics)
        self._watch.channel = channel

    @property
    def ceilings(self) -> dict[str, float]:
        """Configured (or NCCL-fitted) deadline per phase kind: stage 2."""
        return self.current_settings().ceilings

    @property
    def deadlines(self) -> dict[str, float]:
        """Deadline per phase kind now (calibrated, at most the ceiling): stage 1."""
        return dict(self._watch.deadline_s)

    @property
    def closest_call(self) -> ClosestCall | None:
        """The healthy interval closest to its deadline since fit start, or ``None``."""
        return self.heartbeats.phases.closest_call

    @property
    def _beat(self) -> Beat | None:
        return self.heartbeats.beat

    def _reset(self) -> None:
        self._watch.reset()
        self.heartbeats.reset()
        self._wake_at = 1  # the next train batch ended after which the thread exchanges at once
        self.due = 1  # the first train batch's start: on_due

    # -- checkpoint state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The calibration (recent intervals per phase), saved with checkpoints."""
        self.heartbeats.read_step_log()
        if not self.auto_calibrate or not any(self.history.snapshot().values()):
            return {}
        return {"calibration": self.history.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the calibration of a checkpoint: the resumed job starts calibrated."""
        if state and self.auto_calibrate:
            self.heartbeats.restored = self.history.load_state_dict(state.get("calibration", {}))

    # -- heartbeats (main thread) and reading them (watchdog thread, or main at fit end) --

    def _heartbeat(self, event: Event, facts: EventFacts) -> None:
        """Records a heartbeat of an event that is not per step in the step log."""
        self.steps.append(event.value, facts)
        if self._watch.thread is None:
            self._start()

    def read_steps(self, entries: list[Entry]) -> None:
        """Reads the step log (under its lock): :class:`PhaseTracker`, then :class:`History`.

        After the first train batch, and once calibrated, the thread is woken to
        exchange at once (:meth:`_exchange_now`).
        """
        heartbeats = self.heartbeats
        heartbeats.read(entries, self._watch.deadline_s)
        if self._wake_at and heartbeats.phases.steps_done >= self._wake_at:
            self._exchange_now()

    def on_fit_start(self, facts: EventFacts) -> None:
        """Starts the watchdog thread (a new fit starts a new incident state, same calibration)."""
        if self._watch.thread is not None and not self._watch.thread.is_alive():
            self._watch.thread = None  # it ended with the previous fit
        self._reset()
        params = _num_params(facts.model) if facts.model is not None else None
        heartbeats = self.heartbeats
        heartbeats.save_estimate = None if params is None else save_estimate_s(params, self.floor_s)
        heartbeats.decision_probe = facts.decision_probe
        heartbeats.split_decisions = dict(facts.split_decisions)
        heartbeats.history.announces = tuple(facts.phases)  # read from the fit_start entry on
        self.stop_agreement.reset(self.channel)  # an adapter that ends its loop on it installs it
        self._heartbeat(Event.FIT_START, facts)

    def _next_boundary(self) -> int | None:
        """The first step boundary the loop can still reach: one past the steps it ended.

        Read from the heartbeats on the watchdog thread (``None`` once its fit ended). A
        loop inside batch ``n`` (``n`` steps ended) reaches ``n + 1`` next; one between
        batches may reach ``n`` first, and runs on to ``n + 1`` (a step more, never less).
        """
        heartbeats = self.heartbeats
        heartbeats.read_step_log()
        if heartbeats.beat is None or heartbeats.fit_ended:
            return None
        return heartbeats.phases.steps_done + 1

    # Most events only record a heartbeat: one handler each, documented once.
    on_epoch_start = _heartbeat_handler(Event.EPOCH_START)
    on_eval_start = _heartbeat_handler(Event.EVAL_START)
    on_eval_batch_start = _heartbeat_handler(Event.EVAL_BATCH_START)
    on_eval_batch_end = _heartbeat_handler(Event.EVAL_BATCH_END)
    on_epoch_end = _heartbeat_handler(Event.EPOCH_END)

    def on_due(self, batches: int) -> None:
        """At the start of the batch after a wake point: wakes the thread, which reads the log.

        The thread's read finds the wake point passed and exchanges at once (see
        :meth:`_exchange_now`) without waiting for its next read; the training thread
        only sets a flag. The thread starts here if no fit start started it.
        """
        if self._watch.thread is None:
            self._start()
        ended = batches - 1
        if ended:
            self._watch.wake.set()
        self.due = next((at + 1 for at in self._wake_points() if at > ended), math.inf)

    def _wake_points(self) -> tuple[int, int]:
        """The train batches ended after which the thread exchanges at once.

        The first, and the one after which its deadlines are calibrated.
        """
        return 1, self.warmup_steps + MIN_SAMPLES // 3 + 1

    def _exchange_now(self) -> None:
        """After the first train batch, and once calibrated: the thread exchanges at once.

        Seen when the thread reads the step log, woken at the next batch's start
        (``due``) or within :data:`READ_PERIOD_S`, not an exchange period later: the
        other ranks learn this rank left start-up, then its calibrated deadlines (3
        train intervals a step), which bound how long it may go silent (a rank that
        freezes next is judged by them). Read by the thread itself before a status, it
        needs no wake: that status is the exchange.
        """
        calibrated = self._wake_points()[1]
        self._wake_at = calibrated if self._wake_at < calibrated else 0
        self._watch.exchange_soon()

    def on_eval_end(self, facts: EventFacts) -> None:
        """Records a heartbeat; the after-eval deadline applies until the next data fetch."""
        self._heartbeat(Event.EVAL_END, facts)

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Records a heartbeat; the checkpoint deadline applies."""
        self.heartbeats.phases.decisions["save"] = Decision(True, facts.step)
        self._heartbeat(Event.CHECKPOINT_SAVE_START, facts)

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self.heartbeats.phases.decisions.pop("save", None)
        self._heartbeat(Event.CHECKPOINT_SAVE_END, facts)

    def on_fit_end(self, facts: EventFacts) -> None:
        """Records the end of fit: no deadline from here on; tells the other ranks at once."""
        self._heartbeat(Event.FIT_END, facts)
        self.heartbeats.read_step_log()
        closest = self.closest_call
        if closest is not None:
            share, kind, seconds, deadline = closest
            logger.info(
                "rankguard %s: closest a healthy interval came to its deadline: %.0f%% (%s, "
                "%.2f s of %.0f s)",
                self.name,
                100 * share,
                KIND_LABELS[kind],
                seconds,
                deadline,
            )
        self._watch.wake.set()

    def on_error(self, exc: BaseException, facts: EventFacts | None = None) -> None:
        """Tells the other ranks this rank's training raised ``exc`` (a store write only).

        They end within seconds naming it, where each would wait for this rank.
        """
        self._watch.faults.raised(exc, facts.step if facts is not None else None)

    def close(self) -> None:
        """Stops and joins the watchdog thread; safe to call twice and after an error."""
        self.stop_agreement.restore()
        self._release_owner()
        self.heartbeats.read_step_log()
        self._watch.close(fit_ended=self.heartbeats.fit_ended)

    # -- metric names before a framework's reduction (the thread that reduces) -----------

    def metric_reduction_check(
        self, name: str, *, where: str, fix: str, notes: Mapping[str, str] | None = None
    ) -> ReductionCheck | None:
        """A check of the names every rank reduces at ``name``, or ``None`` when it is off.

        The adapter calls its :meth:`ReductionCheck.check` on the thread about
        to reduce, on every rank at every reduction. A mismatch raises
        :class:`MetricMismatchError` on every rank once each has logged it; a
        rank that never arrives within ``timeout_s`` is this watchdog's to
        diagnose (see :meth:`_own_missing`).

        Args:
            name: The reduction, in the exchange's name, e.g. ``"olmo_core_flush"``.
            where: The reduction, in the message.
            fix: The message's fix.
            notes: Words for names the framework itself records.
        """
        if not self.check_metric_reductions:
            return None

        def mismatch(error: MetricMismatchError) -> Any:
            self.raise_on_every_rank(error)

        def names(reduced: tuple[str, ...], step: int) -> None:
            self.heartbeats.phases.decisions[f"{NAMES_DECISION}{name}"] = Decision(reduced, step)

        return ReductionCheck(
            self.channel,
            name=f"metric_reduction/{name}",
            where=where,
            fix=fix,
            notes=notes,
            timeout_s=self.timeout_s,
            on_mismatch=mismatch,
            on_names=names,
        )

    # -- ranks missing from another check's exchange (main thread) ----------------------

    def _own_missing(self, error: RanksMissingError) -> None:
        """Turns a check's missing ranks into this incident's end, with the watchdog's diagnosis.

        Runs on the thread whose exchange gave up (the training loop). The
        status exchange carries the give-up to every rank, so all end the
        incident together (stage 2); with ``action="abort"`` this never
        returns. Otherwise it raises :class:`HangDetectedError` in place of
        the check's own error.
        """
        thread = self._watch.thread
        if error.name.startswith(f"{self.name}/") or thread is None or not thread.is_alive():
            return  # the watchdog's own exchanges, or no watchdog running: the caller's error
        self.heartbeats.read_step_log()
        if self._watch.stop.is_set() or self.heartbeats.fit_ended:
            return
        self._watch.give_up((error.name, tuple(error.missing), error.timeout_s))
        limit = self.exchange_period_s + 3 * self.exchange_timeout_s + 10.0
        if self._incident.ended.wait(limit) and self.last_incident is not None:
            raise HangDetectedError(str(self.last_incident)) from error
        raise HangDetectedError(
            f"Hang: {error} The hang watchdog could not confirm it within {limit:.0f} s (the "
            "status exchange failed); see the watchdog's log lines."
        ) from error

    # -- the watchdog thread (watchdog_thread.py) ---------------------------------------

    def _start(self) -> None:
        self._adopt(self._watch.prepare(self.current_settings(), self.channel))
        self._release_owner = own_missing_ranks(self._own_missing)
        self._watch.launch()


def _no_owner() -> None:
    """Releases nothing (the watchdog does not own missing ranks before it starts)."""
