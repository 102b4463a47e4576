"""The hang watchdog's background thread: status exchanges, calibration, reports, the exit.

Owned by :class:`~rankguard.callbacks.hang.hang_watchdog.HangWatchdog`, which keeps the
settings and the heartbeats; what decides is pure beside it (``verdict``, ``incident``).
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
from pathlib import Path
from typing import Any

from rankguard.callbacks.core.errors import HangDetectedError, RanksMissingError
from rankguard.callbacks.core.interrupts import wait_through_signals
from rankguard.callbacks.core.side_channel import POLLS_PER_S, notices, spread_period
from rankguard.callbacks.core.step_log import expand
from rankguard.callbacks.hang import deadlines as policy
from rankguard.callbacks.hang import incident
from rankguard.callbacks.hang.calibration import calibrate, describe
from rankguard.callbacks.hang.collective_files import write_flight_recorder
from rankguard.callbacks.hang.collectives import CollectiveRecorder
from rankguard.callbacks.hang.deadlines import Settle
from rankguard.callbacks.hang.fault_watch import FaultWatch
from rankguard.callbacks.hang.incident import Report
from rankguard.callbacks.hang.job import attempt_dir, process_group_timeout
from rankguard.callbacks.hang.rank_status import rank_status
from rankguard.callbacks.hang.report import write_incident
from rankguard.callbacks.hang.stacks import code_name
from rankguard.callbacks.hang.status import GaveUp, RankStatus, Runs, Verdict, in_runs
from rankguard.callbacks.hang.verdict import diagnose
from rankguard.callbacks.hang.verdict_text import (
    flight_recorder_note,
    nccl_timeout_advice,
    phase_label,
)

# The watchdog's logger (its name is what users filter by), shared with hang_watchdog.py.
logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

_now = time.perf_counter  # the step log's clock: heartbeats are compared with it

STATUS_EXCHANGE = "hang_watchdog/status"
HISTORY = 256  # heartbeats kept per rank for rank{N}.jsonl
MAX_FRAMES = 64  # frames of the training loop read at each exchange
#: While this rank makes no progress, its own stack is sampled this often (seconds).
PROBE_PERIOD_S = 0.5
#: While it makes progress, the watchdog thread wakes this often (seconds) to read the step
#: log: a wake costs tens of µs of CPU and a read a fixed cost besides its entries', so
#: rarer reads while training goes on make the thread's share of a step 2-3 times smaller.
READ_PERIOD_S = 2.0
#: ``HangWatchdog(exchange_period_s=...)``'s default (seconds).
DEFAULT_PERIOD_S = 10.0
#: Ranks a second whose status exchange the store serves, job-wide, at the default period
#: (three requests each on a rank but 0): beyond 2,560 ranks the default period grows
#: (:meth:`spread_period`). With the polls and the interval exchanges, rankguard's steady
#: load on the store stays under 10% of its one thread at 16,384 ranks (docs/scale.md).
STATUS_RANKS_PER_S = 256.0
#: Ranks missing before the first verdict that this rank asks the store about, at most.
HEARD_CHECKS = 16
#: A deadlock seen at one exchange is confirmed by the next, this long after (seconds): ranks
#: leave one collective a few milliseconds apart, so a status sampled just before one rank
#: returned from it must not confirm it.
CONFIRM_AFTER_S = 1.0


class StorePolls:
    """When the watchdog thread reads the store for a peer's fault or a stop request.

    At each of its wakes (every 0.5-2 s) it looks, at most once a period that grows with
    the world size (:func:`~rankguard.callbacks.core.side_channel.spread_period`: every
    wake up to 512 ranks, every 16 s at 16,384), so that the job's polls stay near
    :data:`~rankguard.callbacks.core.side_channel.POLLS_PER_S` requests a second. A look is
    one request: the channel's notices, which every publisher of a fault or a stop
    request bumps; the fault board and the stop count are read only once they changed.
    """

    def __init__(self) -> None:
        self.reset(None)

    def reset(self, channel: Any) -> None:
        """A new fit on ``channel``: nothing seen yet."""
        self.channel = channel
        self.seen = 0
        self.next_at = -math.inf
        distributed = channel is not None and channel.is_distributed
        self.period_s = spread_period(0.0, channel.world_size, POLLS_PER_S) if distributed else 0.0

    def look(self) -> bool:
        """Whether the board and the stop count need reading now (something was published).

        ``False`` until a period passed since the last look. A store that cannot be read
        says ``True``: the reads that follow find out what is wrong, as before.
        """
        channel = self.channel
        if channel is None or not channel.is_distributed:
            return True  # no store: the reads are local
        now = _now()
        if now < self.next_at:
            return False
        self.next_at = now + self.period_s
        try:
            count = notices(channel)
        except Exception as exc:  # the store: the board's read says what is wrong
            logger.debug("rankguard: notices unreadable: %s", exc)
            return True
        fresh, self.seen = count != self.seen, count
        return fresh


class WatchdogThread:
    """The thread of one :class:`HangWatchdog` (``guard``), and the state it keeps.

    ``guard`` gives the settings, the heartbeats read (its ``_phases``, ``_waits``,
    ``history``) and the counts the thread updates (``incidents``, ``last_incident``...).
    It is typed loosely: the guard's module imports this one.
    """

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.wake = threading.Event()  # ends the thread's sleep early (fit end, close)
        self.ended = threading.Event()  # the open incident reached stage 2
        self.settle: Settle = policy.settle_times(guard.deadlock_after_s, guard.calibration_factor)
        self.recorder: CollectiveRecorder | None = None
        self.told_mismatch: set[str] = set()
        self.entries: deque = deque(maxlen=HISTORY)  # the last entries read: rank{N}.jsonl
        self.nccl_note = ""
        self.host = socket.gethostname()
        self.loop_thread: int | None = None  # ident of the thread that sends the events
        self.loop_thread_name: str | None = None  # its name, as the record names threads
        self.faults = FaultWatch(self)  # a rank that raised or died
        self.polls = StorePolls()  # when the board and the stop count are read
        self.store_failed_at: float | None = None  # the first of consecutive failed exchanges
        self.reset()

    def reset(self) -> None:
        """A new fit: a new incident state (the calibration is kept)."""
        self.deadline_s: dict[str, float] = self.guard.ceilings
        self.read_wake = False  # the thread read a wake point: exchange at once
        self.incident: Runs = ()
        self.reported = False
        self.ended.clear()
        self.gave_up: GaveUp | None = None
        self.told_calibrated = False
        self.last: Verdict | None = None
        self.failures = 0
        self.faults.reset()

    # -- start and stop (the training thread) --------------------------------------------

    def prepare(self) -> None:
        """Fits the ceilings under NCCL's timeout, sets the deadlines, logs the plan."""
        guard = self.guard
        self.loop_thread = threading.get_ident()
        self.loop_thread_name = threading.current_thread().name
        guard._derive()  # the first heartbeat: the thread reads _beat from its start
        self.spread_period()
        backend, pg_timeout = process_group_timeout()
        if backend == "nccl":
            self.fit_defaults_under(pg_timeout)
            detect = guard.exchange_period_s + guard.exchange_timeout_s
            deadlines = policy.ceiling_arguments(guard.ceilings)
            advice = nccl_timeout_advice(pg_timeout, deadlines, detect)
            if advice and guard.channel.is_leader:
                guard.warn_once("nccl_timeout", advice)
            self.nccl_note = flight_recorder_note(os.environ, guard.channel.rank)
        self.deadline_s = guard.ceilings
        self.told_calibrated = guard._restored  # the plan below says so
        self.recalibrate()
        logger.info("rankguard %s: %s", guard.name, self.plan())
        self.stop.clear()
        self.wake.clear()

    def launch(self) -> None:
        """Starts the record of collectives and the thread."""
        self._start_recorder()
        self.thread = threading.Thread(
            target=self._run, name=f"rankguard-{self.guard.name}", daemon=True
        )
        self.thread.start()

    def _start_recorder(self) -> None:
        """Starts this rank's record of collectives (in the report folder), where it can."""
        channel = self.guard.channel
        if self.recorder is not None or not channel.is_distributed:
            return
        folder = attempt_dir(self.guard.report_dir, os.environ)
        guard = self.guard
        recorder = CollectiveRecorder(
            folder, channel.rank, guard._libraries, phase=guard._issuing_phase
        )
        if recorder.install():
            self.recorder = recorder

    def close(self, fit_ended: bool) -> None:
        """Stops and joins the thread (``fit_ended``: first let the last exchange end it)."""
        guard = self.guard
        thread, self.thread = self.thread, None
        self.faults.leave("closed")  # its process may end now: not a rank gone
        if thread is None or thread is threading.current_thread():
            self.stop.set()
            self.wake.set()
            self.close_recorder()
            return
        if fit_ended:
            # Fit ended here: let the exchange that finds every rank done end all threads
            # together, so no rank is left waiting for a rank that already left. Until then
            # this rank's status says it left the loop: a rank that waits at a rendezvous
            # in it for its settle time proves a deadlock (the thread then ends the job).
            limit = 2 * guard.exchange_period_s + guard.exchange_timeout_s + self.settle.stack_s
            self._join(thread, limit)
            training, phases = self._still_training()
            if thread.is_alive() and training:
                self.faults.left_early(training, phases)
        self.stop.set()
        self.wake.set()
        # An exchange in flight ends within its timeout (+ the followers' grace).
        self._join(thread, 1.25 * guard.exchange_timeout_s + 7.0)
        self.close_recorder()

    def _still_training(self) -> tuple[list[int], str]:
        """The ranks whose fit had not ended at the last verdict, and every rank's phase then."""
        last, world = self.last, self.guard.channel.world_size
        if last is None or self.ended.is_set():
            return [], ""
        return [r for r in range(world) if not in_runs(r, last.done)], last.phases

    @staticmethod
    def _join(thread: threading.Thread, limit_s: float) -> None:
        """Joins ``thread`` (at most ``limit_s``), through a signal handler's exception.

        A launcher stops the other ranks with SIGTERM once one exits, often while they
        close; a framework's handler may raise then (OLMo-core's, after a failed fit).
        """
        wait_through_signals(
            thread.join, lambda: not thread.is_alive(), limit_s, "rankguard's watchdog closed"
        )

    def close_recorder(self) -> None:
        """Restores torch.distributed; keeps the record files unless fit ended healthy."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            beat = self.guard._beat
            healthy = beat is not None and beat.kind == "done" and not self.guard.incidents
            recorder.close(keep=not healthy)

    # -- deadlines ----------------------------------------------------------------------

    def _settings(self) -> policy.Settings:
        """The settings the deadline policy reads."""
        g = self.guard
        return policy.Settings(
            g.auto_calibrate,
            g.warmup_steps,
            g.calibration_factor,
            g.floor_s,
            g.first_step_timeout_s,
            g.deadlock_after_s,
            g.action,
            g.abort_at,
        )

    def plan(self) -> str:
        """The INFO line at fit start: what is reported when, and when the job ends."""
        g = self.guard
        restored = self._calibrated() if g._restored else None
        return policy.plan(g.ceilings, self._settings(), restored)

    def spread_period(self) -> None:
        """A default ``exchange_period_s`` grows with the world beyond 2,560 ranks.

        Every rank's status exchange costs the store's one thread three requests: at
        ``world_size / STATUS_RANKS_PER_S`` seconds (64 s at 16,384 ranks) the job's
        status exchanges ask it for a bounded rate (docs/scale.md). A period the user
        set to anything but the default stays as set.
        """
        g = self.guard
        channel = g.channel
        if g.exchange_period_s != DEFAULT_PERIOD_S or not channel.is_distributed:
            return
        period = spread_period(DEFAULT_PERIOD_S, channel.world_size, STATUS_RANKS_PER_S)
        if period > g.exchange_period_s:
            g.exchange_period_s, g.exchange_timeout_s = period, max(2.0, period)
            logger.info(
                "rankguard %s: `exchange_period_s` set to %.0f s for %d ranks (the job's store "
                "serves every rank's status exchange; docs/scale.md)",
                g.name,
                period,
                channel.world_size,
            )

    def fit_defaults_under(self, pg_timeout: float | None) -> None:
        """Lowers defaulted ceilings so a hang ends before NCCL ends the job."""
        g = self.guard
        values = {name: getattr(g, name) for name in g.defaulted}
        period, timeout = g.exchange_period_s, g.exchange_timeout_s
        fitted = policy.fit_defaults_under(
            values, g.defaulted, pg_timeout, exchange_period_s=period, exchange_timeout_s=timeout
        )
        for name, seconds in fitted.items():
            setattr(g, name, seconds)
            logger.info(
                "rankguard %s: `%s` set to %.0f s to report before NCCL's %.0f s timeout",
                g.name,
                name,
                seconds,
                pg_timeout,
            )

    def _calibrated(self) -> dict:
        g = self.guard
        factor, floor_s, save_estimate = g.calibration_factor, g.floor_s, g._save_estimate
        return calibrate(
            g.history, g.ceilings, factor=factor, floor_s=floor_s, save_estimate=save_estimate
        )

    def recalibrate(self) -> None:
        """Sets the deadlines from the intervals seen (at each status exchange)."""
        g = self.guard
        g._derive()
        ready = g._restored or g._phases.steps_done >= g.warmup_steps
        if not g.auto_calibrate or not ready:
            return
        new = policy.recalibrate(g.history, g.ceilings, self._settings(), g._save_estimate)
        if new.settle is not None:
            self.settle = new.settle
        self.deadline_s = new.deadlines
        if not self.told_calibrated and new.settle is not None:
            self.told_calibrated = True
            step = g._beat.step if g._beat else 0
            describe_ = describe(new.calibrated)
            logger.info(
                "rankguard %s: calibrated at train step %d: reports past %s.",
                g.name,
                step,
                describe_,
            )

    # -- this rank's status (the thread) -------------------------------------------------

    def _sample(self) -> tuple[list, str | None, float]:
        """Reads the loop's stack; tracks how long it has waited at one rendezvous."""
        stack = self._loop_stack()
        recorder = self.recorder
        counts = recorder.counts() if recorder is not None else ()
        g = self.guard
        point, wait_s = g._waits.sample(stack, _now(), g._phases.progress, counts)
        return stack, point, wait_s

    def status(self) -> RankStatus:
        """This rank's status now (built by :mod:`rankguard.callbacks.hang.rank_status`)."""
        g = self.guard
        g._derive()
        beat = g._beat  # set before the thread starts
        stack, waits_at, wait_s = self._sample()
        self._probe_decisions()
        progress = g._phases.progress
        return rank_status(
            beat,
            stack,
            waits_at,
            wait_s,
            now=_now(),
            deadlines=self.deadline_s,
            ceilings=g.ceilings,
            settle=self.settle,
            libraries=g._libraries,
            host=self.host,
            pid=os.getpid(),
            gave_up=self.gave_up,
            progress=progress,
            usual=g._waits.is_usual(progress),
            decisions=dict(g._phases.decisions),
            record=self._collectives(),
            quiet_s=self._quiet_s(),
            loop_thread=self.loop_thread_name,
            phases=g._history.phases(),
        )

    def _probe_decisions(self) -> None:
        """Reads the adapter's decisions now (watchdog thread, at each status): never raises."""
        g = self.guard
        probe, beat = g._decision_probe, g._beat
        if probe is None or beat is None:
            return
        try:
            g._phases.update_decisions(probe(), beat.step)
        except Exception as exc:  # a framework's state read from another thread
            logger.debug("rankguard %s: decision probe failed: %s", g.name, exc)

    def _collectives(self) -> tuple:
        """This rank's record of collectives for its status; ``()`` if it cannot be read."""
        recorder = self.recorder
        if recorder is None:
            return ()
        try:
            return recorder.snapshot()
        except Exception as exc:  # the record must never cost the status exchange
            logger.debug("rankguard %s: collective record unreadable: %s", self.guard.name, exc)
            return ()

    def _quiet_s(self) -> float:
        """How long this rank has made no progress and issued no collective (as sampled)."""
        return self.guard._waits.quiet_s(_now()) if self.recorder is not None else 0.0

    def _loop_stack(self) -> list[tuple[str, int, str]]:
        """The training loop thread's frames (innermost first), read from the watchdog thread."""
        frame = sys._current_frames().get(self.loop_thread)
        stack = []
        while frame is not None and len(stack) < MAX_FRAMES:
            stack.append((frame.f_code.co_filename, frame.f_lineno, code_name(frame.f_code)))
            frame = frame.f_back
        return stack

    # -- the exchange loop ---------------------------------------------------------------

    def _run(self) -> None:
        g = self.guard
        channel = g.channel
        self.faults.start()
        self.polls.reset(channel)
        while not self.stop.is_set():
            self._poll()
            self.recalibrate()
            suspect = self.last.suspect if self.last is not None else None
            decide = functools.partial(
                diagnose, incident=self.incident, suspect=suspect, words=g._words
            )
            try:
                status = self.status()
                self.read_wake = False  # a wake point read so far: this status tells it
                verdict = channel.exchange(
                    STATUS_EXCHANGE, status, decide, timeout_s=g.exchange_timeout_s
                )
            except RanksMissingError as missing:
                self.failures += 1
                self._on_missing(missing.missing)
                continue  # the exchange itself waited; ask again at once
            except Exception as exc:
                if not self.stop.is_set() and g._beat.kind != "done":
                    g.warn_once("exchange", "status exchange failed (%s); retrying.", exc)
                    self._store_failed(exc)
                self._sleep()
                continue
            self.failures = 0
            self.store_failed_at = None
            self.faults.after_exchange()
            confirm = verdict.suspect is not None and (
                self.last is None or self.last.suspect != verdict.suspect
            )
            self.last = verdict
            leader = channel.is_leader
            state, told = self._state(), self.told_mismatch
            for step in incident.after_verdict(
                verdict, state, self._policy(), leader=leader, told=told
            ):
                self._act(step)
            if verdict.done == ((0, channel.world_size - 1),):
                return  # every rank's fit ended: every thread ends after this same exchange
            if g._beat.kind == "done":
                # This rank left the loop, the others not yet: meet their next exchange (it
                # waits for them, at no cost to their steps) until they end fit or a verdict.
                continue
            if confirm:  # a deadlock seen once is confirmed by the next exchange, soon
                self.stop.wait(CONFIRM_AFTER_S)
            else:
                self._sleep()

    def _sleep(self) -> None:
        """Waits for the next exchange; sooner when this rank's loop settles at a rendezvous."""
        until = _now() + self.guard.exchange_period_s
        while not self.wake.is_set() and not self.read_wake:
            left = until - _now()
            if left <= 0 or self.wake.wait(min(left, self._probe_period())):
                break
            self._poll()
            if self._settled_at_rendezvous():
                break
        self.wake.clear()

    def _poll(self) -> None:
        """A peer's fault (this rank ends here) and a preemption (every rank stops at one step).

        This node's dead peers are looked for at every wake (``/proc``); the store is read
        as :class:`StorePolls` says.
        """
        fresh = self.polls.look()
        self.faults.check(read_board=fresh)
        self.guard.stop_agreement.poll(notified=fresh)

    def _probe_period(self) -> float:
        """:data:`READ_PERIOD_S` while the loop makes progress, else :data:`PROBE_PERIOD_S`.

        The last read's newest heartbeat tells: a loop that came to wait at a rendezvous
        just after it is sampled at the next wake, so it settles at most a read period later.
        """
        beat = self.guard._beat
        if beat is not None and beat.kind != "done" and _now() - beat.at < PROBE_PERIOD_S:
            return READ_PERIOD_S
        return PROBE_PERIOD_S

    def _settled_at_rendezvous(self) -> bool:
        """Whether the loop, without progress, settled (see :meth:`WaitTracker.exchange_early`).

        Cheap while training goes on: the stack is read only once no heartbeat
        came for a probe period.
        """
        g = self.guard
        g._derive()
        beat = g._beat
        if beat is None or beat.kind == "done" or self.ended.is_set():
            return False
        if _now() - beat.at < PROBE_PERIOD_S:
            return False
        _, point, wait_s = self._sample()
        quiet_s = self._quiet_s() if self.recorder is not None else None
        return g._waits.exchange_early(point, wait_s, quiet_s, self.settle, _now())

    # -- incidents: the state machine is incident.py's; here its steps are performed -----

    def _store_failed(self, exc: Exception) -> None:
        """An exchange failed outright: past the slack a rank may go silent, the store is gone."""
        g, now = self.guard, _now()
        if self.store_failed_at is None:
            self.store_failed_at = now
        slack = g.first_step_timeout_s if self.last is None else self.last.slack_s
        failed_s = now - self.store_failed_at
        if failed_s > max(slack, 3 * g.exchange_timeout_s):
            self.faults.store_gone(failed_s, exc)

    def _policy(self) -> incident.Policy:
        g = self.guard
        return incident.Policy(g.action, g.abort_at, g.deadlock_action, g.collective_mismatch)

    def _state(self) -> incident.State:
        return incident.State(self.reported, self.ended.is_set())

    def _on_missing(self, missing: list[int]) -> None:
        g = self.guard
        self.faults.check()  # a rank that raised is missing for that reason
        waited = g.exchange_period_s + self.failures * g.exchange_timeout_s
        if self.stop.is_set() or g._beat.kind == "done":
            return
        report = incident.after_missing(
            missing,
            rank=g.channel.rank,
            waited_s=waited,
            last=self.last,
            first_step_s=g.first_step_timeout_s,
            gave_up=self.gave_up,
            state=self._state(),
            policy=self._policy(),
            silent=policy.liveness(g.exchange_period_s, g.exchange_timeout_s),
            heard=None if self.last is not None else self._heard(missing),
        )
        if report is not None:
            self._report(report)

    def _heard(self, missing: list[int]) -> list[int]:
        """Those of ``missing`` whose watchdog ran before any verdict (one request each).

        At most :data:`HEARD_CHECKS` are asked about: every rank gets the same list, and
        thousands of ranks missing at a start (every rank asking about each) would ask the
        store for the square of the world size. Beyond, none counts as heard: they are
        named past the first step's slack, as ranks that never started are.
        """
        return self.faults.heard(missing) if len(missing) <= HEARD_CHECKS else []

    def _act(self, step: incident.Step) -> None:
        """Performs one step of :func:`incident.after_verdict`."""
        name = self.guard.name
        if isinstance(step, incident.Hold):
            self.incident = step.runs
        elif isinstance(step, incident.WarnMismatch):
            self.told_mismatch.add(step.key)
            logger.warning("rankguard %s: Collective mismatch: %s", name, step.text)
        elif isinstance(step, incident.Recovered):
            logger.info("rankguard %s: %s", name, incident.recovered_text(step.ended))
            self.incident, self.reported, self.gave_up = (), False, None
            self.ended.clear()
        else:
            self._report(step)

    def _report(self, report: Report) -> None:
        """Writes this rank's report files, logs the incident, and exits where it says."""
        g = self.guard
        rank, status = g.channel.rank, self.status()
        header = incident.header(rank, status.host, status.pid, status.phase)
        folder = attempt_dir(g.report_dir, os.environ)
        writes = rank == incident.writer(g.channel.world_size, report.frozen)
        text = incident.summary_text(report, self.nccl_note) if writes else None
        self.write_report(folder, status, header, text)
        if report.final or report.deadlock:
            write_flight_recorder(folder, rank)  # where the running torch keeps one
        if not self.reported:
            g.incidents += 1  # counted once per incident (tests wait on it)
        self.reported = True
        where = incident.where(header, str(folder), rank, self.nccl_note)
        g.last_incident = HangDetectedError(incident.message(report, where))
        outcome = incident.outcome(report, g.action)
        if not report.final:
            logger.warning("rankguard %s: %s %s", g.name, g.last_incident, outcome)
            return
        g.ceilings_reached += 1
        self.gave_up = None
        logger.error("rankguard %s: %s %s", g.name, g.last_incident, outcome)
        self.ended.set()
        if report.code is not None:
            self._abort(report.code)

    def write_report(
        self, folder: Path, status: RankStatus, header: str, summary: str | None
    ) -> None:
        """Writes this rank's report files into ``folder`` (``summary.txt`` where ``summary``).

        Its stacks, its last heartbeats and ``status``; one rank writes the summary.
        """
        wall = time.time() - _now()  # the beats' monotonic times as wall-clock times
        beats = [
            {"t": wall + t, "event": e, "phase": phase_label(e, s, b, ld), "step": s}
            for t, e, s, b, ld, _ in expand(list(self.entries))
        ]
        first_line = f"{header}, idle {status.idle_s:.1f} s"
        guard = self.guard
        try:
            write_incident(
                folder,
                guard.channel.rank,
                first_line,
                beats,
                summary,
                loop_thread=self.loop_thread,
                status=status,
            )
        except OSError as exc:
            logger.error("rankguard %s: could not write the report: %s", guard.name, exc)

    def _abort(self, code: int) -> None:
        """Ends this rank after a final report: the one exit path (``ending.end_process``)."""
        self.faults.end(code, why="the verdict", window_s=self.guard.exchange_timeout_s)
