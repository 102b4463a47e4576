"""A rank that raised or died: what it tells the others, what they say, and the exit code.

The rank whose training raises writes a :class:`Fault` to the store before anything
can hang (never a collective); every other rank's watchdog thread reads it within a
poll and ends its rank with the fault's exit code. A rank whose process is gone
without one (SIGKILL, the OOM killer, a segfault) is published by a rank on its node,
which sees its pid gone. The rule and the exit-code table: docs/hang.md#a-rank-that-raises-or-dies.
"""

from __future__ import annotations

import os
import pickle
import select
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rankguard.callbacks.core.side_channel import notify
from rankguard.callbacks.data.data_worker import worker_failure
from rankguard.callbacks.hang.collective_compare import GroupRecord
from rankguard.callbacks.hang.stacks import code_name, describe_frame, user_frame
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, EXIT_CODES

__all__ = [
    "FAMILIES",
    "Fault",
    "FaultBoard",
    "family_of",
    "from_exception",
    "gone_fault",
    "is_alive",
    "left_fault",
    "pid_namespace",
    "root",
]

#: Each family of fault and what it covers; its exit code is ``status.EXIT_CODES[family]``.
#: A code fault is replayed by a restart (70, EX_SOFTWARE); the others may pass (75, EX_TEMPFAIL).
FAMILIES: dict[str, str] = {
    "code": "a code fault (ValueError, AssertionError, KeyError, ...)",
    "transient": "a transient fault (out of memory, a CUDA or NCCL error, OSError from storage, "
    "a data loader's worker or thread that died)",
    "communication": "a collective or store that failed (a peer's fault)",
    "interrupted": "an interrupt (KeyboardInterrupt, SystemExit on SIGTERM)",
    "gone": "a process gone without an exception (SIGKILL, a crash, a lost node)",
    "left": "a rank whose fit ended early, without an error, while the others trained on",
}

