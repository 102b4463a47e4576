"""The hang watchdog's background thread: status exchanges, calibration, reports, the exit.

Owned by :class:`~rankguard.callbacks.hang.hang_watchdog.HangWatchdog`; it reads the settings
(:mod:`~rankguard.callbacks.hang.watchdog_settings`), the heartbeats
(:mod:`~rankguard.callbacks.hang.heartbeats`) and keeps the incident state
(:mod:`~rankguard.callbacks.hang.incident_state`); what decides is pure beside it
(``verdict``, ``incident``).
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
from collections.abc import Callable
from pathlib import Path

from rankguard.callbacks.core.errors import HangDetectedError, RanksMissingError
from rankguard.callbacks.core.interrupts import wait_through_signals
from rankguard.callbacks.core.side_channel import POLLS_PER_S, SideChannel, notices, spread_period
from rankguard.callbacks.core.step_log import expand
from rankguard.callbacks.hang import deadlines, incident
from rankguard.callbacks.hang.calibration import calibrate, describe
from rankguard.callbacks.hang.collective_files import write_flight_recorder
from rankguard.callbacks.hang.collectives import CollectiveRecorder
from rankguard.callbacks.hang.deadlines import Settle
from rankguard.callbacks.hang.fault_watch import FaultWatch
from rankguard.callbacks.hang.heartbeats import HeartbeatReader
from rankguard.callbacks.hang.incident import Report
from rankguard.callbacks.hang.incident_state import IncidentState
from rankguard.callbacks.hang.job import attempt_dir, process_group_timeout
from rankguard.callbacks.hang.kinds import Phase
from rankguard.callbacks.hang.phases import Beat
from rankguard.callbacks.hang.rank_status import rank_status
from rankguard.callbacks.hang.report import write_incident
from rankguard.callbacks.hang.stacks import code_name
from rankguard.callbacks.hang.status import GaveUp, RankStatus
from rankguard.callbacks.hang.stop import StopAgreement
from rankguard.callbacks.hang.verdict import diagnose
from rankguard.callbacks.hang.verdict_text import (
    flight_recorder_note,
    nccl_timeout_advice,
    phase_label,
)
from rankguard.callbacks.hang.watchdog_settings import (
    WatchdogSettings,
    fit_defaults_under,
    spread_exchanges,
)

# The watchdog's logger (its name is what users filter by), shared with hang_watchdog.py.
logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

_now = time.perf_counter  # the step log's clock: heartbeats are compared with it

STATUS_EXCHANGE = "hang_watchdog/status"
MAX_FRAMES = 64  # frames of the training loop read at each exchange
#: While this rank makes no progress, its own stack is sampled this often (seconds).
PROBE_PERIOD_S = 0.5
#: While it makes progress, the watchdog thread wakes this often (seconds) to read the step
#: log: a wake costs tens of µs of CPU and a read a fixed cost besides its entries', so
#: rarer reads while training goes on make the thread's share of a step 2-3 times smaller.
#: What it costs: a loop that stops is seen at the next wake, so a deadlock or desync is
#: reported later (the loop's desync row of docs/hang.md: 6.0 s from the split, 5.0 at 0.5).
READ_PERIOD_S = 2.0
#: Ranks missing before the first verdict that this rank asks the store about, at most.
HEARD_CHECKS = 16
#: A deadlock seen at one exchange is confirmed by the next, this long after (seconds): ranks
#: leave one collective a few milliseconds apart, so a status sampled just before one rank
#: returned from it must not confirm it.
CONFIRM_AFTER_S = 1.0


class _Raised(Exception):
    """Leaves an exchange in flight: this rank raised, and its fit closes."""


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

    def reset(self, channel: SideChannel | None) -> None:
        """A new fit on ``channel``: nothing seen yet."""
        self.channel = channel
        self.seen = 0
        self.next_at = -math.inf
        if channel is None or not channel.is_distributed:
            self.period_s = 0.0
        else:
            self.period_s = spread_period(0.0, channel.world_size, POLLS_PER_S)

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
    """The thread of one hang watchdog, and the state it keeps.

    Args:
        name: The guard's name (in its log lines).
        settings: The settings it reads (fitted to the job at :meth:`prepare`).
        heartbeats: What this rank's heartbeats say (the guard's reader of its step log).
        state: The incident state it changes (the guard reads its counts).
        warn_once: The guard's warning, logged once per key.
        stop_agreement: The preemption agreed across ranks, polled at each wake.

    Attributes:
        channel: The side channel of the fit (the guard's, given at :meth:`prepare`).
        deadline_s: The deadline per phase kind in force (calibrated, at most the ceiling).
        faults: The faults of one fit, as this rank sees them.
    """

    def __init__(
        self,
        name: str,
        settings: WatchdogSettings,
        heartbeats: HeartbeatReader,
        state: IncidentState,
        *,
        warn_once: Callable[..., None],
        stop_agreement: StopAgreement,
    ) -> None:
        self.name = name
        self.settings = settings
        self.heartbeats = heartbeats
        self.state = state
        self.warn_once = warn_once
        self.stop_agreement = stop_agreement
        self.channel = SideChannel(None)
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.wake = threading.Event()  # ends the thread's sleep early (fit end, close)
        self.settle: Settle = deadlines.settle_times(
            settings.deadlock_after_s, settings.calibration_factor
        )
        self.recorder: CollectiveRecorder | None = None
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
        self.deadline_s: dict[str, float] = self.settings.ceilings
        self.read_wake = False  # the thread read a wake point: exchange at once
        self.state.new_fit()
        self.told_calibrated = False
        self.failures = 0
        self.verdict_at: float | None = None  # when the last exchange's verdict came (_now)
        self.faults.reset()

    @property
    def beat(self) -> Beat | None:
        """The last heartbeat read (what :class:`FaultWatch` reads of this rank's loop)."""
        return self.heartbeats.beat

    @property
    def libraries(self) -> tuple[str, ...]:
        """Where library code lives (what :class:`FaultWatch` reads of this rank's frames)."""
        return self.heartbeats.libraries

    # -- start and stop (the training thread) --------------------------------------------

    def prepare(self, settings: WatchdogSettings, channel: SideChannel) -> WatchdogSettings:
        """Fits the ceilings under NCCL's timeout, sets the deadlines, logs the plan.

        Returns:
            The settings in force: ``settings`` fitted to the world size and NCCL's timeout.
        """
        self.loop_thread = threading.get_ident()
        self.loop_thread_name = threading.current_thread().name
        self.channel = channel
        self.heartbeats.read_step_log()  # the first heartbeat: the thread reads beat from its start
        settings = spread_exchanges(settings, channel, self.name)
        backend, pg_timeout = process_group_timeout()
        if backend == "nccl":
            settings = fit_defaults_under(settings, pg_timeout, self.name)
            detect = settings.exchange_period_s + settings.exchange_timeout_s
            arguments = deadlines.ceiling_arguments(settings.ceilings)
            advice = nccl_timeout_advice(pg_timeout, arguments, detect)
            if advice and channel.is_leader:
                self.warn_once("nccl_timeout", advice)
            self.nccl_note = flight_recorder_note(os.environ, channel.rank)
        self.settings = settings
        self.deadline_s = settings.ceilings
        self.told_calibrated = self.heartbeats.restored  # the plan below says so
        self.recalibrate()
        logger.info("rankguard %s: %s", self.name, self.plan())
        self.stop.clear()
        self.wake.clear()
        return settings

    def launch(self) -> None:
        """Starts the record of collectives and the thread."""
        self._start_recorder()
        self.thread = threading.Thread(target=self.run, name=f"rankguard-{self.name}", daemon=True)
        self.thread.start()

    def _start_recorder(self) -> None:
        """Starts this rank's record of collectives (in the report folder), where it can."""
        channel = self.channel
        if self.recorder is not None or not channel.is_distributed:
            return
        folder = attempt_dir(self.settings.report_dir, os.environ)
        heartbeats = self.heartbeats
        recorder = CollectiveRecorder(
            folder, channel.rank, heartbeats.libraries, phase=heartbeats.issuing_phase
        )
        if recorder.install():
            self.recorder = recorder

    def exchange_soon(self) -> None:
        """Ends the thread's wait for its next exchange (from any thread)."""
        if threading.current_thread() is self.thread:
            self.read_wake = True  # its sleep ends at once; the next status clears it
        else:
            self.wake.set()

    def give_up(self, gave_up: GaveUp) -> None:
        """A rankguard check gave up waiting for ranks: exchange statuses now, carrying it."""
        self.state.gave_up = gave_up
        self.wake.set()

    def close(self, fit_ended: bool) -> None:
        """Stops and joins the thread (``fit_ended``: first let the last exchange end it)."""
        settings = self.settings
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
            period, timeout = settings.exchange_period_s, settings.exchange_timeout_s
            self._join(thread, 2 * period + timeout + self.settle.stack_s)
            training, phases = self.state.still_training(self.channel.world_size)
            if thread.is_alive() and training:
                self.faults.left_early(training, phases)
        self.stop.set()
        self.wake.set()
        # An exchange in flight ends within its timeout (+ the followers' grace).
        self._join(thread, 1.25 * settings.exchange_timeout_s + 7.0)
        self.close_recorder()

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
            healthy = self.heartbeats.fit_ended and not self.state.incidents
            recorder.close(keep=not healthy)

    # -- deadlines ----------------------------------------------------------------------

    def plan(self) -> str:
        """The INFO line at fit start: what is reported when, and when the job ends."""
        s = self.settings
        restored = self._calibrated() if self.heartbeats.restored else None
        return deadlines.plan(s.ceilings, s.deadline_policy, restored)

    def _calibrated(self) -> dict:
        s, heartbeats = self.settings, self.heartbeats
        return calibrate(
            heartbeats.intervals,
            s.ceilings,
            factor=s.calibration_factor,
            floor_s=s.floor_s,
            save_estimate=heartbeats.save_estimate,
        )

    def recalibrate(self) -> None:
        """Sets the deadlines from the intervals seen (at each status exchange)."""
        s, heartbeats = self.settings, self.heartbeats
        heartbeats.read_step_log()
        if not s.auto_calibrate or not heartbeats.ready_to_calibrate(s.warmup_steps):
            return
        new = deadlines.recalibrate(
            heartbeats.intervals, s.ceilings, s.deadline_policy, heartbeats.save_estimate
        )
        if new.settle is not None:
            self.settle = new.settle
        self.deadline_s = new.deadlines
        if not self.told_calibrated and new.settle is not None:
            self.told_calibrated = True
            beat = heartbeats.beat
            step = beat.step if beat else 0
            describe_ = describe(new.calibrated)
            logger.info(
                "rankguard %s: calibrated at train step %d: reports past %s.",
                self.name,
                step,
                describe_,
            )

    # -- this rank's status (the thread) -------------------------------------------------

    def _sample(self) -> tuple[list, str | None, float]:
        """Reads the loop's stack; tracks how long it has waited at one rendezvous."""
        stack = self._loop_stack()
        recorder = self.recorder
        counts = recorder.counts() if recorder is not None else ()
        point, wait_s = self.heartbeats.sample(stack, counts, _now())
        return stack, point, wait_s

    def status(self) -> RankStatus:
        """This rank's status now (built by :mod:`rankguard.callbacks.hang.rank_status`)."""
        heartbeats = self.heartbeats
        heartbeats.read_step_log()
        beat = heartbeats.beat  # set before the thread starts
        stack, waits_at, wait_s = self._sample()
        heartbeats.probe_decisions(self.name)
        phases = heartbeats.phases
        progress = phases.progress
        return rank_status(
            beat,
            stack,
            waits_at,
            wait_s,
            now=_now(),
            deadlines=self.deadline_s,
            ceilings=self.settings.ceilings,
            settle=self.settle,
            libraries=heartbeats.libraries,
            host=self.host,
            pid=os.getpid(),
            gave_up=self.state.gave_up,
            progress=progress,
            usual=heartbeats.waits.is_usual(progress),
            decisions=dict(phases.decisions),
            record=self.collectives(),
            quiet_s=self._quiet_s(),
            loop_thread=self.loop_thread_name,
            phases=heartbeats.history.phases(),
            since_verdict_s=None if self.verdict_at is None else _now() - self.verdict_at,
        )

    def collectives(self) -> tuple:
        """This rank's record of collectives for its status; ``()`` if it cannot be read."""
        recorder = self.recorder
        if recorder is None:
            return ()
        try:
            return recorder.snapshot()
        except Exception as exc:  # the record must never cost the status exchange
            logger.debug("rankguard %s: collective record unreadable: %s", self.name, exc)
            return ()

    def _quiet_s(self) -> float:
        """How long this rank has made no progress and issued no collective (as sampled)."""
        return self.heartbeats.quiet_s(_now()) if self.recorder is not None else 0.0

    def _loop_stack(self) -> list[tuple[str, int, str]]:
        """The training loop thread's frames (innermost first), read from the watchdog thread."""
        frame = sys._current_frames().get(self.loop_thread)
        stack = []
        while frame is not None and len(stack) < MAX_FRAMES:
            stack.append((frame.f_code.co_filename, frame.f_lineno, code_name(frame.f_code)))
            frame = frame.f_back
        return stack

    # -- the exchange loop ---------------------------------------------------------------

    def run(self) -> None:
        """The thread's loop: a status exchange each period, its verdict acted on, until stopped."""
        channel, state, heartbeats = self.channel, self.state, self.heartbeats
        self.faults.start()
        self.polls.reset(channel)
        while not self.stop.is_set():
            self._poll()
            self.recalibrate()
            last = state.last
            decide = functools.partial(
                diagnose,
                incident=state.runs,
                suspect=last.suspect if last is not None else None,
                split_decisions=heartbeats.split_decisions,
                rechecked=last is not None and last.recheck,
            )
            try:
                status = self.status()
                self.read_wake = False  # a wake point read so far: this status tells it
                verdict = channel.exchange(
                    STATUS_EXCHANGE,
                    status,
                    decide,
                    timeout_s=self.settings.exchange_timeout_s,
                    meanwhile=self._while_waiting,
                    every_s=max(PROBE_PERIOD_S, self.polls.period_s),
                )
            except _Raised:
                return  # this rank's fit raised and it closes: see _while_waiting
            except RanksMissingError as missing:
                self.verdict_at = _now()  # the deciding rank's verdict: who was missing
                self.failures += 1
                self._on_missing(missing.missing)
                continue  # the exchange itself waited; ask again at once
            except Exception as exc:
                if not self.stop.is_set() and not heartbeats.fit_ended:
                    self.warn_once("exchange", "status exchange failed (%s); retrying.", exc)
                    self._store_failed(exc)
                self._sleep()
                continue
            self.verdict_at = _now()
            self.failures = 0
            self.store_failed_at = None
            self.faults.after_exchange()
            if verdict.recheck:  # a status built well before the stuck rank's: ask again
                logger.debug("rankguard %s: statuses built apart: asked again", self.name)
                state.last = verdict
                continue
            confirm = verdict.suspect is not None and (
                state.last is None or state.last.suspect != verdict.suspect
            )
            state.last = verdict
            leader, policy_ = channel.is_leader, self.settings.incident_policy
            for step in incident.after_verdict(
                verdict, state.decided, policy_, leader=leader, told=state.told_mismatch
            ):
                self._act(step)
            if verdict.done == ((0, channel.world_size - 1),):
                return  # every rank's fit ended: every thread ends after this same exchange
            if heartbeats.fit_ended:
                # This rank left the loop, the others not yet: meet their next exchange (it
                # waits for them, at no cost to their steps) until they end fit or a verdict.
                continue
            if confirm:  # a deadlock seen once is confirmed by the next exchange, soon
                self.stop.wait(CONFIRM_AFTER_S)
            else:
                self._sleep()

    def _while_waiting(self) -> None:
        """While an exchange waits (for a peer's status, or the verdict): the wake's reads.

        A peer that raised after this rank's exchange began never sends its status: its
        fault is read here, not after the exchange's timeout (10 s at the defaults). A
        rank whose fit raised and that closes leaves the exchange at once: its peers act
        on its published fault, or raise the same verdict's error themselves (a check's,
        which every rank raises and none publishes). Its close would otherwise wait out
        the timeout for a peer that already left, and a launcher that stops every rank
        once one exits would end it before its error is printed.
        """
        if self.stop.is_set():
            published = self.faults.published
            if not self.heartbeats.fit_ended or (
                published is not None and published.family != "left"
            ):
                raise _Raised
        self._poll()

    def _sleep(self) -> None:
        """Waits for the next exchange; sooner when this rank's loop settles at a rendezvous."""
        until = _now() + self.settings.exchange_period_s
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

        This node's dead peers are looked for at every wake (a pidfd each, else ``/proc``:
        :func:`~rankguard.callbacks.hang.faults.is_alive`); the store is read as
        :class:`StorePolls` says.
        """
        fresh = self.polls.look()
        self.faults.check(read_board=fresh)
        self.stop_agreement.poll(notified=fresh)

    def _probe_period(self) -> float:
        """:data:`READ_PERIOD_S` while the loop makes progress, else :data:`PROBE_PERIOD_S`.

        The last read's newest heartbeat tells: a loop that came to wait at a rendezvous
        just after it is sampled at the next wake, so it settles at most a read period later.
        """
        beat = self.heartbeats.beat
        if beat is not None and beat.kind != Phase.DONE and _now() - beat.at < PROBE_PERIOD_S:
            return READ_PERIOD_S
        return PROBE_PERIOD_S

    def _settled_at_rendezvous(self) -> bool:
        """Whether the loop, without progress, settled (see :meth:`WaitTracker.exchange_early`).

        Cheap while training goes on: the stack is read only once no heartbeat
        came for a probe period.
        """
        heartbeats = self.heartbeats
        heartbeats.read_step_log()
        beat = heartbeats.beat
        if beat is None or beat.kind == Phase.DONE or self.state.ended.is_set():
            return False
        if _now() - beat.at < PROBE_PERIOD_S:
            return False
        _, point, wait_s = self._sample()
        quiet_s = self._quiet_s() if self.recorder is not None else None
        return heartbeats.settled(point, wait_s, quiet_s, self.settle, _now())

    # -- incidents: the state machine is incident.py's; here its steps are performed -----

    def _store_failed(self, exc: Exception) -> None:
        """An exchange failed outright: past the slack a rank may go silent, the store is gone."""
        s, last, now = self.settings, self.state.last, _now()
        if self.store_failed_at is None:
            self.store_failed_at = now
        slack = s.first_step_timeout_s if last is None else last.slack_s
        failed_s = now - self.store_failed_at
        if failed_s > max(slack, 3 * s.exchange_timeout_s):
            self.faults.store_gone(failed_s, exc)

    def _on_missing(self, missing: list[int]) -> None:
        s, state = self.settings, self.state
        self.faults.check()  # a rank that raised is missing for that reason
        waited = s.exchange_period_s + self.failures * s.exchange_timeout_s
        if self.stop.is_set() or self.heartbeats.fit_ended:
            return
        report = incident.after_missing(
            missing,
            rank=self.channel.rank,
            waited_s=waited,
            last=state.last,
            first_step_s=s.first_step_timeout_s,
            gave_up=state.gave_up,
            state=state.decided,
            policy=s.incident_policy,
            silent=s.liveness,
            heard=None if state.last is not None else self._heard(missing),
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
        name, state = self.name, self.state
        if isinstance(step, incident.Hold):
            state.runs = step.runs
        elif isinstance(step, incident.WarnMismatch):
            state.told_mismatch.add(step.key)
            logger.warning("rankguard %s: Collective mismatch: %s", name, step.text)
        elif isinstance(step, incident.Recovered):
            logger.info("rankguard %s: %s", name, incident.recovered_text(step.ended))
            state.recovered()
        else:
            self._report(step)

    def _report(self, report: Report) -> None:
        """Writes this rank's report files, logs the incident, and exits where it says."""
        channel, state, action = self.channel, self.state, self.settings.action
        rank, status = channel.rank, self.status()
        header = incident.header(rank, status.host, status.pid, status.phase)
        folder = attempt_dir(self.settings.report_dir, os.environ)
        writes = rank == incident.writer(channel.world_size, report.frozen)
        text = incident.summary_text(report, self.nccl_note) if writes else None
        self.write_report(folder, status, header, text)
        if report.final or report.deadlock:
            write_flight_recorder(folder, rank)  # where the running torch keeps one
        where = incident.where(header, str(folder), rank, self.nccl_note)
        error = HangDetectedError(incident.message(report, where))
        state.reported_as(error)
        outcome = incident.outcome(report, action)
        if not report.final:
            logger.warning("rankguard %s: %s %s", self.name, error, outcome)
            return
        state.reached_ceiling()
        logger.error("rankguard %s: %s %s", self.name, error, outcome)
        state.ended.set()
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
            for t, e, s, b, ld, _ in expand(list(self.heartbeats.entries))
        ]
        first_line = f"{header}, idle {status.idle_s:.1f} s"
        try:
            write_incident(
                folder,
                self.channel.rank,
                first_line,
                beats,
                summary,
                loop_thread=self.loop_thread,
                status=status,
            )
        except OSError as exc:
            logger.error("rankguard %s: could not write the report: %s", self.name, exc)

    def _abort(self, code: int) -> None:
        """Ends this rank after a final report: the one exit path (``ending.end_process``)."""
        self.faults.end(code, why="the verdict", window_s=self.settings.exchange_timeout_s)
