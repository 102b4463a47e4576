"""HangWatchdog: names the rank that stopped, where, with its stack, within a minute by default.

Holds :class:`HangWatchdog`, the guard's shell (events, thread, files, exit); what decides is
pure beside it: ``phases``, ``deadlines``, ``waits``, ``status``, ``incident``, ``diagnosis``.
See docs/hang.md#how-hangwatchdog-works.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from rankguard.callbacks.core.errors import (
    HangDetectedError,
    MetricMismatchError,
    RanksMissingError,
)
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.settings import check_choice, check_int, check_positive
from rankguard.callbacks.core.side_channel import own_missing_ranks
from rankguard.callbacks.core.step_log import Entry, expand
from rankguard.callbacks.hang import deadlines as policy
from rankguard.callbacks.hang import incident
from rankguard.callbacks.hang.calibration import (
    KIND_LABELS,
    MIN_SAMPLES,
    IntervalHistory,
    calibrate,
    describe,
    save_estimate_s,
)
from rankguard.callbacks.hang.collective_files import write_flight_recorder
from rankguard.callbacks.hang.collectives import CollectiveRecorder
from rankguard.callbacks.hang.deadlines import DEFAULT_DEADLINES, Settle
from rankguard.callbacks.hang.incident import Report
from rankguard.callbacks.hang.job import RESTART_ENV, attempt_dir, process_group_timeout
from rankguard.callbacks.hang.metric_reductions import ReductionCheck
from rankguard.callbacks.hang.phases import Beat, ClosestCall, Decision, PhaseTracker
from rankguard.callbacks.hang.rank_status import rank_status
from rankguard.callbacks.hang.report import write_incident
from rankguard.callbacks.hang.stacks import code_name, library_paths
from rankguard.callbacks.hang.status import (
    DEADLOCK_EXIT_CODE,
    HANG_EXIT_CODE,
    GaveUp,
    RankStatus,
    Runs,
    Verdict,
)
from rankguard.callbacks.hang.verdict import diagnose
from rankguard.callbacks.hang.verdict_text import (
    NAMES_DECISION,
    flight_recorder_note,
    nccl_timeout_advice,
    phase_label,
)
from rankguard.callbacks.hang.waits import WaitTracker

__all__ = [
    "DEADLOCK_EXIT_CODE",
    "HANG_EXIT_CODE",
    "RESTART_ENV",
    "HangWatchdog",
    "attempt_dir",
    "process_group_timeout",
]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

_now = time.perf_counter  # the step log's clock: heartbeats are compared with it

STATUS_EXCHANGE = "hang_watchdog/status"
ABORT_BARRIER = "hang_watchdog/abort"
HISTORY = 256  # heartbeats kept per rank for rank{N}.jsonl
MAX_FRAMES = 64  # frames of the training loop read at each exchange
#: While this rank makes no progress, its own stack is sampled this often (seconds).
PROBE_PERIOD_S = 0.5
#: While it makes progress, the watchdog thread wakes this often (seconds) to read the step
#: log: a wake costs tens of µs of CPU and a read a fixed cost besides its entries', so
#: rarer reads while training goes on make the thread's share of a step 2-3 times smaller.
READ_PERIOD_S = 2.0
#: A deadlock seen at one exchange is confirmed by the next, this long after (seconds): ranks
#: leave one collective a few milliseconds apart, so a status sampled just before one rank
#: returned from it must not confirm it.
CONFIRM_AFTER_S = 1.0
#: The exit codes an incident ends the job with (``incident.Report.code``).
EXIT_CODES = (HANG_EXIT_CODE, DEADLOCK_EXIT_CODE)


def _check_report_dir(report_dir: Any) -> str:
    if not isinstance(report_dir, str | os.PathLike) or not str(report_dir):
        raise ValueError(f"`report_dir` must be a directory path; got {report_dir!r}.")
    path = Path(report_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"`report_dir` {str(report_dir)!r} is not writable (checked {existing}).")
    return str(report_dir)


def _num_params(model: Any) -> int | None:
    try:
        return sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError, RuntimeError):
        return None


def _heartbeat_handler(event: str) -> Callable[[HangWatchdog, EventFacts], None]:
    """The ``on_<event>`` handler of an event the watchdog only records a heartbeat for."""

    def handler(self: HangWatchdog, facts: EventFacts) -> None:
        self._heartbeat(event, facts)

    handler.__name__ = handler.__qualname__ = f"on_{event}"
    handler.__doc__ = "Records a heartbeat."
    return handler


class HangWatchdog(Guard):
    """Reports which ranks stopped making progress, where, and their Python stacks.

    Each phase has a deadline, calibrated from the intervals this rank has
    seen in it (``auto_calibrate``, on by default; see ``docs/hang.md``), and
    a ceiling, the deadline argument of its phase. An incident has two stages:

    1. A rank passes its calibrated deadline: every rank logs the verdict
       (``logging.WARNING``) and writes its stacks to
       ``report_dir/rank{N}.txt``; the lowest answering rank writes
       ``summary.txt``. Training goes on: a slow phase is not a hang.
    2. The stuck rank passes its phase's ceiling, or a rankguard check gives
       up waiting for it: every rank logs the verdict (``logging.ERROR``),
       rewrites its report, and with ``action="abort"`` exits with
       :data:`HANG_EXIT_CODE` (75) through ``os._exit``, so the launcher
       tears the job down (or restarts it) even when the main thread is
       stuck in C++. ``abort_at="calibrated"`` ends the incident at stage 1.

    Ceilings bound the time without any heartbeat in a phase: train steps and
    data fetches (``timeout_s``), eval batches (``eval_timeout_s``), from eval
    end until the rank fetches its next train batch (``post_eval_timeout_s``),
    checkpoint saves (``checkpoint_timeout_s``); until the first train batch
    ends only ``first_step_timeout_s`` applies (compile, warm-up); after fit
    end none. A rank back in its train loop is training: when it waits there
    for a rank still busy after eval (Composer all-reduces in every data
    fetch), its train deadline applies, so it is reported as waiting, not as
    stuck after eval. Under NCCL, a ceiling left at its default (``None``) is
    lowered to fit inside the process group's timeout; one you set that does
    not fit gets a warning with the fix. Under torchrun with restarts the report
    of each attempt goes to ``report_dir/attempt{N}``.

    A proven deadlock does not wait for either stage: while a rank makes no
    progress its watchdog thread samples the training loop's stack every
    :data:`PROBE_PERIOD_S`; once its loop has waited at a rendezvous (a
    collective, a barrier, backward, a rankguard exchange) for
    ``deadlock_after_s`` it exchanges statuses at once. When every rank waits
    at a rendezvous, not all at the same one, at two exchanges
    :data:`CONFIRM_AFTER_S` apart without progress, no rank can ever go on:
    every rank reports it and, with
    ``deadlock_action="abort"``, exits with :data:`DEADLOCK_EXIT_CODE` (70:
    fix the code, a restart replays it). A rank whose fit ended while others
    have not (``should_stop`` or early stopping decided on one rank) keeps its
    thread until every rank ended fit or a verdict came, and says it left the
    training loop: another rank waiting at a rendezvous in that loop can never
    go on, which proves the deadlock the same way. A rank that is only slow is
    never at a rendezvous, so it keeps the two stages.

    The calibration is saved with checkpoints (:meth:`state_dict`), so a
    resumed job starts calibrated.

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
        exchange_period_s: Time between status exchanges. A stuck rank is
            reported within its deadline + ``exchange_period_s``; a rank that
            stops answering (frozen, dead) within the deadline + about
            ``exchange_period_s`` + ``exchange_timeout_s`` (5 s more when it is
            rank 0, which decides the exchanges).
        auto_calibrate: Calibrate deadlines below the ceilings (else each
            phase's deadline is its ceiling: one stage).
        warmup_steps: Train steps before intervals are recorded.
        calibration_factor: A deadline is at least this multiple of the 99th
            percentile of its phase's recent intervals (> 1).
        floor_s: Lowest calibrated deadline.
        deadlock_action: ``"abort"`` (a proven deadlock ends the job at once with
            :data:`DEADLOCK_EXIT_CODE`) or ``"report"`` (report it at once, keep
            the two stages).
        deadlock_after_s: How long a rank's loop must wait at one rendezvous
            before it counts toward a deadlock (at least ``calibration_factor``
            x the train steps' 99th percentile once calibrated).
        collective_mismatch: What ranks that paired different collectives at one count
            while the job runs get (their records, compared at each status exchange):
            ``"warn"`` (a WARNING, once each) or ``"abort"`` (reported like a proven
            deadlock: every rank exits with :data:`DEADLOCK_EXIT_CODE`).
        check_metric_reductions: Before a framework reduces metrics by name, compare
            the names every rank is about to reduce through the store: OLMo-core's metric
            flush (one store exchange per flush, on the training thread; names that
            differ raise :class:`MetricMismatchError` on every rank) and Composer's loss,
            one all_reduce per key (at the first batch, then where a rank's keys change;
            a rank whose keys changed alone waits, says which, and the wait is proven).

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

    Metrics: none (the verdict comes from a background thread; framework
    loggers are not thread-safe). Exit code: :data:`HANG_EXIT_CODE`. Files:
    see :mod:`rankguard.callbacks.hang.report`.

    Example::

        watchdog = HangWatchdog(timeout_s=300, post_eval_timeout_s=120, action="abort")
        # log: rank 1 stuck 31 s in after eval of 'eval' (deadline 30 s, calibrated;
        #      ceiling 120 s); ranks 0,2,3 waiting 29 s in train batch 2001
    """

    name = "hang_watchdog"
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
        exchange_period_s: float = 10.0,
        auto_calibrate: bool = True,
        warmup_steps: int = 10,
        calibration_factor: float = 10.0,
        floor_s: float = 30.0,
        deadlock_action: str = "abort",
        deadlock_after_s: float = 3.0,
        collective_mismatch: str = "warn",
        check_metric_reductions: bool = True,
    ) -> None:
        super().__init__()
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
        self._libraries = library_paths()
        self.history = IntervalHistory()
        # What the heartbeats say: the step log's entries (the per-step events, and the
        # others this guard appends), fed by the watchdog thread (_derive, read_steps).
        self._phases = PhaseTracker(
            self.history, measure=self.auto_calibrate, warmup=self.warmup_steps
        )
        self._waits = WaitTracker(self._libraries)
        self._settle: Settle = policy.settle_times(self.deadlock_after_s, self.calibration_factor)
        self._recorder: CollectiveRecorder | None = None
        self._told_mismatch: set[str] = set()
        self._decision_probe: Any = None  # the adapter's, from FIT_START
        self.exchange_timeout_s = max(2.0, self.exchange_period_s)
        self.incidents = 0
        self.ceilings_reached = 0
        self.last_incident: HangDetectedError | None = None
        self._restored = False  # the history came from a checkpoint
        self._save_estimate: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the thread's sleep early (fit end, close)
        self._ended = threading.Event()  # the open incident reached stage 2
        self._release_owner = _no_owner
        self._history: deque = deque(maxlen=HISTORY)  # the last entries read: rank{N}.jsonl
        self._nccl_note = ""
        self._host = socket.gethostname()
        self._loop_thread: int | None = None  # ident of the thread that sends the events
        self._loop_thread_name: str | None = None  # its name, as the record names threads
        self._words: dict[str, Any] = {}  # the adapter's words for its decisions
        self._reset()

    @property
    def ceilings(self) -> dict[str, float]:
        """Configured (or NCCL-fitted) deadline per phase kind: stage 2."""
        return policy.ceilings(
            first_step_timeout_s=self.first_step_timeout_s,
            timeout_s=self.timeout_s,
            eval_timeout_s=self.eval_timeout_s,
            post_eval_timeout_s=self.post_eval_timeout_s,
            checkpoint_timeout_s=self.checkpoint_timeout_s,
        )

    @property
    def deadlines(self) -> dict[str, float]:
        """Deadline per phase kind now (calibrated, at most the ceiling): stage 1."""
        return dict(self._deadline_s)

    @property
    def closest_call(self) -> ClosestCall | None:
        """The healthy interval closest to its deadline since fit start, or ``None``."""
        return self._phases.closest_call

    @property
    def _beat(self) -> Beat | None:
        return self._phases.beat

    def _reset(self) -> None:
        self._deadline_s: dict[str, float] = self.ceilings
        self._phases.reset()
        self._wake_at = 1  # the next train batch ended after which the thread exchanges at once
        self._read_wake = False  # the thread read a wake point: exchange at once
        self.due = 1  # the first train batch's start: on_due
        self._incident: Runs = ()
        self._reported = False
        self._ended.clear()
        self._gave_up: GaveUp | None = None
        self._told_calibrated = False
        self._last: Verdict | None = None
        self._failures = 0
        self._waits.wait = None

    # -- checkpoint state ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The calibration (recent intervals per phase), saved with checkpoints."""
        self._derive()
        if not self.auto_calibrate or not any(self.history.snapshot().values()):
            return {}
        return {"calibration": self.history.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the calibration of a checkpoint: the resumed job starts calibrated."""
        if state and self.auto_calibrate:
            self._restored = self.history.load_state_dict(state.get("calibration", {}))

    # -- heartbeats (main thread) and reading them (watchdog thread, or main at fit end) --

    def _heartbeat(self, event: str, facts: EventFacts) -> None:
        """Records a heartbeat of an event that is not per step in the step log."""
        self.steps.append(event, facts)
        if self._thread is None:
            self._start()

    def _derive(self) -> None:
        """Reads the step log now (this guard's part: :meth:`read_steps`).

        The watchdog thread calls it before it reads what the heartbeats say (at
        least every :data:`READ_PERIOD_S` between exchanges, every :data:`PROBE_PERIOD_S`
        while the loop makes no progress); the main thread at
        fit end, at a checkpoint save and when it stops the thread.
        """
        self.steps.drain()

    def read_steps(self, entries: list[Entry]) -> None:
        """Reads heartbeats (under the step log's lock): see :class:`PhaseTracker`.

        After the first train batch, and once calibrated, the thread is woken to
        exchange at once (:meth:`_exchange_now`).
        """
        self._phases.read(entries, self._deadline_s)
        self._history.extend(entries)
        if self._wake_at and self._phases.steps_done >= self._wake_at:
            self._exchange_now()

    def _probe_decisions(self) -> None:
        """Reads the adapter's decisions now (watchdog thread, at each status): never raises."""
        probe, beat = self._decision_probe, self._beat
        if probe is None or beat is None:
            return
        try:
            self._phases.update_decisions(probe(), beat.step)
        except Exception as exc:  # a framework's state read from another thread
            logger.debug("rankguard %s: decision probe failed: %s", self.name, exc)

    def on_fit_start(self, facts: EventFacts) -> None:
        """Starts the watchdog thread (a new fit starts a new incident state, same calibration)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None  # it ended with the previous fit
        self._reset()
        params = _num_params(facts.model) if facts.model is not None else None
        self._save_estimate = None if params is None else save_estimate_s(params, self.floor_s)
        self._decision_probe = facts.decision_probe
        self._words = dict(facts.split_decisions)
        self._heartbeat("fit_start", facts)

    # Most events only record a heartbeat: one handler each, documented once.
    on_epoch_start = _heartbeat_handler("epoch_start")
    on_eval_start = _heartbeat_handler("eval_start")
    on_eval_batch_start = _heartbeat_handler("eval_batch_start")
    on_eval_batch_end = _heartbeat_handler("eval_batch_end")
    on_epoch_end = _heartbeat_handler("epoch_end")

    def on_due(self, batches: int) -> None:
        """At the start of the batch after a wake point: wakes the thread, which reads the log.

        The thread's read finds the wake point passed and exchanges at once (see
        :meth:`_exchange_now`) without waiting for its next read; the training thread
        only sets a flag. The thread starts here if no fit start started it.
        """
        if self._thread is None:
            self._start()
        ended = batches - 1
        if ended:
            self._wake.set()
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
        if threading.current_thread() is self._thread:
            self._read_wake = True  # :meth:`_sleep` ends at once; the next status clears it
        else:
            self._wake.set()

    def on_eval_end(self, facts: EventFacts) -> None:
        """Records a heartbeat; the after-eval deadline applies until the next data fetch."""
        self._heartbeat("eval_end", facts)

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Records a heartbeat; the checkpoint deadline applies."""
        self._phases.decisions["save"] = Decision(True, facts.step)
        self._heartbeat("checkpoint_save_start", facts)

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._phases.decisions.pop("save", None)
        self._heartbeat("checkpoint_save_end", facts)

    def on_fit_end(self, facts: EventFacts) -> None:
        """Records the end of fit: no deadline from here on; tells the other ranks at once."""
        self._heartbeat("fit_end", facts)
        self._derive()
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
        self._wake.set()

    def close(self) -> None:
        """Stops and joins the watchdog thread; safe to call twice and after an error."""
        self._release_owner()
        self._derive()
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            self._stop.set()
            self._wake.set()
            self._close_recorder()
            return
        if self._beat is not None and self._beat.kind == "done":
            # Fit ended here: let the exchange that finds every rank done end all threads
            # together, so no rank is left waiting for a rank that already left. Until then
            # this rank's status says it left the loop: a rank that waits at a rendezvous
            # in it for its settle time proves a deadlock (the thread then ends the job).
            limit = 2 * self.exchange_period_s + self.exchange_timeout_s + self._settle.stack_s
            thread.join(timeout=limit)
        self._stop.set()
        self._wake.set()
        # An exchange in flight ends within its timeout (+ the followers' grace).
        thread.join(timeout=1.25 * self.exchange_timeout_s + 7.0)
        self._close_recorder()

    def _close_recorder(self) -> None:
        """Restores torch.distributed; keeps the record files unless fit ended healthy."""
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            healthy = self._beat is not None and self._beat.kind == "done" and not self.incidents
            recorder.close(keep=not healthy)

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
            self._phases.decisions[f"{NAMES_DECISION}{name}"] = Decision(reduced, step)

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
        thread = self._thread
        if error.name.startswith(f"{self.name}/") or thread is None or not thread.is_alive():
            return  # the watchdog's own exchanges, or no watchdog running: the caller's error
        self._derive()
        if self._stop.is_set() or (self._beat is not None and self._beat.kind == "done"):
            return
        self._gave_up = (error.name, tuple(error.missing), error.timeout_s)
        self._wake.set()  # exchange statuses now
        limit = self.exchange_period_s + 3 * self.exchange_timeout_s + 10.0
        if self._ended.wait(limit) and self.last_incident is not None:
            raise HangDetectedError(str(self.last_incident)) from error
        raise HangDetectedError(
            f"Hang: {error} The hang watchdog could not confirm it within {limit:.0f} s (the "
            "status exchange failed); see the watchdog's log lines."
        ) from error

    # -- watchdog thread ----------------------------------------------------------------

    def _start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._loop_thread_name = threading.current_thread().name
        self._derive()  # the first heartbeat: the thread reads _beat from its start
        backend, pg_timeout = process_group_timeout()
        if backend == "nccl":
            self._fit_defaults_under(pg_timeout)
            detect = self.exchange_period_s + self.exchange_timeout_s
            deadlines = policy.ceiling_arguments(self.ceilings)
            advice = nccl_timeout_advice(pg_timeout, deadlines, detect)
            if advice and self.channel.is_leader:
                self.warn_once("nccl_timeout", advice)
            self._nccl_note = flight_recorder_note(os.environ, self.channel.rank)
        self._deadline_s = self.ceilings
        self._told_calibrated = self._restored  # the plan below says so
        self._recalibrate()
        logger.info("rankguard %s: %s", self.name, self._plan())
        self._stop.clear()
        self._wake.clear()
        self._release_owner = own_missing_ranks(self._own_missing)
        self._start_recorder()
        self._thread = threading.Thread(
            target=self._run, name=f"rankguard-{self.name}", daemon=True
        )
        self._thread.start()

    def _start_recorder(self) -> None:
        """Starts this rank's record of collectives (in the report folder), where it can."""
        if self._recorder is not None or not self.channel.is_distributed:
            return
        recorder = CollectiveRecorder(
            attempt_dir(self.report_dir, os.environ), self.channel.rank, self._libraries
        )
        if recorder.install():
            self._recorder = recorder

    def _settings(self) -> policy.Settings:
        """The settings the deadline policy reads."""
        return policy.Settings(
            self.auto_calibrate,
            self.warmup_steps,
            self.calibration_factor,
            self.floor_s,
            self.first_step_timeout_s,
            self.deadlock_after_s,
            self.action,
            self.abort_at,
        )

    def _plan(self) -> str:
        """The INFO line at fit start: what is reported when, and when the job ends."""
        restored = self._calibrated() if self._restored else None
        return policy.plan(self.ceilings, self._settings(), restored)

    def _fit_defaults_under(self, pg_timeout: float | None) -> None:
        """Lowers defaulted ceilings so a hang ends before NCCL ends the job."""
        values = {name: getattr(self, name) for name in self.defaulted}
        period, timeout = self.exchange_period_s, self.exchange_timeout_s
        fitted = policy.fit_defaults_under(
            values, self.defaulted, pg_timeout, exchange_period_s=period, exchange_timeout_s=timeout
        )
        for name, seconds in fitted.items():
            setattr(self, name, seconds)
            logger.info(
                "rankguard %s: `%s` set to %.0f s to report before NCCL's %.0f s timeout",
                self.name,
                name,
                seconds,
                pg_timeout,
            )

    def _calibrated(self) -> dict:
        factor, floor_s, save_estimate = self.calibration_factor, self.floor_s, self._save_estimate
        return calibrate(
            self.history, self.ceilings, factor=factor, floor_s=floor_s, save_estimate=save_estimate
        )

    def _recalibrate(self) -> None:
        """Sets the deadlines from the intervals seen (at each status exchange)."""
        self._derive()
        ready = self._restored or self._phases.steps_done >= self.warmup_steps
        if not self.auto_calibrate or not ready:
            return
        new = policy.recalibrate(self.history, self.ceilings, self._settings(), self._save_estimate)
        if new.settle is not None:
            self._settle = new.settle
        self._deadline_s = new.deadlines
        if not self._told_calibrated and new.settle is not None:
            self._told_calibrated = True
            step = self._beat.step if self._beat else 0
            describe_ = describe(new.calibrated)
            logger.info(
                "rankguard %s: calibrated at train step %d: reports past %s.",
                self.name,
                step,
                describe_,
            )

    def _sample(self) -> tuple[list, str | None, float]:
        """Reads the loop's stack; tracks how long it has waited at one rendezvous."""
        stack = self._loop_stack()
        recorder = self._recorder
        counts = recorder.counts() if recorder is not None else ()
        point, wait_s = self._waits.sample(stack, _now(), self._phases.progress, counts)
        return stack, point, wait_s

    def _status(self) -> RankStatus:
        """This rank's status now (built by :mod:`rankguard.callbacks.hang.rank_status`)."""
        self._derive()
        beat = self._beat  # set before the thread starts
        stack, waits_at, wait_s = self._sample()
        self._probe_decisions()
        progress = self._phases.progress
        return rank_status(
            beat,
            stack,
            waits_at,
            wait_s,
            now=_now(),
            deadlines=self._deadline_s,
            ceilings=self.ceilings,
            settle=self._settle,
            libraries=self._libraries,
            host=self._host,
            pid=os.getpid(),
            gave_up=self._gave_up,
            progress=progress,
            usual=self._waits.is_usual(progress),
            decisions=dict(self._phases.decisions),
            record=self._collectives(),
            quiet_s=self._quiet_s(),
            loop_thread=self._loop_thread_name,
        )

    def _collectives(self) -> tuple:
        """This rank's record of collectives for its status; ``()`` if it cannot be read."""
        recorder = self._recorder
        if recorder is None:
            return ()
        try:
            return recorder.snapshot()
        except Exception as exc:  # the record must never cost the status exchange
            logger.debug("rankguard %s: collective record unreadable: %s", self.name, exc)
            return ()

    def _quiet_s(self) -> float:
        """How long this rank has made no progress and issued no collective (as sampled)."""
        return self._waits.quiet_s(_now()) if self._recorder is not None else 0.0

    def _loop_stack(self) -> list[tuple[str, int, str]]:
        """The training loop thread's frames (innermost first), read from the watchdog thread."""
        frame = sys._current_frames().get(self._loop_thread)
        stack = []
        while frame is not None and len(stack) < MAX_FRAMES:
            stack.append((frame.f_code.co_filename, frame.f_lineno, code_name(frame.f_code)))
            frame = frame.f_back
        return stack

    def _run(self) -> None:
        while not self._stop.is_set():
            self._recalibrate()
            suspect = self._last.suspect if self._last is not None else None
            decide = functools.partial(
                diagnose, incident=self._incident, suspect=suspect, words=self._words
            )
            try:
                status = self._status()
                self._read_wake = False  # a wake point read so far: this status tells it
                verdict = self.channel.exchange(
                    STATUS_EXCHANGE, status, decide, timeout_s=self.exchange_timeout_s
                )
            except RanksMissingError as missing:
                self._failures += 1
                self._on_missing(missing.missing)
                continue  # the exchange itself waited; ask again at once
            except Exception as exc:
                if not self._stop.is_set() and self._beat.kind != "done":
                    self.warn_once("exchange", "status exchange failed (%s); retrying.", exc)
                self._sleep()
                continue
            self._failures = 0
            confirm = verdict.suspect is not None and (
                self._last is None or self._last.suspect != verdict.suspect
            )
            self._last = verdict
            leader = self.channel.is_leader
            state, told = self._state(), self._told_mismatch
            for step in incident.after_verdict(
                verdict, state, self._policy(), leader=leader, told=told
            ):
                self._act(step)
            if verdict.done == ((0, self.channel.world_size - 1),):
                return  # every rank's fit ended: every thread ends after this same exchange
            if self._beat.kind == "done":
                # This rank left the loop, the others not yet: meet their next exchange (it
                # waits for them, at no cost to their steps) until they end fit or a verdict.
                continue
            if confirm:  # a deadlock seen once is confirmed by the next exchange, soon
                self._stop.wait(CONFIRM_AFTER_S)
            else:
                self._sleep()

    def _sleep(self) -> None:
        """Waits for the next exchange; sooner when this rank's loop settles at a rendezvous."""
        until = _now() + self.exchange_period_s
        while not self._wake.is_set() and not self._read_wake:
            left = until - _now()
            if left <= 0 or self._wake.wait(min(left, self._probe_period())):
                break
            if self._settled_at_rendezvous():
                break
        self._wake.clear()

    def _probe_period(self) -> float:
        """:data:`READ_PERIOD_S` while the loop makes progress, else :data:`PROBE_PERIOD_S`.

        The last read's newest heartbeat tells: a loop that came to wait at a rendezvous
        just after it is sampled at the next wake, so it settles at most a read period later.
        """
        beat = self._beat
        if beat is not None and beat.kind != "done" and _now() - beat.at < PROBE_PERIOD_S:
            return READ_PERIOD_S
        return PROBE_PERIOD_S

    def _settled_at_rendezvous(self) -> bool:
        """Whether the loop, without progress, settled (see :meth:`WaitTracker.exchange_early`).

        Cheap while training goes on: the stack is read only once no heartbeat
        came for a probe period.
        """
        self._derive()
        beat = self._beat
        if beat is None or beat.kind == "done" or self._ended.is_set():
            return False
        if _now() - beat.at < PROBE_PERIOD_S:
            return False
        _, point, wait_s = self._sample()
        quiet_s = self._quiet_s() if self._recorder is not None else None
        return self._waits.exchange_early(point, wait_s, quiet_s, self._settle, _now())

    # -- incidents: the state machine is incident.py's; here its steps are performed -----

    def _policy(self) -> incident.Policy:
        return incident.Policy(
            self.action, self.abort_at, self.deadlock_action, self.collective_mismatch
        )

    def _state(self) -> incident.State:
        return incident.State(self._reported, self._ended.is_set())

    def _on_missing(self, missing: list[int]) -> None:
        waited = self.exchange_period_s + self._failures * self.exchange_timeout_s
        if self._stop.is_set() or self._beat.kind == "done":
            return
        report = incident.after_missing(
            missing,
            rank=self.channel.rank,
            waited_s=waited,
            last=self._last,
            first_step_s=self.first_step_timeout_s,
            gave_up=self._gave_up,
            state=self._state(),
            policy=self._policy(),
        )
        if report is not None:
            self._report(report)

    def _act(self, step: incident.Step) -> None:
        """Performs one step of :func:`incident.after_verdict`."""
        if isinstance(step, incident.Hold):
            self._incident = step.runs
        elif isinstance(step, incident.WarnMismatch):
            self._told_mismatch.add(step.key)
            logger.warning("rankguard %s: Collective mismatch: %s", self.name, step.text)
        elif isinstance(step, incident.Recovered):
            logger.info("rankguard %s: %s", self.name, incident.recovered_text(step.ended))
            self._incident, self._reported, self._gave_up = (), False, None
            self._ended.clear()
        else:
            self._report(step)

    def _report(self, report: Report) -> None:
        """Writes this rank's report files, logs the incident, and exits where it says."""
        rank, status = self.channel.rank, self._status()
        header = incident.header(rank, status.host, status.pid, status.phase)
        folder = attempt_dir(self.report_dir, os.environ)
        wall = time.time() - _now()  # the beats' monotonic times as wall-clock times
        beats = [
            {"t": wall + t, "event": e, "phase": phase_label(e, s, b, ld), "step": s}
            for t, e, s, b, ld, _ in expand(list(self._history))
        ]
        writes = rank == incident.writer(self.channel.world_size, report.frozen)
        text = incident.summary_text(report, self._nccl_note) if writes else None
        first_line = f"{header}, idle {status.idle_s:.1f} s"
        try:
            write_incident(
                folder, rank, first_line, beats, text, loop_thread=self._loop_thread, status=status
            )
        except OSError as exc:
            logger.error("rankguard %s: could not write the report: %s", self.name, exc)
        if report.final or report.deadlock:
            write_flight_recorder(folder, rank)  # where the running torch keeps one
        if not self._reported:
            self.incidents += 1  # counted once per incident (tests wait on it)
        self._reported = True
        where = incident.where(header, str(folder), rank, self._nccl_note)
        self.last_incident = HangDetectedError(incident.message(report, where))
        outcome = incident.outcome(report, self.action)
        if not report.final:
            logger.warning("rankguard %s: %s %s", self.name, self.last_incident, outcome)
            return
        self.ceilings_reached += 1
        self._gave_up = None
        logger.error("rankguard %s: %s %s", self.name, self.last_incident, outcome)
        self._ended.set()
        if report.code is not None:
            self._abort(report.code)

    def _abort(self, code: int = HANG_EXIT_CODE) -> None:
        for handler in logging.getLogger().handlers:
            handler.flush()
        try:  # every rank has read the verdict before any exits
            self.channel.barrier(ABORT_BARRIER, timeout_s=self.exchange_timeout_s)
            self._leave_store_last()
        except Exception:
            logger.debug("rankguard %s: abort barrier incomplete", self.name)
        os._exit(code)

    def _leave_store_last(self) -> None:
        """Rank 0 exits last, once every other rank has made its last store request.

        Rank 0's process hosts the store under Composer's launcher, Lightning
        and ``env://`` init: a rank still reading the barrier's verdict when it
        dies logs a connection-reset trace under the hang report.
        """
        channel = self.channel
        if not channel.is_distributed:
            return
        left = f"{channel.prefix}/{ABORT_BARRIER}/left"
        if channel.is_leader:
            others = [f"{left}/r{rank}" for rank in range(1, channel.world_size)]
            channel.store.wait(others, timedelta(seconds=self.exchange_timeout_s))
        else:
            channel.store.set(f"{left}/r{channel.rank}", b"1")


def _no_owner() -> None:
    """Releases nothing (the watchdog does not own missing ranks before it starts)."""
