"""The watchdog's part in a rank that raised or died: publish, read, end, and bound a teardown.

Owned by :class:`~rankguard.callbacks.hang.watchdog_thread.WatchdogThread`, seen through
:class:`FaultOwner`. What a fault is, its words and its exit code are
:mod:`~rankguard.callbacks.hang.faults`'; here they are performed.
docs/hang.md#a-rank-that-raises-or-dies.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

from rankguard.callbacks.core.errors import HangDetectedError, RankGuardError
from rankguard.callbacks.core.interrupts import wait_through_signals
from rankguard.callbacks.core.nodes import node_identity
from rankguard.callbacks.core.ranks import rank_label
from rankguard.callbacks.hang import incident
from rankguard.callbacks.hang.collective_files import (
    FAULT_SUFFIX,
    read_files,
    write_flight_recorder,
)
from rankguard.callbacks.hang.ending import LEAVE_WAIT_S, end_process
from rankguard.callbacks.hang.faults import (
    Fault,
    FaultBoard,
    Process,
    from_exception,
    gone_fault,
    is_alive,
    left_fault,
    message,
    pid_namespace,
    record_heads,
    root,
)
from rankguard.callbacks.hang.job import attempt_dir
from rankguard.callbacks.hang.kinds import Phase
from rankguard.callbacks.hang.report import write_stacks
from rankguard.callbacks.hang.status import RankStatus
from rankguard.callbacks.hang.verdict_text import point

if TYPE_CHECKING:
    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.incident_state import IncidentState
    from rankguard.callbacks.hang.phases import Beat
    from rankguard.callbacks.hang.watchdog_settings import WatchdogSettings

logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

_now = time.perf_counter  # the step log's clock
#: A rank acts on a peer's fault once its own loop made no progress this long (seconds): a
#: rank still stepping is not held yet (NCCL returns at the collective, waits at a host sync).
QUIET_S = 0.5
#: How much longer than one exchange's timeout a raising rank waits for its fault's publication.
PUBLISH_SLACK_S = 5.0
#: The teardown bounds set in this process (one per fault it raised): a new fit lifts them all.
_bounds: list[threading.Event] = []
_bounds_lock = threading.Lock()


def lift_bounds() -> None:
    """A fit starts in this process: the error before it was handled; no bound ends it."""
    with _bounds_lock:
        while _bounds:
            _bounds.pop().set()


def _waited(rank: int, status: RankStatus) -> str:
    """``"rank 0 waited in all_reduce at train.py:88 (step)"``: where this rank was."""
    if status.waits_at:
        return f"rank {rank} waited in {point(status)}"
    if status.blocked_in:
        return f"rank {rank} was blocked in {status.blocked_in}"
    return f"rank {rank} was in its own code ({status.phase})"


def _held(status: RankStatus) -> bool:
    """Whether this rank's loop waits at a rendezvous (it needs its peers to go on)."""
    return bool(status.blocked_in or (status.waits_at and status.settled))


class FaultOwner(Protocol):
    """What a :class:`FaultWatch` reads of the watchdog it serves (its thread), and asks of it."""

    name: str
    channel: SideChannel
    settings: WatchdogSettings
    state: IncidentState
    host: str
    nccl_note: str
    loop_thread: int | None

    @property
    def beat(self) -> Beat | None:
        """The last heartbeat read, or ``None`` before the first."""

    @property
    def libraries(self) -> tuple[str, ...]:
        """Where library code lives."""

    def status(self) -> RankStatus:
        """This rank's status now."""

    def collectives(self) -> tuple:
        """This rank's record of collectives; ``()`` if it cannot be read."""

    def write_report(
        self, folder: Path, status: RankStatus, header: str, summary: str | None
    ) -> None:
        """Writes this rank's report files into ``folder``."""


