"""HangWatchdog: names the rank that stopped, where, with its stack, within a minute by default.

Holds :class:`HangWatchdog`, the guard; its decisions are in ``diagnosis``,
``calibration`` and ``deadlock`` beside it.
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
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from rankguard.callbacks.core.errors import (
    HangDetectedError,
    MetricMismatchError,
    RanksMissingError,
)
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.settings import check_choice, check_int, check_positive
from rankguard.callbacks.core.side_channel import own_missing_ranks
from rankguard.callbacks.core.step_log import (
    BATCH_END,
    BATCH_END_FETCH_START,
    FETCH_END_BATCH_START,
    PAIRS,
    Entry,
    expand,
)
from rankguard.callbacks.hang.calibration import (
    KIND_LABELS,
    MIN_SAMPLES,
    QUANTILE,
    IntervalHistory,
    calibrate,
    describe,
    quantile,
    save_estimate_s,
)
from rankguard.callbacks.hang.collective_files import write_flight_recorder
from rankguard.callbacks.hang.collectives import CollectiveRecorder
from rankguard.callbacks.hang.metric_reductions import ReductionCheck
from rankguard.callbacks.hang.report import write_incident
from rankguard.callbacks.hang.stacks import blocked_in as blocked_in_call
from rankguard.callbacks.hang.stacks import (
    called_from_user,
    code_name,
    library_paths,
    rendezvous,
    user_frame,
)
from rankguard.callbacks.hang.status import (
    DEADLOCK_EXIT_CODE,
    HANG_EXIT_CODE,
    LEFT_LOOP,
    GaveUp,
    RankStatus,
    Runs,
    Verdict,
)
from rankguard.callbacks.hang.verdict import diagnose, gone
from rankguard.callbacks.hang.verdict_text import (
    NAMES_DECISION,
    flight_recorder_note,
    left_at,
    nccl_timeout_advice,
    phase_label,
)

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


class Beat(NamedTuple):
    """The training thread's last heartbeat, read by the watchdog thread."""

    event: str
    step: int
    batch_index: int | None
    loader: str | None
    at: float  # time.perf_counter()
    kind: str  # the phase kind whose deadline applies from here ("done" after fit end)


class ClosestCall(NamedTuple):
    """The healthy interval closest to its deadline: :attr:`HangWatchdog.closest_call`."""

    share: float  # of the deadline
    kind: str
    seconds: float
    deadline: float


class Decision(NamedTuple):
    """A decision that can split the ranks (``should_stop``...), as this rank last saw it."""

    value: Any
    step: int | None  # the step at which it last changed


class Wait(NamedTuple):
    """The rendezvous the training loop waits at (read by the watchdog thread)."""

    key: str  # the wait point and the user frame that called it
    since: float  # time.perf_counter() when first seen
    progress: int  # heartbeats so far when first seen: a new one is a new wait


class SeenWait(NamedTuple):
    """The wait of the last status, and the heartbeats so far then (is it a usual one?)."""

    key: str | None
    progress: int


class EarlyExchange(NamedTuple):
    """The wait an early status exchange was last asked for, and when."""

    wait: Wait | tuple | None  # a rendezvous, or ("record", quiet since)
    at: float  # time.perf_counter()


#: Set by torchrun (and its elastic agent) to the number of restarts of the worker group.
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"

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
#: How long a rank must issue nothing and make no progress before its record of collectives
#: counts toward a desync (seconds; at least ``calibration_factor`` x the train p99 once
#: calibrated, ``deadlock_after_s`` before): ranks' counts differ briefly all the time.
RECORD_SETTLE_S = 1.0
#: Wait points seen healthy, kept per rank (to tell the usual one from the odd one).
MAX_USUAL = 64
#: Events that end a phase after eval: back in the train loop, or a checkpoint save.
_LEAVE_OR_END_EVAL = {
    "eval_end": "post_eval",
    "checkpoint_save_start": "checkpoint",
    "data_fetch_start": "data",
    "data_fetch_end": "train",
    "train_batch_start": "train",
}
#: The phase kind that follows each of a train step's heartbeats once a step has ended and
#: no eval just ended (``_kind``'s answer then, with nothing for it to update).
_STEP_KINDS = {"data_fetch_start": "data", "data_fetch_end": "train", "train_batch_start": "train"}


