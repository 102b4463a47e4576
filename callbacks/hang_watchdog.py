"""HangWatchdog: names the rank that stopped, where, with its stack, within seconds of a deadline.

The main thread only records heartbeats (a tuple assignment and a deque
append per event, no lock, no I/O). A daemon thread per rank exchanges each
rank's status on the side channel every ``exchange_period_s``; rank 0 applies
:func:`~rankguard.callbacks.hang_diagnosis.diagnose`, and every rank gets the
same verdict. A rank blocked in a C++ collective releases the GIL, so its
thread keeps answering: it is named by phase. With its status the thread
sends where the training loop is blocked, read from that thread's Python
frames (by the watchdog thread, never on the main thread): a rank blocked in
``torch.distributed`` waits for a peer, which tells it apart from the rank
it waits for even when both sent their last heartbeat at the same point. A
rank whose process is frozen or dead stops answering: it is named as such. See
:mod:`rankguard.callbacks.hang_report` for the files written.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from rankguard.callbacks.errors import HangDetectedError, RanksMissingError
from rankguard.callbacks.events import EventFacts
from rankguard.callbacks.guard import Guard, check_choice, check_positive
from rankguard.callbacks.hang_diagnosis import (
    RankStatus,
    Verdict,
    blocked_in,
    describe_frozen,
    diagnose,
    flight_recorder_note,
    frozen_ranks,
    nccl_timeout_advice,
    next_step,
    phase_deadline,
    phase_label,
)
from rankguard.callbacks.hang_report import write_incident

__all__ = ["HANG_EXIT_CODE", "HangWatchdog", "process_group_timeout"]

logger = logging.getLogger(__name__)

#: Exit code of every rank that aborts on a hang (``action="abort"``); 75 is EX_TEMPFAIL.
HANG_EXIT_CODE = 75

STATUS_EXCHANGE = "hang_watchdog/status"
ABORT_BARRIER = "hang_watchdog/abort"
HISTORY = 256  # heartbeats kept per rank for rank{N}.jsonl
MAX_FRAMES = 64  # frames of the training loop read at each exchange
#: Events that end a phase after eval: back in the train loop, or a checkpoint save.
_LEAVE_OR_END_EVAL = (
    "eval_end",
    "checkpoint_save_start",
    "data_fetch_start",
    "data_fetch_end",
    "train_batch_start",
)

#: Deadlines used when an argument is left at ``None``; under NCCL they are
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
    a private ``torch.distributed`` attribute (``tests/test_hang_watchdog.py``
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


def _check_report_dir(report_dir: Any) -> str:
    if not isinstance(report_dir, str | os.PathLike) or not str(report_dir):
        raise ValueError(f"`report_dir` must be a directory path; got {report_dir!r}.")
    path = Path(report_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"`report_dir` {str(report_dir)!r} is not writable (checked {existing}).")
    return str(report_dir)


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}; got {value!r}.")
    return value


class HangWatchdog(Guard):
    """Reports which ranks stopped making progress, where, and their Python stacks.

    On an incident every rank logs the verdict (``logging.ERROR``) and writes
    its stacks to ``report_dir/rank{N}.txt``; rank 0 writes ``summary.txt``.
    With ``action="abort"`` every rank then exits with :data:`HANG_EXIT_CODE`
    (75) through ``os._exit``, so the launcher tears the job down even when
    the main thread is stuck in C++.

    Deadlines bound the time without any heartbeat in a phase: train steps
    (``timeout_s``), eval batches (``eval_timeout_s``), from eval end until
    the rank fetches its next train batch (``post_eval_timeout_s``),
    checkpoint saves (``checkpoint_timeout_s``); until the first train batch
    ends only ``first_step_timeout_s`` applies (compile, warm-up); after fit
    end none. A rank back in its train loop is training: when it waits there
    for a rank still busy after eval (Composer all-reduces in every data
    fetch), ``timeout_s`` applies to it, so it is reported as waiting, not
    as stuck after eval.

    Under NCCL, a deadline left at its default (``None``) is lowered to fit
    inside the process group's timeout, so the watchdog reports before NCCL
    ends the job; a deadline you set that does not fit gets a warning with
    the fix.

    Args:
        timeout_s: Deadline of train phases (seconds; default 600).
        eval_timeout_s: Deadline of eval phases (default 600).
        post_eval_timeout_s: Deadline from eval end back to the train loop (default 600).
        checkpoint_timeout_s: Deadline of a checkpoint save (default 1800).
        first_step_timeout_s: Deadline of everything before the first train batch ends.
        action: ``"abort"`` (exit with :data:`HANG_EXIT_CODE`) or ``"report"``
            (report once per incident, keep waiting).
        report_dir: Directory for the report files; must be writable.
        exchange_period_s: Time between status exchanges. A stuck rank is
            reported within its deadline + ``exchange_period_s``; a rank that
            stops answering (frozen, dead) within the deadline + about
            ``exchange_period_s`` + ``exchange_timeout_s`` (5 s more when it is
            rank 0, which decides the exchanges).
        auto_calibrate: After ``warmup_steps`` train steps, lower each phase's
            deadline to ``calibration_factor`` x its slowest observed interval,
            never below ``floor_s`` nor above the configured deadline.
        warmup_steps: Train steps before intervals are observed.
        calibration_factor: Multiple of the slowest interval (> 1).
        floor_s: Lowest calibrated deadline.

    Attributes:
        exchange_timeout_s: How long rank 0 waits for every rank's status,
            ``max(2, exchange_period_s)``.
        incidents: Incidents reported by this rank so far.
        last_incident: The last incident as a :class:`HangDetectedError`
            (its message is the logged report), or ``None``.

    Metrics: none. Exit code: :data:`HANG_EXIT_CODE`. Files: see
    :mod:`rankguard.callbacks.hang_report`.

    Example::

        watchdog = HangWatchdog(timeout_s=300, post_eval_timeout_s=120, action="abort")
        # log: rank 1 stuck 121 s in after eval of 'eval' (deadline 120 s);
        #      ranks 0,2,3 waiting 119 s in train batch 2001
    """

    name = "hang_watchdog"

    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        eval_timeout_s: float | None = None,
        post_eval_timeout_s: float | None = None,
        checkpoint_timeout_s: float | None = None,
        first_step_timeout_s: float = 1800.0,
        action: str = "abort",
        report_dir: str = "./rankguard_reports",
        exchange_period_s: float = 10.0,
        auto_calibrate: bool = False,
        warmup_steps: int = 20,
        calibration_factor: float = 10.0,
        floor_s: float = 60.0,
    ) -> None:
        super().__init__()
        given = {
            "timeout_s": timeout_s,
            "eval_timeout_s": eval_timeout_s,
            "post_eval_timeout_s": post_eval_timeout_s,
            "checkpoint_timeout_s": checkpoint_timeout_s,
        }
        #: Deadline arguments left at their default, which fit under NCCL's timeout.
        self.defaulted = {name for name, value in given.items() if value is None}
        for name, value in given.items():
            value = DEFAULT_DEADLINES[name] if value is None else check_positive(name, value)
            setattr(self, name, value)
        self.first_step_timeout_s = check_positive("first_step_timeout_s", first_step_timeout_s)
        self.action = check_choice("action", action, ("abort", "report"))
        self.report_dir = _check_report_dir(report_dir)
        self.exchange_period_s = check_positive("exchange_period_s", exchange_period_s)
        self.auto_calibrate = bool(check_choice("auto_calibrate", auto_calibrate, (True, False)))
        self.warmup_steps = _check_count("warmup_steps", warmup_steps, 0)
        self.calibration_factor = check_positive("calibration_factor", calibration_factor)
        if self.calibration_factor <= 1:
            raise ValueError(f"`calibration_factor` must be > 1; got {calibration_factor!r}.")
        self.floor_s = check_positive("floor_s", floor_s)
        self.exchange_timeout_s = max(2.0, self.exchange_period_s)
        self.incidents = 0
        self.last_incident: HangDetectedError | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the thread's sleep early (fit end, close)
        self._history: collections.deque = collections.deque(maxlen=HISTORY)
        self._nccl_note = ""
        self._host = socket.gethostname()
        self._beat: tuple | None = None  # (event, step, batch_index, loader, monotonic, kind)
        self._loop_thread: int | None = None  # ident of the thread that sends the events
        self._reset()

    @property
    def deadlines(self) -> dict[str, float]:
        """Configured deadline per phase kind."""
        return {
            "startup": self.first_step_timeout_s,
            "train": self.timeout_s,
            "eval": self.eval_timeout_s,
            "post_eval": self.post_eval_timeout_s,
            "checkpoint": self.checkpoint_timeout_s,
        }

    def _reset(self) -> None:
        self._slowest: dict[str, float] = {}
        self._steps_done = 0
        self._after_eval = False
        self._incident_open = False
        self._last: Verdict | None = None
        self._failures = 0

    # -- main thread: heartbeats only -------------------------------------------------

    def _heartbeat(self, event: str, facts: EventFacts) -> None:
        now = time.monotonic()
        previous = self._beat
        if previous is not None and self.auto_calibrate and self._steps_done >= self.warmup_steps:
            interval, kind = now - previous[4], previous[5]
            if interval > self._slowest.get(kind, 0.0):
                self._slowest[kind] = interval
        loader = facts.loader.name if facts.loader is not None else None
        self._beat = (event, facts.step, facts.batch_index, loader, now, self._kind(event))
        self._history.append((time.time(), event, facts.step, facts.batch_index, loader))
        if self._thread is None:
            self._start()

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
            return {"eval_end": "post_eval", "checkpoint_save_start": "checkpoint"}.get(
                event, "train"
            )
        return "post_eval" if self._after_eval else "train"

    def on_fit_start(self, facts: EventFacts) -> None:
        """Starts the watchdog thread (a new fit starts from a clean state)."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None  # it ended with the previous fit
        self._reset()
        self._heartbeat("fit_start", facts)

    def on_epoch_start(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("epoch_start", facts)

    def on_data_fetch_start(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("data_fetch_start", facts)

    def on_data_fetch_end(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("data_fetch_end", facts)

    def on_train_batch_start(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("train_batch_start", facts)

    def on_train_batch_end(self, facts: EventFacts) -> None:
        """Records a heartbeat; the first one ends the first-step deadline."""
        self._heartbeat("train_batch_end", facts)

    def on_eval_start(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("eval_start", facts)

    def on_eval_batch_start(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("eval_batch_start", facts)

    def on_eval_batch_end(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("eval_batch_end", facts)

    def on_eval_end(self, facts: EventFacts) -> None:
        """Records a heartbeat; ``post_eval_timeout_s`` applies until the next data fetch."""
        self._heartbeat("eval_end", facts)

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Records a heartbeat; ``checkpoint_timeout_s`` applies."""
        self._heartbeat("checkpoint_save_start", facts)

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        """Records a heartbeat."""
        self._heartbeat("checkpoint_save_end", facts)

    def on_fit_end(self, facts: EventFacts) -> None:
        """Records the end of fit: no deadline from here on; tells the other ranks at once."""
        self._heartbeat("fit_end", facts)
        self._wake.set()

    def close(self) -> None:
        """Stops and joins the watchdog thread; safe to call twice and after an error."""
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            self._stop.set()
            self._wake.set()
            return
        if self._beat is not None and self._beat[5] == "done":
            # Fit ended here: let the exchange that finds every rank done end all threads
            # together, so no rank is left waiting for a rank that already left.
            thread.join(timeout=2 * self.exchange_period_s + self.exchange_timeout_s)
        self._stop.set()
        self._wake.set()
        # An exchange in flight ends within its timeout (+ the followers' grace).
        thread.join(timeout=1.25 * self.exchange_timeout_s + 7.0)

    # -- watchdog thread ----------------------------------------------------------------

    def _start(self) -> None:
        self._loop_thread = threading.get_ident()
        backend, pg_timeout = process_group_timeout()
        if backend == "nccl":
            self._fit_defaults_under(pg_timeout)
            deadlines = {
                f"{k}_timeout_s" if k != "train" else "timeout_s": v
                for k, v in self.deadlines.items()
                if k != "startup"
            }
            detect = self.exchange_period_s + self.exchange_timeout_s
            advice = nccl_timeout_advice(pg_timeout, deadlines, detect)
            if advice and self.channel.is_leader:
                self.warn_once("nccl_timeout", advice)
            self._nccl_note = flight_recorder_note(os.environ, self.channel.rank)
        self._stop.clear()
        self._wake.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"rankguard-{self.name}", daemon=True
        )
        self._thread.start()

    def _fit_defaults_under(self, pg_timeout: float | None) -> None:
        """Lowers defaulted deadlines so a hang is reported before NCCL ends the job."""
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

    def _status(self) -> RankStatus:
        beat = self._beat
        event, step, batch_index, loader, since, kind = beat  # set before the thread starts
        deadline = phase_deadline(
            kind,
            self.deadlines,
            self._slowest,
            calibrate=self.auto_calibrate,
            factor=self.calibration_factor,
            floor_s=self.floor_s,
        )
        return RankStatus(
            phase=phase_label(event, step, batch_index, loader),
            step=step,
            idle_s=round(time.monotonic() - since, 3),
            deadline_s=deadline,
            host=self._host,
            pid=os.getpid(),
            blocked_in=blocked_in(self._loop_stack()),
        )

    def _loop_stack(self) -> list[tuple[str, int, str]]:
        """The training loop thread's frames (innermost first), read from the watchdog thread."""
        frame = sys._current_frames().get(self._loop_thread)
        stack = []
        while frame is not None and len(stack) < MAX_FRAMES:
            stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        return stack

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                verdict = self.channel.exchange(
                    STATUS_EXCHANGE, self._status(), diagnose, timeout_s=self.exchange_timeout_s
                )
            except RanksMissingError as missing:
                self._failures += 1
                self._on_missing(missing.missing)
                continue  # the exchange itself waited; ask again at once
            except Exception as exc:
                if not self._stop.is_set() and self._beat[5] != "done":
                    self.warn_once("exchange", "status exchange failed (%s); retrying.", exc)
                self._sleep()
                continue
            self._failures = 0
            self._last = verdict
            if verdict.stuck:
                details = (*verdict.details, next_step(verdict.first, []))
                self._incident(verdict.summary, details, frozen=[])
            else:
                self._incident_open = False
            if verdict.done == ((0, self.channel.world_size - 1),):
                return  # every rank's fit ended: every thread ends after this same exchange
            self._sleep()

    def _sleep(self) -> None:
        self._wake.wait(self.exchange_period_s)
        self._wake.clear()

    def _on_missing(self, missing: list[int]) -> None:
        waited = self.exchange_period_s + self._failures * self.exchange_timeout_s
        frozen = frozen_ranks(
            missing,
            rank=self.channel.rank,
            waited_s=waited,
            last=self._last,
            default_s=self.first_step_timeout_s,
        )
        if frozen and not self._stop.is_set() and self._beat[5] != "done":
            summary = describe_frozen(frozen, waited, self._last)
            self._incident(summary, (next_step(None, frozen),), frozen=frozen)

    def _incident(self, summary: str, details: tuple[str, ...], frozen: list[int]) -> None:
        if self._incident_open:
            return
        self._incident_open = True
        rank, status = self.channel.rank, self._status()
        header = f"rank {rank}, host {status.host}, pid {status.pid}: {status.phase}"
        report = Path(self.report_dir)
        beats = [
            {"t": t, "event": e, "phase": phase_label(e, s, b, ld), "step": s}
            for t, e, s, b, ld in tuple(self._history)
        ]
        writer = min(r for r in range(self.channel.world_size) if r not in frozen)
        text = "\n".join([summary, "", *details, "", self._nccl_note]) if rank == writer else None
        first_line = f"{header}, idle {status.idle_s:.1f} s"
        try:
            write_incident(
                report, rank, first_line, beats, text, loop_thread=self._loop_thread, status=status
            )
        except OSError as exc:
            logger.error("rankguard %s: could not write the report: %s", self.name, exc)
        then = f"aborting with exit code {HANG_EXIT_CODE}" if self.action == "abort" else "waiting"
        self.last_incident = HangDetectedError(
            "\n".join(
                [
                    f"Hang: {summary}.",
                    *details,
                    f"This is {header}. Stacks in {report}/rank{rank}.txt; "
                    f"summary in {report}/summary.txt. {self._nccl_note}".rstrip(),
                ]
            )
        )
        logger.error("rankguard %s: %s Now %s.", self.name, self.last_incident, then)
        self.incidents += 1  # counted once reported (tests wait on it)
        if self.action == "abort":
            self._abort()

    def _abort(self) -> None:
        for handler in logging.getLogger().handlers:
            handler.flush()
        try:  # every rank has read the verdict before any exits
            self.channel.barrier(ABORT_BARRIER, timeout_s=self.exchange_timeout_s)
            self._leave_store_last()
        except Exception:
            logger.debug("rankguard %s: abort barrier incomplete", self.name)
        os._exit(HANG_EXIT_CODE)

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