class FaultWatch:
    """The faults of one fit, as one rank's watchdog sees them (``owner``: its thread)."""

    def __init__(self, owner: FaultOwner) -> None:
        self.owner = owner
        self.board: FaultBoard | None = None
        self.local: dict[int, Process] = {}  # ranks on this node: their pids mean something
        self.published: Fault | None = None  # this rank's own fault
        self.process: Process | None = None  # where this rank runs, as it registered
        self.handled = False
        self.cancel = threading.Event()
        self._processes_read = False
        self._lock = threading.Lock()

    def reset(self) -> None:
        """A new fit (the board is the channel's: a fit on the same channel keeps it)."""
        self.cancel = threading.Event()

    # -- every rank ------------------------------------------------------------------------

    def start(self) -> None:
        """Opens the board and says where this rank's process runs (the watchdog thread)."""
        lift_bounds()  # any guard's: a fit runs again in this process
        self._open()

    def _open(self) -> FaultBoard | None:
        """The board of the guard's channel now, opened (and this rank registered) once per channel.

        A framework may start the watchdog before its fit starts (Lightning's sanity
        check): the fit keeps the channel, so it keeps the board.
        """
        channel = self.owner.channel
        if channel is None or not channel.is_distributed:
            return None
        if self.board is not None and self.board.channel is channel:
            return self.board
        self.board, self.local, self.published, self.handled = None, {}, None, False
        self._processes_read = False
        board = FaultBoard(channel)
        node = node_identity()
        self.process = Process(node.key, os.getpid(), pid_namespace(), node.host)
        try:
            board.register(self.process)
        except Exception as exc:
            logger.debug("rankguard: could not register this rank's process: %s", exc)
            return None
        self.board = board
        return board

    def after_exchange(self) -> None:
        """After an exchange every rank answered: every rank registered; find this node's."""
        board, mine = self.board, self.process
        if board is None or mine is None or self._processes_read:
            return
        self._processes_read = True
        me = board.channel.rank
        try:  # this node's ranks only: every rank's would make it grow with the world size
            processes = board.node_processes(mine.node)
        except Exception as exc:
            logger.debug("rankguard: could not read the ranks' processes: %s", exc)
            return
        self.local = {
            rank: p
            for rank, p in processes.items()
            if rank != me and p.node == mine.node and p.namespace == mine.namespace is not None
        }

    def heard(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose watchdog thread ran (registered); ``[]`` if unreadable."""
        board = self.board
        if board is None:
            return []
        try:
            return board.registered(ranks)
        except Exception as exc:
            logger.debug("rankguard: could not read which ranks registered: %s", exc)
            return []

    def leave(self, why: str) -> None:
        """Says this rank's process may end without a fault (never raises)."""
        if self.board is not None:
            try:
                self.board.leave(why)
            except Exception as exc:
                logger.debug("rankguard: could not say this rank leaves: %s", exc)

    def left_early(self, training: list[int], phases: str) -> None:
        """This rank's fit ended while ``training`` (ranks) had not; ``phases``: everyone's then.

        It tells them (never raises): a peer that then waits at a rendezvous this rank
        will never reach ends with the ``left`` family's code, in words that name this
        rank, rather than waiting for a timeout. A peer that finishes its fit without
        one (its own code after the loop, on one rank) is not told anything.
        """
        board, owner = self.board, self.owner
        if board is None or self.published is not None or self.handled:
            return
        beat = owner.beat
        fault = left_fault(
            board.channel.rank,
            step=beat.step if beat is not None else 0,
            training=rank_label(training),
            phases=phases,
            host=owner.host,
            pid=os.getpid(),
        )
        try:
            board.publish(fault)
        except Exception as exc:
            logger.debug("rankguard: could not say this rank left early: %s", exc)
            return
        self.published = fault
        logger.info(  # not a warning: a peer in its own code may finish its fit without it
            "rankguard %s: This rank's fit ended while %s still trains: told them (a rank that "
            "then waits for this one ends with exit code %d). At the last status exchange: %s.",
            owner.name,
            rank_label(training),
            fault.code,
            phases,
        )
        self._leave_store_last(board)

    def check(self, read_board: bool = True) -> None:
        """Reads new faults and this node's dead peers; ends this rank on one (never raises).

        ``read_board``: read the store's board; else only the faults read before (one
        this rank did not act on yet) and this node's peers.
        """
        board = self._open()
        if board is None or self.handled or self.published is not None:
            return
        try:
            faults = board.poll() if read_board else list(board.seen)
            if not faults:
                faults = self._dead_peers()
        except Exception as exc:  # the store: a peer of this node that hosted it may be dead
            logger.debug("rankguard: fault board unreadable: %s", exc)
            faults = self._dead_peers(store=False)
        if faults:
            self._act(faults)

    def store_gone(self, failed_s: float, exc: Exception) -> None:
        """Ends this rank: the store failed longer than any rank may go silent."""
        if self.handled or self.published is not None:
            return
        error = (
            f"the store stopped answering {failed_s:.0f} s ago ({type(exc).__name__}): rank 0, "
            "or the launcher that hosts the store, is gone"
        )
        phase, step = self._last_seen()
        self._act([Fault(0, "gone", error, None, step, phase, "", 0, (), -1, time.time())])

    def _last_seen(self) -> tuple[str, int]:
        """How a gone rank was last seen: every rank's phases at the last verdict; this step."""
        owner = self.owner
        last = owner.state.last
        phase = "no status exchanged yet" if last is None else last.phases
        beat = owner.beat
        return phase, beat.step if beat is not None else 0

    def _dead_peers(self, store: bool = True) -> list[Fault]:
        """Publishes a peer of this node whose process ended without a word; the board after.

        Without the ``store`` (it stopped answering) the peers found dead are this rank's
        verdict alone: one of them hosted it.
        """
        board = self.board
        assert board is not None
        dead = [rank for rank, p in list(self.local.items()) if not is_alive(p.pid)]
        if not dead:
            return []
        if not store:
            return [self._gone(rank, self.local[rank]) for rank in dead]
        with self._lock:  # the training thread (an error) and the watchdog thread
            return self._publish_dead(dead)

    def _publish_dead(self, dead: list[int]) -> list[Fault]:
        board = self.board
        assert board is not None
        faults = board.poll()  # one may have published just before it ended
        told = {f.rank for f in faults}
        for rank in dead:
            if rank in told or board.left(rank):
                self.local.pop(rank, None)  # it ended as it said: never again
                continue
            process = self.local.pop(rank, None)
            if process is not None:
                board.publish(self._gone(rank, process))
        return board.poll()

    def _gone(self, rank: int, process: Process) -> Fault:
        """The fault of a local peer gone: its last beat as seen, its record, its fault file."""
        owner = self.owner
        phase, step = self._last_seen()
        folder = attempt_dir(owner.settings.report_dir, os.environ)
        fault = gone_fault(
            rank, host=process.host, pid=process.pid, by=owner.channel.rank, phase=phase, step=step
        )
        record = record_heads(read_files(folder).get(rank, ())) if folder.is_dir() else ()
        signal_file = Path(folder) / f"rank{rank}{FAULT_SUFFIX}"
        try:
            fatal = signal_file.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            fatal = ""
        if fatal:
            record = (*record, f"fatal signal ({fatal.splitlines()[0]}): stacks in {signal_file}")
        return replace(fault, record=record)

    def _act(self, faults: list[Fault]) -> None:
        """Ends this rank on ``faults`` once its loop is held (see :data:`QUIET_S`)."""
        owner = self.owner
        first = root(faults)
        rank = owner.channel.rank
        if first.rank == rank and first.by != -1:  # its own; a store gone (by -1) is not
            return
        beat = owner.beat
        if beat is not None and beat.kind != Phase.DONE and _now() - beat.at < QUIET_S:
            return  # still stepping: it will be held at its next host sync
        if first.family == "left" and (beat is None or beat.kind == Phase.DONE):
            self.handled = True  # this rank's fit ended too: nobody waits for the one that left
            return
        status = owner.status()
        if first.family == "left" and not _held(status):
            return  # in its own code: it may finish without the rank that left
        self.handled = True
        header = incident.header(rank, status.host, status.pid, status.phase)
        folder = attempt_dir(owner.settings.report_dir, os.environ)
        where = incident.where(header, str(folder), rank, owner.nccl_note)
        code = first.code
        text = message(faults, waited=_waited(rank, status), where=where)
        faulty = {f.rank for f in faults if f.family != "communication"} | {first.rank}
        writes = rank == incident.writer(owner.channel.world_size, faulty)
        owner.write_report(folder, status, header, text if writes else None)
        owner.state.faulted(HangDetectedError(text))
        if beat is not None and beat.kind == Phase.DONE:
            logger.error("rankguard %s: %s Its fit had ended: it goes on.", owner.name, text)
            return
        if owner.settings.action != "abort":
            logger.error("rankguard %s: %s Now waiting (action='report').", owner.name, text)
            return
        logger.error("rankguard %s: %s Now ending with exit code %d.", owner.name, text, code)
        owner.state.ended.set()
        self.end(
            code,
            why=f"rank {first.rank}'s fault",
            evidence=lambda: write_flight_recorder(folder, rank),
            skip=faulty,
        )

    def end(
        self,
        code: int,
        *,
        why: str,
        evidence: Callable[[], None] | None = None,
        skip: Iterable[int] = (),
        window_s: float = LEAVE_WAIT_S,
    ) -> NoReturn:
        """Ends this process with ``code`` (:func:`~rankguard.callbacks.hang.ending.end_process`).

        Before the ranks meet it says on the board that this rank leaves, so that a peer
        on its node that sees its pid gone does not take it for a fault.
        """
        channel = self.board.channel if self.board is not None else self.owner.channel
        end_process(
            code,
            channel=channel,
            why=why,
            evidence=evidence,
            skip=skip,
            window_s=window_s,
            leaving=lambda: self.leave("ended"),
        )

    # -- the rank that raised (its training thread) -----------------------------------------

    def raised(self, exc: BaseException, step: int | None) -> None:
        """Publishes this rank's fault before anything can hang, then bounds its teardown.

        Raises:
            SystemExit: Or ``KeyboardInterrupt``: a request to end the process (a launcher's
                SIGTERM, raised by the framework's handler) that came while it published,
                raised once the teardown is bounded, as it would have been without rankguard.
        """
        owner = self.owner
        board = self._open()
        if board is None or self.published is not None or self.handled:
            return
        if isinstance(exc, RankGuardError):  # from a verdict every rank shares: each raises it
            return
        try:
            status = owner.status()
            phase, beat_step = status.phase, status.step
        except Exception:  # the fault matters more than where it was
            phase, beat_step = "an unknown phase", 0
        fault = from_exception(
            exc,
            rank=owner.channel.rank,
            step=beat_step if step is None else step,
            phase=phase,
            host=owner.host,
            pid=os.getpid(),
            libraries=owner.libraries,
            record=owner.collectives(),
        )
        limit_s = owner.settings.exchange_timeout_s + PUBLISH_SLACK_S
        ends: list[BaseException] = []  # a launcher's stop that came meanwhile: raised last
        failed = self._publish_raised(board, fault, limit_s, ends)
        bound = owner.settings.teardown_timeout_s
        then = f"; it ends this process in {bound:g} s if it is still running" if bound else ""
        if failed is not None:  # the store's host is gone, say: the teardown is bounded still
            logger.warning(
                "rankguard %s: could not tell the other ranks this rank raised (%s)%s.",
                owner.name,
                failed,
                then,
            )
            self._bound_teardown(fault, bound, fault.code)
        else:
            self.published = fault
            try:
                first = root(board.poll())
            except Exception:
                first = fault
            cause = f"{first.sentence()} {first.detail()}"
            if first != fault:  # a peer's fault came first: this error follows from it
                cause += f" This rank's {fault.error} follows from it."
            else:
                cause += " Told the other ranks."
            logger.error(  # with the traceback: a teardown that waits never lets Python print it
                "rankguard %s: %s Those still training end with exit code %d%s.",
                owner.name,
                cause,
                first.code,
                then,
                exc_info=exc,
            )
            self._bound_teardown(fault, bound, first.code)
            self._leave_store_last(board)
        if ends:
            raise ends[0]

    def _bound_teardown(self, fault: Fault, bound: float, code: int) -> None:
        """Ends this process ``bound`` seconds from now (0: never) if it is still running."""
        if bound:
            with _bounds_lock:
                _bounds.append(self.cancel)
            threading.Thread(
                target=self._bound,
                args=(fault, bound, self.cancel, code),
                name="rankguard-teardown",
                daemon=True,
            ).start()

    def _publish_raised(
        self, board: FaultBoard, fault: Fault, limit_s: float, ends: list[BaseException]
    ) -> str | None:
        """Publishes ``fault`` from a thread of its own; ``None`` once done, else why not.

        The training thread only waits: an exception a signal handler raises in it
        meanwhile (the DataLoader's SIGCHLD handler, when a worker died) cannot cut the
        publication in half (a number taken, its fault never written), so the others are
        told every time. Such an exception follows from the fault being published: it is
        logged, not raised. A request to end the process (a launcher's SIGTERM, which
        Composer's and OLMo-core's handlers raise as ``SystemExit``) goes to ``ends``, for
        :meth:`raised` to raise once it bounded the teardown.
        """
        outcome: list[Exception | None] = []
        done = threading.Event()

        def publish() -> None:
            try:
                self._dead_peers()  # a peer of this node gone first is the cause, not this error
                board.publish(fault)
                outcome.append(None)
            except Exception as exc:  # the store: reported by the waiting thread
                outcome.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=publish, name="rankguard-publish-fault", daemon=True)
        launched: list[bool] = []

        def launch_then_wait(seconds: float) -> None:
            # The start waits for the thread to run, which may signal at once: it waits through.
            if not launched:
                launched.append(True)
                thread.start()
            done.wait(seconds)

        wait_through_signals(
            launch_then_wait,
            done.is_set,
            limit_s,
            "this rank told the others its fault",
            through=BaseException,
            ends=ends,
        )
        if not outcome:
            return f"the store did not answer within {limit_s:g} s"
        return None if outcome[0] is None else str(outcome[0])

    def _bound(self, fault: Fault, bound: float, cancel: threading.Event, code: int) -> None:
        """Ends this process ``bound`` seconds after it raised, if still running (a teardown)."""
        if cancel.wait(bound):
            return
        owner = self.owner
        rank = owner.channel.rank
        folder = attempt_dir(owner.settings.report_dir, os.environ)
        header = (
            f"rank {rank}, host {fault.host}, pid {fault.pid}: still running {bound:g} s after "
            f"it raised {fault.error}"
        )
        logger.error(
            "rankguard %s: This rank is still running %g s after it raised %s (its teardown "
            "waits: see the stacks in %s/rank%d.txt). Ending it with exit code %d "
            "(teardown_timeout_s).",
            owner.name,
            bound,
            fault.error,
            folder,
            rank,
            code,
        )

        def evidence() -> None:
            write_stacks(folder, rank, header, owner.loop_thread)
            write_flight_recorder(folder, rank)

        self.end(code, why="teardown_timeout_s", evidence=evidence)

    def _leave_store_last(self, board: FaultBoard) -> None:
        """Where this rank's process hosts the store, its exit first lets the others read."""
        if board.channel.is_leader and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            atexit.register(self._wait_at_exit, self.cancel)

    def _wait_at_exit(self, cancel: threading.Event) -> None:
        """Rank 0 raised and exits: the store goes with it, so let the others read first.

        It waits for the ranks that said nothing of their own (not gone, not raised).
        """
        board = self.board
        if cancel.is_set() or board is None:
            return
        try:
            told = {f.rank for f in board.poll()}
        except Exception:
            return
        others = set(range(1, board.channel.world_size)) - told
        board.wait_left(sorted(others), LEAVE_WAIT_S)