def _add(spans: dict[str, list[float]], kind: str, seconds: float) -> None:
    """Adds an interval of ``kind`` to those read."""
    span = spans.get(kind)
    if span is None:
        spans[kind] = [seconds]
    else:
        span.append(seconds)


#: Ceilings used when an argument is left at ``None``; under NCCL they are
#: lowered to fit inside the process-group timeout (see ``_fit_defaults_under``).
DEFAULT_DEADLINES = {
    "timeout_s": 600.0,
    "eval_timeout_s": 600.0,
    "post_eval_timeout_s": 600.0,
    "checkpoint_timeout_s": 1800.0,
}


def process_group_timeout() -> tuple[str | None, float | None]:
    """Returns the default process group's backend and timeout (seconds), where known.

    The timeout has no public getter; this is the one place the watchdog reads
    a private ``torch.distributed`` attribute (``tests/hang/test_hang_watchdog.py``
    fails if it disappears).
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    backend = str(dist.get_backend())
    try:
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        options = dist.group.WORLD._get_backend(device).options
        return backend, options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return backend, None


def attempt_dir(report_dir: str | os.PathLike, env: Mapping[str, str]) -> Path:
    """Where this attempt's report goes: ``report_dir/attempt{N}`` when the launcher restarts.

    torchrun with ``--max-restarts`` above 0 (``TORCHELASTIC_MAX_RESTARTS``) can
    start the workers again, so each attempt keeps its own folder; otherwise
    the report goes to ``report_dir`` itself, where the docs say it is.

    Args:
        report_dir: The configured report directory.
        env: The environment (``os.environ``); :data:`RESTART_ENV` holds the
            restart count under torchrun, the same on every rank of an attempt.

    Returns:
        ``report_dir`` itself when the launcher does not restart workers.
    """
    count = env.get(RESTART_ENV, "").strip()
    restarts = env.get(MAX_RESTARTS_ENV, "").strip()
    if not count.isdigit() or (int(count) == 0 and not (restarts.isdigit() and int(restarts))):
        return Path(report_dir)
    return Path(report_dir) / f"attempt{int(count)}"


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
        self._progress = 0  # heartbeats read by the watchdog thread so far
        self._wait: Wait | None = None
        self._usual: set[str] = set()
        self._pending_usual = SeenWait(None, 0)
        self._decisions: dict[str, Decision] = {}
        self._settle_s = self.deadlock_after_s
        self._record_settle_s = self.deadlock_after_s
        self._recorder: CollectiveRecorder | None = None
        self._quiet: tuple[Any, float] = (None, 0.0)  # (progress and counts, first seen at)
        self._told_mismatch: set[str] = set()
        self._decision_probe: Any = None  # the adapter's, from FIT_START
        self._probed: EarlyExchange | None = None
        self.exchange_timeout_s = max(2.0, self.exchange_period_s)
        self.incidents = 0
        self.ceilings_reached = 0
        self.last_incident: HangDetectedError | None = None
        self.history = IntervalHistory()
        self._restored = False  # the history came from a checkpoint
        self._save_estimate: float | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the thread's sleep early (fit end, close)
        self._ended = threading.Event()  # the open incident reached stage 2
        self._release_owner = _no_owner
        # Heartbeats are the step log's entries (the per-step events, and the others this
        # guard appends); the watchdog thread reads them (_derive, read_steps).
        self._history: deque = deque(maxlen=HISTORY)  # the last entries read: rank{N}.jsonl
        self._nccl_note = ""
        self._host = socket.gethostname()
        self._beat: Beat | None = None
        self._loop_thread: int | None = None  # ident of the thread that sends the events
        self._loop_thread_name: str | None = None
        self._words: dict[str, Any] = {}  # the adapter's words for its decisions
        self._reset()

    @property
    def ceilings(self) -> dict[str, float]:
        """Configured (or NCCL-fitted) deadline per phase kind: stage 2."""
        return {
            "startup": self.first_step_timeout_s,
            "train": self.timeout_s,
            "data": self.timeout_s,
            "eval": self.eval_timeout_s,
            "post_eval": self.post_eval_timeout_s,
            "checkpoint": self.checkpoint_timeout_s,
        }

    @property
    def deadlines(self) -> dict[str, float]:
        """Deadline per phase kind now (calibrated, at most the ceiling): stage 1."""
        return dict(self._deadline_s)

    def _reset(self) -> None:
        self._deadline_s: dict[str, float] = self.ceilings
        self._steps_done = 0  # train batches ended, as read from the step log
        self._wake_at = 1  # the next of them after which the thread exchanges at once
        self._read_wake = False  # the thread read a wake point: exchange at once
        self.due = 1  # the first train batch's start: on_due
        self._after_eval = False
        self._incident: Runs = ()
        self._reported = False
        self._ended.clear()
        self._gave_up: GaveUp | None = None
        self._told_calibrated = False
        self._last: Verdict | None = None
        self._failures = 0
        self._decisions = {}
        self._wait = None
        self.closest_call: ClosestCall | None = None

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

    # -- main thread: heartbeats only -------------------------------------------------

    def _heartbeat(self, event: str, facts: EventFacts) -> None:
        """Records a heartbeat of an event that is not per step in the step log."""
        self.steps.append(event, facts)
        if self._thread is None:
            self._start()

    # -- what the heartbeats say (watchdog thread, or the main thread at fit end) --------

    def _derive(self) -> None:
        """Reads the step log now (this guard's part: :meth:`read_steps`).

        The watchdog thread calls it before it reads what the heartbeats say (at
        least every :data:`READ_PERIOD_S` between exchanges, every :data:`PROBE_PERIOD_S`
        while the loop makes no progress); the main thread at
        fit end, at a checkpoint save and when it stops the thread.
        """
        self.steps.drain()

    def read_steps(self, entries: list[Entry]) -> None:
        """Reads heartbeats: intervals, phases, calibration (under the step log's lock).

        Each interval between two heartbeats is recorded under the phase kind of
        the first (once ``warmup_steps`` train batches ended), against the deadline
        then in force for the closest call; :attr:`_beat` becomes the last one.
        After the first train batch, and once calibrated, the thread is woken to
        exchange at once (:meth:`_exchange_now`).
        """
        last = self._beat
        at, kind = (None, "") if last is None else (last.at, last.kind)
        measure, warmup = self.auto_calibrate, self.warmup_steps
        done, after_eval = self._steps_done, self._after_eval
        spans: dict[str, list[float]] = {}  # the intervals read, by kind: recorded at the end
        for now, event, step, _, _, decisions in entries:
            if event == "fit_start":  # a new fit: no interval from the last one
                self._record(spans)
                spans, at, self.closest_call, done, after_eval = {}, None, None, 0, False
            if at is not None and measure and done >= warmup:
                span = spans.get(kind)
                if span is None:
                    spans[kind] = [now - at]
                else:
                    span.append(now - at)
            at = now
            if decisions:  # none at most events
                self._update_decisions(decisions, step)
            if done and not after_eval:  # the usual heartbeats of a train step, past the first
                if event == FETCH_END_BATCH_START or event == BATCH_END_FETCH_START:
                    # Two heartbeats at once: a zero interval between them, of the first's kind.
                    if event == BATCH_END_FETCH_START:
                        done += 1
                    if measure and done >= warmup:
                        train = spans.get("train")
                        if train is None:
                            spans["train"] = [0.0]
                        else:
                            train.append(0.0)
                    kind = "train" if event == FETCH_END_BATCH_START else "data"
                    continue
                if event == BATCH_END:
                    done += 1
                    kind = "train"
                    continue
                usual = _STEP_KINDS.get(event)
                if usual is not None:
                    kind = usual
                    continue
            self._steps_done, self._after_eval = done, after_eval
            pair = PAIRS.get(event)
            if pair is None:
                kind = self._kind(event)
            else:
                kind = self._kind(pair[0])
                if measure and self._steps_done >= warmup:
                    _add(spans, kind, 0.0)
                kind = self._kind(pair[1])
            done, after_eval = self._steps_done, self._after_eval
        self._steps_done, self._after_eval = done, after_eval
        self._record(spans)
        self._history.extend(entries)
        self._progress += len(entries)
        now, event, step, batch_index, loader, _ = expand(entries[-1:])[-1]
        self._beat = Beat(event, step, batch_index, loader, now, kind)
        if self._wake_at and self._steps_done >= self._wake_at:
            self._exchange_now()

    def _record(self, spans: Mapping[str, list[float]]) -> None:
        """Adds the intervals read to the calibration; the longest against its deadline.

        The closest call is the interval with the largest share of the deadline
        then in force for its kind: per kind, the longest.
        """
        closest, deadlines = self.closest_call, self._deadline_s
        for kind, seconds in spans.items():
            self.history.record_many(kind, seconds)
            deadline = deadlines.get(kind)
            longest = max(seconds)
            if deadline and (closest is None or longest > closest.share * deadline):
                closest = ClosestCall(longest / deadline, kind, longest, deadline)
        self.closest_call = closest

    def _update_decisions(self, decisions: Mapping[str, Any], step: int) -> None:
        """Keeps the decisions that can split the ranks, with the step each was last changed."""
        for name, value in decisions.items():
            seen = self._decisions.get(name)
            if (seen.value if seen is not None else None) != value:
                self._decisions[name] = Decision(value, step)

    def _probe_decisions(self) -> None:
        """Reads the adapter's decisions now (watchdog thread, at each status): never raises."""
        probe, beat = self._decision_probe, self._beat
        if probe is None or beat is None:
            return
        try:
            self._update_decisions(probe(), beat.step)
        except Exception as exc:  # a framework's state read from another thread
            logger.debug("rankguard %s: decision probe failed: %s", self.name, exc)

    def _kind(self, event: str) -> str:
        if event == "fit_end":
            return "done"
        if event == "train_batch_end":
            self._steps_done += 1
        if self._steps_done == 0:
            return "startup"
        if event in ("eval_start", "eval_batch_start", "eval_batch_end"):
            self._after_eval = False
            return "eval"
        if event in _LEAVE_OR_END_EVAL:
            self._after_eval = event == "eval_end"
            return _LEAVE_OR_END_EVAL[event]
        return "post_eval" if self._after_eval else "train"

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
        self._decisions["save"] = Decision(True, facts.step)
        self._heartbeat("checkpoint_save_start", facts)

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._decisions.pop("save", None)
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
            limit = 2 * self.exchange_period_s + self.exchange_timeout_s + self._settle_s
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
            self._decisions[f"{NAMES_DECISION}{name}"] = Decision(reduced, step)

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
            deadlines = {
                f"{k}_timeout_s" if k != "train" else "timeout_s": v
                for k, v in self.ceilings.items()
                if k not in ("startup", "data")
            }
            detect = self.exchange_period_s + self.exchange_timeout_s
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

    def _plan(self) -> str:
        """The INFO line at fit start: what is reported when, and when the job ends."""
        labels = KIND_LABELS
        ceilings = ", ".join(
            f"{labels[k]} {v:.0f} s" for k, v in self.ceilings.items() if k != "data"
        )
        end = "aborts" if self.action == "abort" else "reports again (action='report')"
        if not self.auto_calibrate:
            return f"deadlines (no calibration): {ceilings}; past one it {end}."
        if self._restored:
            calibrated = f"calibrated from the checkpoint: {describe(self._calibrated())}"
        else:
            calibrated = (
                f"calibrated after {self.warmup_steps} warm-up train steps to "
                f"{self.calibration_factor:g} x the 99th percentile of each phase's intervals, "
                f"at least {self.floor_s:g} s"
            )
        if self.abort_at == "calibrated":
            return f"deadlines {calibrated}, at most {ceilings}; past one it {end}."
        return f"reports at deadlines {calibrated}; {end} at the ceilings: {ceilings}."

    def _fit_defaults_under(self, pg_timeout: float | None) -> None:
        """Lowers defaulted ceilings so a hang ends before NCCL ends the job."""
        if pg_timeout is None:
            return
        detect = self.exchange_period_s + self.exchange_timeout_s
        fitted = max(self.exchange_period_s, 0.8 * pg_timeout - detect)
        for name in self.defaulted:
            if getattr(self, name) > fitted:
                setattr(self, name, fitted)
                logger.info(
                    "rankguard %s: `%s` set to %.0f s to report before NCCL's %.0f s timeout",
                    self.name,
                    name,
                    fitted,
                    pg_timeout,
                )

    def _calibrated(self) -> dict:
        return calibrate(
            self.history,
            self.ceilings,
            factor=self.calibration_factor,
            floor_s=self.floor_s,
            save_estimate=self._save_estimate,
        )

    def _recalibrate(self) -> None:
        """Sets the deadlines from the intervals seen (at each status exchange)."""
        self._derive()
        ready = self._restored or self._steps_done >= self.warmup_steps
        if not self.auto_calibrate or not ready:
            return
        calibrated = self._calibrated()
        train = self.history.snapshot()["train"]
        if len(train) >= MIN_SAMPLES:
            step_p99 = quantile(train, QUANTILE)
            self._settle_s = max(self.deadlock_after_s, self.calibration_factor * step_p99)
            self._record_settle_s = max(RECORD_SETTLE_S, self.calibration_factor * step_p99)
        self._deadline_s = {"startup": self.first_step_timeout_s}
        self._deadline_s.update({kind: d.seconds for kind, d in calibrated.items()})
        if not self._told_calibrated and self.history.count("train") >= MIN_SAMPLES:
            self._told_calibrated = True
            logger.info(
                "rankguard %s: calibrated at train step %d: reports past %s.",
                self.name,
                self._beat.step if self._beat else 0,
                describe(calibrated),
            )

    def _sample(self) -> tuple[list, str | None, float]:
        """Reads the loop's stack; tracks how long it has waited at one rendezvous."""
        stack = self._loop_stack()
        point = rendezvous(stack)
        now = _now()
        recorder = self._recorder
        state = (self._progress, recorder.counts() if recorder is not None else ())
        if state != self._quiet[0]:
            self._quiet = (state, now)
        if point is None:
            self._wait = None
            return stack, None, 0.0
        key = f"{point} at {user_frame(stack, self._libraries, source=False)}"
        wait = self._wait
        if wait is None or wait.key != key or wait.progress != self._progress:
            wait = self._wait = Wait(key, now, self._progress)
        return stack, point, now - wait.since

    def _status(self) -> RankStatus:
        self._derive()
        event, step, batch_index, loader, since, kind = self._beat  # set before the thread starts
        done = kind == "done"
        stack, waits_at, wait_s = self._sample()
        self._probe_decisions()
        key = self._wait.key if self._wait else None
        settled = waits_at is not None and wait_s >= self._settle_s
        pending, self._pending_usual = self._pending_usual, SeenWait(key, self._progress)
        if pending.key and self._progress > pending.progress and len(self._usual) < MAX_USUAL:
            self._usual.add(pending.key)  # a wait the loop came out of: a healthy one
        status = RankStatus(
            phase=phase_label(event, step, batch_index, loader),
            step=step,
            idle_s=round(_now() - since, 3),
            deadline_s=None if done else self._deadline_s[kind],
            host=self._host,
            pid=os.getpid(),
            blocked_in=blocked_in_call(stack),
            ceiling_s=None if done else self.ceilings[kind],
            gave_up=self._gave_up,
            user_frame=user_frame(stack, self._libraries),
            waits_at=waits_at,
            wait_s=round(wait_s, 3),
            settled=settled,
            progress=self._progress,
            usual=key in self._usual,
            direct=waits_at is not None and called_from_user(stack, self._libraries),
            decisions=tuple((n, v, s) for n, (v, s) in sorted(dict(self._decisions).items())),
            record=self._collectives(),
            quiet=self._quiet_s() >= self._record_settle_s,
            loop_thread=self._loop_thread_name,
        )
        if not done:
            return status
        # Fit ended here: this rank left the training loop and never comes back to a
        # rendezvous in it; while another rank waits at one, that is a proven deadlock.
        left = replace(status, waits_at=LEFT_LOOP, wait_s=status.idle_s, settled=True)
        return replace(left, phase=left_at(left), direct=False, usual=False)

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
        return _now() - self._quiet[1] if self._recorder is not None else 0.0

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
            if verdict.mismatch is not None:
                self._on_mismatch(*verdict.mismatch)
            if verdict.deadlock:
                self._on_deadlock(verdict)
            elif verdict.stuck:
                self._incident = verdict.stuck
                self._stage(verdict.summary, verdict.details, frozen=[], end=verdict.end)
            elif self._reported:
                self._recovered()
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
        """Whether the loop, without progress, has waited at one rendezvous for its settle time.

        Cheap while training goes on: the stack is read only once no heartbeat
        came for a probe period. A wait already exchanged is not exchanged
        again before another settle time has passed.
        """
        self._derive()
        beat = self._beat
        if beat is None or beat.kind == "done" or self._ended.is_set():
            return False
        if _now() - beat.at < PROBE_PERIOD_S:
            return False
        _, point, wait_s = self._sample()
        if point is not None and wait_s >= self._settle_s:
            marker, again_s = self._wait, self._settle_s
        elif self._recorder is not None and self._quiet_s() >= self._record_settle_s:
            # Issued nothing for its settle time: its record may prove a desync that no stack
            # shows (NCCL, async collectives: the thread waits later, at a host sync).
            marker, again_s = ("record", self._quiet[1]), self._record_settle_s
        else:
            return False
        probed = self._probed
        if probed is not None and probed.wait == marker and _now() - probed.at < again_s:
            return False
        self._probed = EarlyExchange(marker, _now())
        return True

    def _on_deadlock(self, verdict: Verdict) -> None:
        """A proven deadlock: report at once; with ``deadlock_action="abort"`` end the job.

        With ``"report"`` it is reported once and the incident ends at the
        ceiling as any other (stage 2, :data:`HANG_EXIT_CODE` with ``action="abort"``).
        """
        self._incident = verdict.stuck
        if self.deadlock_action == "abort":
            self._report(verdict.summary, verdict.details, [], final=True, deadlock=True)
        elif not self._reported:
            self._report(verdict.summary, verdict.details, [], final=False, deadlock=True)
        elif verdict.end and not self._ended.is_set():
            self._report(verdict.summary, verdict.details, [], final=True)

    def _on_mismatch(self, key: str, text: str) -> None:
        """Collectives paired with the wrong partner while the job runs: told once each."""
        if self.collective_mismatch == "abort":  # every rank got the same verdict
            summary = f"collective mismatch, {text.rstrip('.')}"
            self._report(summary, (), [], final=True, deadlock=True)
        elif key not in self._told_mismatch and self.channel.is_leader:
            self._told_mismatch.add(key)
            logger.warning("rankguard %s: Collective mismatch: %s", self.name, text)

    def _on_missing(self, missing: list[int]) -> None:
        waited = self.exchange_period_s + self._failures * self.exchange_timeout_s
        given_up = self._gave_up[1] if self._gave_up else ()
        verdict = gone(
            missing,
            rank=self.channel.rank,
            waited_s=waited,
            last=self._last,
            default_s=self.ceilings["startup"],
            given_up=given_up,
        )
        if verdict is not None and not self._stop.is_set() and self._beat.kind != "done":
            frozen = [r for first, last in verdict.stuck for r in range(first, last + 1)]
            self._stage(verdict.summary, verdict.details, frozen=frozen, end=verdict.end)

    def _stage(self, summary: str, details: tuple[str, ...], frozen: list[int], end: bool) -> None:
        """Acts on a stuck verdict: stage 1 (report once) or stage 2 (end the incident)."""
        if self._ended.is_set():
            return  # stage 2 done (action="report"): once per incident
        if end or self.abort_at == "calibrated":
            self._report(summary, details, frozen, final=True)
        elif not self._reported:
            self._report(summary, details, frozen, final=False)

    def _recovered(self) -> None:
        """Every rank made progress again: the incident was a slow phase, or it ended."""
        if self._reported:
            slow = ": the phase reported was slow, not stuck; its deadline now allows for it"
            logger.info(
                "rankguard %s: every rank is making progress again%s.",
                self.name,
                "" if self._ended.is_set() else slow,
            )
        self._incident, self._reported, self._gave_up = (), False, None
        self._ended.clear()

    def _report(
        self,
        summary: str,
        details: tuple[str, ...],
        frozen: list[int],
        final: bool,
        deadlock: bool = False,
    ) -> None:
        rank, status = self.channel.rank, self._status()
        header = f"rank {rank}, host {status.host}, pid {status.pid}: {status.phase}"
        report = attempt_dir(self.report_dir, os.environ)
        wall = time.time() - _now()  # the beats' monotonic times as wall-clock times
        beats = [
            {"t": wall + t, "event": e, "phase": phase_label(e, s, b, ld), "step": s}
            for t, e, s, b, ld, _ in expand(list(self._history))
        ]
        writer = min(r for r in range(self.channel.world_size) if r not in frozen)
        stage = (
            "Stage 2: the incident ends (ceiling, or a check gave up waiting)."
            if final
            else "Stage 1: reported at the calibrated deadline; training goes on."
        )
        if deadlock:
            stage = (
                f"Proven deadlock: the job ends now with exit code {DEADLOCK_EXIT_CODE}."
                if final
                else "Proven deadlock (deadlock_action='report'): the two stages go on."
            )
        text = (
            "\n".join([summary, "", *details, stage, "", self._nccl_note])
            if rank == writer
            else None
        )
        first_line = f"{header}, idle {status.idle_s:.1f} s"
        try:
            write_incident(
                report, rank, first_line, beats, text, loop_thread=self._loop_thread, status=status
            )
        except OSError as exc:
            logger.error("rankguard %s: could not write the report: %s", self.name, exc)
        if final or deadlock:
            write_flight_recorder(report, rank)  # where the running torch keeps one
        where = (
            f"This is {header}. Stacks in {report}/rank{rank}.txt; "
            f"summary in {report}/summary.txt. {self._nccl_note}".rstrip()
        )
        if not self._reported:
            self.incidents += 1  # counted once per incident (tests wait on it)
        self._reported = True
        if not final:
            heading = "Deadlock" if deadlock else "Hang suspected"
            self.last_incident = HangDetectedError(
                "\n".join([f"{heading}: {summary}.", *details, where])
            )
            then = "aborts" if self.action == "abort" else "reports again"
            logger.warning(
                "rankguard %s: %s Training goes on; it %s if there is still no progress at "
                "the ceiling.",
                self.name,
                self.last_incident,
                then,
            )
            return
        heading = "Deadlock" if deadlock else "Hang"
        self.last_incident = HangDetectedError(
            "\n".join([f"{heading}: {summary}.", *details, where])
        )
        self.ceilings_reached += 1
        self._gave_up = None
        code = DEADLOCK_EXIT_CODE if deadlock else HANG_EXIT_CODE
        aborts = deadlock or self.action == "abort"
        then = f"aborting with exit code {code}" if aborts else "waiting"
        logger.error("rankguard %s: %s Now %s.", self.name, self.last_incident, then)
        self._ended.set()
        if aborts:
            self._abort(code)

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