#: Words in a RuntimeError's message that say a device or a backend failed, not the code.
_TRANSIENT_WORDS = ("CUDA error", "CUDA out of memory", "cuDNN error", "CUBLAS_STATUS", "NCCL")
#: Words that say a collective failed because a peer did (gloo's closed socket, a store).
_COMMUNICATION_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "gloo",
    "Broken pipe",
)
#: ``OSError``s a restart replays (a checkpoint folder that exists, a permission), unlike
#: storage or network that may come back (a quota, a timeout, a stale NFS handle).
_REPLAYED_OS_ERRORS = (FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_MESSAGE_CHARS = 200


def _torch_classes(*names: str) -> tuple[type, ...]:
    """The torch exception classes of these names where the installed torch has them."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return ()
    found = []
    for name in names:
        cls = getattr(torch, name, None) or getattr(dist, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def family_of(exc: BaseException) -> str:
    """The family of ``exc`` (a key of :data:`FAMILIES`).

    Read from its class and, for a bare ``RuntimeError``, its message: CUDA, NCCL
    and gloo raise ``RuntimeError``.
    """
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return "interrupted"
    if worker_failure(exc) is not None:  # a loader's worker or thread died: not the code
        return "transient"
    if isinstance(exc, (MemoryError, *_torch_classes("OutOfMemoryError", "AcceleratorError"))):
        return "transient"
    if isinstance(exc, (ConnectionError, *_torch_classes("DistError"))):
        return "communication"  # a store's or a backend's: most often a peer's fault first
    if isinstance(exc, _REPLAYED_OS_ERRORS):  # a restart meets the same file or permission
        return "code"
    if isinstance(exc, OSError):
        return "transient"
    if type(exc) is RuntimeError:
        text = str(exc)
        if any(word in text for word in _COMMUNICATION_WORDS):
            return "communication"
        if any(word in text for word in _TRANSIENT_WORDS):
            return "transient"
    return "code"


@dataclass(frozen=True)
class Fault:
    """What a rank that raised (or a rank that saw a peer gone) publishes.

    Attributes:
        rank: The rank that raised or is gone.
        family: A key of :data:`FAMILIES`; it gives the exit code.
        error: ``"ValueError: sample 4711 has no tokens"`` (its first line), or for a
            rank gone, how it was found.
        where: The innermost frame of the user's own code in the traceback, with its
            source line, or ``None``.
        step: The train step the rank was at.
        phase: Its phase, e.g. ``"train batch 7"``.
        host: Its host.
        pid: Its process id.
        record: Its last collective per process group, as lines.
        by: The rank that published it (itself, unless it is gone).
        at: Unix time it was published.
    """

    rank: int
    family: str
    error: str
    where: str | None
    step: int
    phase: str
    host: str
    pid: int
    record: tuple[str, ...] = ()
    by: int = -1
    at: float = 0.0

    @property
    def code(self) -> int:
        """The exit code every other rank ends with."""
        code = EXIT_CODES[self.family]
        assert code is not None
        return code

    @property
    def gone(self) -> bool:
        """Whether the rank's process ended without an exception."""
        return self.family == "gone"

    def sentence(self) -> str:
        """The first sentence: ``"Rank 1 raised ValueError: sample 4711 has no tokens."``."""
        if self.gone:
            return f"Rank {self.rank} is gone: {self.error}."
        if self.family == "left":
            return f"Rank {self.rank} left the fit early: {self.error}."
        return f"Rank {self.rank} raised {self.error.rstrip('.')}."

    def detail(self) -> str:
        """Where: ``"At train.py:212 (check_batch): raise ...; train batch 5, host h, pid 9."``."""
        where = f"host {self.host}, pid {self.pid}"
        if self.gone:
            return f"Last seen: {self.phase}" + (f" ({where})." if self.pid > 0 else ".")
        if self.family == "left":
            return (
                f"At the last status exchange: {self.phase}. Its fit returned without an error "
                f"({where}): its process went on past the fit, or exited with 0."
            )
        place = f"At {self.where}; " if self.where else ""
        return f"{place}{self.phase}, {where}."


_NEXT = {
    "code": "fix the error on rank {rank} (its traceback is in its log): a restart replays it.",
    "transient": "restart the job; if rank {rank} fails again, look at its device and storage.",
    "communication": "read the logs of the ranks rank {rank} talks to: often a peer failed first.",
    "interrupted": "rank {rank} was interrupted (a signal, or an exit): restart the job if that "
    "was not meant.",
    "gone": "restart the job; look at rank {rank}'s node (dmesg: the OOM killer, a crash) and at "
    "its fault file if faulthandler wrote one.",
    "left": "make every rank run the same number of steps: rank {rank}'s loop ended first (a "
    "shorter shard of the data, a `break` or an early return on some ranks only): decide to "
    "stop on every rank alike.",
}


def message(faults: Sequence[Fault], *, waited: str, where: str) -> str:
    """What every other rank logs, leading with the first fault's sentence.

    Args:
        faults: Every fault published, in order (the root is :func:`root`'s).
        waited: Where this rank was, e.g. ``"rank 0 waited in all_reduce at train.py:88"``.
        where: The last sentence: this rank and its report files.
    """
    first = root(faults)
    code = first.code  # the exit code this rank ends with
    lines = [f"{first.sentence()} {first.detail()}"]
    meaning = "a restart replays it" if code == DEADLOCK_EXIT_CODE else "a restart may pass"
    lines.append(
        f"{waited[0].upper()}{waited[1:]}; it ends with exit code {code} "
        f"({FAMILIES[first.family]}: {meaning})."
    )
    lines.append("Next: " + _NEXT[first.family].format(rank=first.rank))
    lines.extend(f"Rank {first.rank}'s {line}" for line in first.record)
    for other in faults:
        if other is not first:
            lines.append(f"Then: {other.sentence()} {other.detail()}")
    lines.append(where)
    return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    if len(line) > _MESSAGE_CHARS:
        line = line[: _MESSAGE_CHARS - 3] + "..."
    name = type(exc).__name__
    return f"{name}: {line}" if line else name


def _user_frame(exc: BaseException, libraries: Iterable[str]) -> str | None:
    """The traceback's innermost frame of the user's own code (else its innermost frame)."""
    frames = [
        (f.f_code.co_filename, line, code_name(f.f_code))
        for f, line in traceback.walk_tb(exc.__traceback__)
    ]
    stack = frames[::-1]  # innermost first
    found = user_frame(stack, libraries)
    if found is None and stack:
        return describe_frame(*stack[0])
    return found


def record_heads(record: Sequence[GroupRecord]) -> tuple[str, ...]:
    """A rank's record as lines: per group, its count and the last collective it issued."""
    lines = []
    for group in record:
        if not group.count:
            continue
        last = group.last[-1] if group.last else None
        issued = f"; last {last.op} at {last.where}" if last is not None else ""
        lines.append(f"group {group.name}: {group.count} collectives issued{issued}")
    return tuple(lines)


def from_exception(
    exc: BaseException,
    *,
    rank: int,
    step: int,
    phase: str,
    host: str,
    pid: int,
    libraries: Iterable[str],
    record: Sequence[GroupRecord] = (),
) -> Fault:
    """The fault of ``exc``, raised by this rank's training at ``step``."""
    return Fault(
        rank=rank,
        family=family_of(exc),
        error=_first_line(exc),
        where=_user_frame(exc, libraries),
        step=step,
        phase=phase,
        host=host,
        pid=pid,
        record=record_heads(record),
        by=rank,
        at=time.time(),
    )


def gone_fault(rank: int, *, host: str, pid: int, by: int, phase: str, step: int) -> Fault:
    """The fault of a rank whose process ended without a word (seen by ``by``, on its node)."""
    error = (
        "its process ended without an exception in Python "
        "(killed: SIGKILL, the OOM killer, or a crash)"
    )
    return Fault(rank, "gone", error, None, step, phase, host, pid, (), by, time.time())


def left_fault(rank: int, *, step: int, training: str, phases: str, host: str, pid: int) -> Fault:
    """The fault of this rank, whose fit ended while ``training`` (e.g. ``"rank 1"``) had not.

    ``phases``: every rank's phase at the last status exchange (its ``phase``).
    """
    error = f"its fit ended after train step {step} while {training} still trained"
    return Fault(rank, "left", error, None, step, phases, host, pid, (), rank, time.time())


def root(faults: Sequence[Fault]) -> Fault:
    """The fault that started it: the first published that is not a peer's consequence."""
    return next((f for f in faults if f.family != "communication"), faults[0])


def pid_namespace() -> int | None:
    """This process's pid namespace (two ranks compare pids only inside one), or ``None``."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not).

    Asked at every wake of the watchdog thread, for each peer on this node. A pidfd
    (Linux 5.3+) turns readable once its process ended, reaped or not: one open, a poll
    that does not wait and a close, about 2.3 us. Reading ``/proc/PID/stat`` costs 12.9
    us for a rank's 22 threads (the kernel sums every thread's times), warm
    (``benchmarks/peer_liveness.py``). Where no pidfd can be opened (an older kernel, a
    sandbox that forbids the call) ``/proc`` is read.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd here
        return _alive_in_proc(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)
    finally:
        os.close(fd)


def _alive_in_proc(pid: int) -> bool:
    """:func:`is_alive` from ``/proc/PID/stat``'s state, else the kernel's answer to a signal 0."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


@dataclass(frozen=True)
class Process:
    """Where a rank's process runs, as it registered: its pid means something on its node only."""

    node: str
    pid: int
    namespace: int | None
    host: str


class FaultBoard:
    """The faults of one fit, kept in the store under the channel's prefix.

    Writes are single store requests on the caller's thread; :meth:`poll` is one
    request while no fault was published (an ``add`` of 0).
    """

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        base = f"{channel.prefix}/faults"
        self._count = f"{base}/count"
        self._base = base
        self.seen: list[Fault] = []
        self._read = 0  # the faults read so far (by number)
        self._lock = threading.Lock()  # the training thread (an error) and the watchdog's

    def _key(self, what: str, rank: int) -> str:
        return f"{self._base}/{what}/r{rank}"

    def publish(self, fault: Fault) -> None:
        """Adds ``fault`` to the board (its number is the order of publication)."""
        store = self.channel.store
        number = store.add(self._count, 1)
        store.set(f"{self._base}/{number}", pickle.dumps(fault, protocol=pickle.HIGHEST_PROTOCOL))
        notify(self.channel)  # the watchdogs read the board once this changes

    def poll(self) -> list[Fault]:
        """Every fault published so far, in order (new ones read from the store; any thread)."""
        store = self.channel.store
        count = store.add(self._count, 0)
        with self._lock:
            while self._read < count:
                key = f"{self._base}/{self._read + 1}"
                if store.check([key]):
                    self.seen.append(pickle.loads(store.get(key)))
                elif not self._written_after(self._read + 1, count):
                    break  # numbered, not yet written: the next poll reads it
                # else: its publisher died between its number and its fault: a hole, passed
                self._read += 1
            return list(self.seen)

    def _written_after(self, number: int, count: int) -> bool:
        """Whether a fault numbered after ``number`` (up to ``count``) is written already."""
        store = self.channel.store
        return any(store.check([f"{self._base}/{n}"]) for n in range(number + 1, count + 1))

    def register(self, process: Process) -> None:
        """Says where this rank's process runs (once, before its first exchange).

        Under its rank, and in its node's list (:meth:`node_processes`), so that a rank
        reads its own node's ranks only, not every rank's.
        """
        store, rank = self.channel.store, self.channel.rank
        blob = pickle.dumps(process, protocol=pickle.HIGHEST_PROTOCOL)
        store.set(self._key("process", rank), blob)
        number = store.add(f"{self._base}/node/{process.node}/count", 1)
        entry = pickle.dumps((rank, process), protocol=pickle.HIGHEST_PROTOCOL)
        store.set(f"{self._base}/node/{process.node}/{number}", entry)

    def registered(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` whose watchdog thread registered its process (it ran)."""
        store = self.channel.store
        return [rank for rank in ranks if store.check([self._key("process", rank)])]

    def node_processes(self, node: str) -> dict[int, Process]:
        """Where the ranks of ``node`` run (after every rank registered): two requests."""
        store = self.channel.store
        count = store.add(f"{self._base}/node/{node}/count", 0)
        keys = [f"{self._base}/node/{node}/{n}" for n in range(1, count + 1)]
        return dict(pickle.loads(blob) for blob in store.multi_get(keys)) if keys else {}

    def processes(self) -> dict[int, Process]:
        """Where every rank's process runs (after every rank registered)."""
        channel = self.channel
        keys = [self._key("process", rank) for rank in range(channel.world_size)]
        blobs = channel.store.multi_get(keys)
        return {rank: pickle.loads(blob) for rank, blob in enumerate(blobs)}

    def leave(self, why: str) -> None:
        """Says this rank's process may end now without a fault (its guard closed)."""
        self.channel.store.set(self._key("left", self.channel.rank), why.encode())

    def left(self, rank: int) -> bool:
        """Whether ``rank`` said it may end (it closed, or ended the job itself)."""
        return bool(self.channel.store.check([self._key("left", rank)]))

    def wait_left(self, ranks: Iterable[int], timeout_s: float) -> None:
        """Waits until ``ranks`` said they leave, at most ``timeout_s`` (never raises)."""
        keys = [self._key("left", rank) for rank in ranks]
        if not keys:
            return
        try:
            self.channel.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception:  # late or gone: rank 0 exits anyway
            return
