"""Each rank's record of the collectives it issued: counts per process group, the last few calls.

:class:`CollectiveRecorder` wraps the public ``torch.distributed`` collective
functions while a guard is active and writes one fixed-size slot per call into
a file-backed ring (``rank{N}.collectives``, an ``mmap``: the format and its reader are
in :mod:`~rankguard.callbacks.hang.collective_files`), so the record outlives a rank
killed by SIGABRT or SIGKILL. What DDP and FSDP issue is told apart
(:mod:`~rankguard.callbacks.hang.collective_sources`). Decisions are in
:mod:`~rankguard.callbacks.hang.collective_compare`.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import itertools
import json
import logging
import mmap
import os
import sys
import threading
from _thread import get_ident
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from time import time
from typing import Any

from rankguard.callbacks.core.torch_private import ddp_logged, ddp_rebuilt, sequence_reader
from rankguard.callbacks.hang.collective_compare import (
    GroupRecord,
    Issued,
    Mark,
    group_members,
    members_json,
)
from rankguard.callbacks.hang.collective_files import (
    DDP_FORWARD_OP,
    FAULT_SUFFIX,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NAMES_SUFFIX,
    RING_SUFFIX,
    SLOT,
    SLOT_SIZE,
    SLOTS,
    decode_all,
    flight_recorder,
    newest_per_group,
    read_ring,
)
from rankguard.callbacks.hang.collective_infer import (
    buckets_list,
    buckets_of,
    flight_calls,
    group_record,
)
from rankguard.callbacks.hang.collective_sources import (
    DdpForwards,
    mark_wrapper,
    origin_of,
    role_of,
    wrap_coalesced_broadcast,
    wrapped_original,
    wrapper_owner,
)
from rankguard.callbacks.hang.stacks import code_name

__all__ = ["WRAPPED", "CollectiveRecorder", "group_members", "sequence_reader"]

logger = logging.getLogger(__name__)

#: The ``torch.distributed`` functions recorded, each with the parameter whose size every
#: rank passes (``None``: no size, e.g. a barrier).
WRAPPED = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_object": None,
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    # FSDP2's own (torch 2.8+), each rank's shard: equal sizes
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
    "gather": "tensor",
    "gather_object": None,
    "scatter": "tensor",
    "scatter_object_list": None,
    "broadcast_object_list": "object_list",
    "barrier": None,
    "monitored_barrier": None,
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
OPS = tuple(WRAPPED)
#: The last collectives of each group sent with a status.
LAST = 8
#: The last DDP forwards' ends of each group read with them (their backwards' buckets).
MARKS = 4
#: Forwards after DDP's bucket rebuild whose ends read its logger for the rebuilt sizes.
_REBUILT_READS = 20
MADE_MARK = ".rankguard-record-made"  # the folder was made for the record (no report yet)
_SEQUENCES = frozenset({list, tuple})
_MAX_WALK = 48  # frames walked up to the user's code per collective, at most


def _is_compiling() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` (torch 2.3+), or a function that says no."""
    import torch

    compiler = getattr(torch, "compiler", None)
    return getattr(compiler, "is_compiling", None) or (lambda: False)


class _Names:
    """Ids of the strings a slot refers to (groups, dtypes, code objects, threads)."""

    def __init__(self) -> None:
        self.groups: list[dict] = []
        self.dtypes: list[str] = []
        self.codes: list[tuple[str, str]] = []
        self.threads: dict[str, str] = {}
        self.origins: list[str] = []  # what issued a framework's collective (templates)
        self.events: list[str] = []  # the events a phase names
        self.ddp: list[dict | None] = []  # each DDP module's buckets, as its logger has them
        self.dtype_ids: dict[int, int] = {}  # by id(): a code object's hash is not cached
        self.code_ids: dict[int, int] = {}
        self.kept: list[Any] = []  # the objects whose id() is a key, kept alive

    def current(self) -> dict[str, Any]:
        """The names as :func:`decode_all` reads them, copied as they stand (no JSON trip)."""
        return {
            "ops": OPS,
            "dtypes": list(self.dtypes),
            "codes": list(self.codes),
            "threads": dict(self.threads),
            "origins": list(self.origins),
            "events": list(self.events),
            "ddp": list(self.ddp),
        }

    def to_json(self, rank: int, pid: int) -> str:
        return json.dumps({"rank": rank, "pid": pid, "groups": self.groups, **self.current()})


def _untold(record: GroupRecord) -> bool:
    """Whether a group's newest numbers hold one nothing told, or told without its size."""
    seqs = {i.seq for i in record.last}
    low = min(seqs, default=record.count)
    missing = any(n not in seqs for n in range(low, record.count + 1))
    return missing or any(i.numel < 0 for i in record.last)


class _OwnCount:
    """A group's count kept here, where the process group keeps none: collectives from Python."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


class _Group:
    """A process group as the record knows it (slots: read at every collective)."""

    __slots__ = ("gid", "name", "own", "ranks", "seq")

    def __init__(
        self, gid: int, name: str, ranks: Sequence[int], seq: Callable[[], int], own: Any
    ) -> None:
        self.gid, self.name, self.ranks, self.seq = gid, name, ranks, seq
        self.own: _OwnCount | None = own  # set when the process group keeps no count


class CollectiveRecorder:
    """Records the collectives this rank issues while installed; restores torch at close.

    Per collective the training thread reads the group's count, the tensor's
    type and size, a clock and the issuing frame's code and line, and packs
    them into the next ring slot: no formatting, no lock, no flush. Names
    (groups, code objects, threads) are given ids the first time they are seen
    and written to ``rank{N}.collectives.json`` then (rarely).

    Args:
        directory: Where the ring file goes (the report directory).
        rank: This rank (its files' names).
        libraries: Folders whose code is not the user's: the issuing line is the
            innermost frame outside them.
        phase: The training thread's phase now, ``(event, step, batch index)`` or
            ``None``: read for the collectives a framework issues (a DDP forward's end,
            its buffer broadcast, FSDP's), which the record tells in their phase.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        libraries: Iterable[str],
        phase: Callable[[], tuple[str, int, int | None] | None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self._libraries = tuple(libraries)
        self._phase = phase
        self._origin_ids: dict[str, int] = {}
        self._event_ids: dict[str, int] = {}
        self._ddp_ids: dict[int, int] = {}  # id(DDP module) -> its index in names.ddp
        self._ddp_reads: dict[int, int] = {}  # index -> forwards left to read rebuilt sizes
        self._undo: list[Callable[[], None]] = []  # the wrappers of DDP's C++ collectives
        self._seen_counts: tuple[int, ...] | None = None  # at the last snapshot
        self._grad_enabled: Callable[[], bool] = lambda: True  # torch.is_grad_enabled
        self._names = _Names()
        self._groups: dict[Any, _Group] = {}
        self._library_codes: dict[Any, bool] = {}
        self._code_ids = self._names.code_ids
        self._dtype_ids = self._names.dtype_ids
        self._threads: set[int] = set()
        self._counter = itertools.count()
        self._originals: dict[str, Callable] = {}
        self._file: Any = None
        self._ring: mmap.mmap | None = None
        self._fault: Any = None
        self._fault_was_enabled = False
        self._made: list[Path] = []  # folders this record created (removed when healthy)
        self.path = self.directory / f"rank{rank}{RING_SUFFIX}"

    # -- install / close ----------------------------------------------------------------

    def install(self) -> bool:
        """Opens the ring and wraps ``torch.distributed``'s collectives; ``False`` if it cannot."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return False
        try:
            self._made = [p for p in (self.directory, *self.directory.parents) if not p.exists()]
            self.directory.mkdir(parents=True, exist_ok=True)
            if self._made:  # made for the record: the last rank to close removes it
                (self.directory / MADE_MARK).touch()
            self._file = open(self.path, "w+b")
            self._file.truncate(HEADER_SIZE + SLOTS * SLOT_SIZE)
            self._ring = mmap.mmap(self._file.fileno(), HEADER_SIZE + SLOTS * SLOT_SIZE)
            HEADER.pack_into(self._ring, 0, MAGIC, SLOTS, os.getpid())
        except OSError as exc:
            logger.debug("rankguard: no collective record file (%s)", exc)
            self._close_ring()
            return False
        self._group(None)  # the default group is always in the record (DDP's collectives)
        self._write_names()
        for name, size_param in WRAPPED.items():
            original = getattr(dist, name, None)
            if original is None or wrapped_original(original) is not None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original, size_param))
        self._install_sources()
        self._enable_faulthandler()
        return True

    def _install_sources(self) -> None:
        """Wraps what DDP issues from C++: its forward (marked) and its buffer broadcast."""
        import torch

        self._grad_enabled = torch.is_grad_enabled
        forwards = DdpForwards(self._mark_forward, self._count_of, _is_compiling())
        if forwards.install():
            self._undo.append(forwards.uninstall)
        undo = wrap_coalesced_broadcast(self._note_coalesced)
        if undo is not None:
            self._undo.append(undo)

    def close(self, keep: bool) -> None:
        """Restores ``torch.distributed``; removes the files unless ``keep``. Safe twice."""
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a requirement
            dist = None
        for name, original in self._originals.items():
            if dist is not None and wrapper_owner(getattr(dist, name, None)) is self:
                setattr(dist, name, original)
        self._originals = {}
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._disable_faulthandler()
        self._close_ring()
        if not keep:
            for suffix in (RING_SUFFIX, NAMES_SUFFIX, FAULT_SUFFIX):
                (self.directory / f"rank{self.rank}{suffix}").unlink(missing_ok=True)
            self._remove_folder()
        self._made = []

    def _remove_folder(self) -> None:
        """A healthy run leaves no report folder behind: the last rank removes the one made."""
        mark = self.directory / MADE_MARK
        try:
            if [p.name for p in self.directory.iterdir()] != [MADE_MARK]:
                return  # another rank's files still there, or a report: kept
            mark.unlink()
            self.directory.rmdir()
            for made in self._made[1:]:
                made.rmdir()
        except OSError:
            return  # another rank removed it first, or a folder is not empty

    def _close_ring(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _enable_faulthandler(self) -> None:
        """Every thread's stack goes to ``rank{N}.fault.txt`` on a fatal signal (SIGABRT...)."""
        try:
            self._fault = open(self.directory / f"rank{self.rank}{FAULT_SUFFIX}", "w")
        except OSError:
            return
        self._fault_was_enabled = faulthandler.is_enabled()
        faulthandler.enable(self._fault, all_threads=True)

    def _disable_faulthandler(self) -> None:
        if self._fault is None:
            return
        if self._fault_was_enabled and sys.stderr is not None:
            try:
                faulthandler.enable(sys.stderr, all_threads=True)
            except (ValueError, OSError, AttributeError):
                faulthandler.disable()
        else:
            faulthandler.disable()
        self._fault.close()
        self._fault = None

    # -- the training thread's cost: one slot per collective ------------------------------

    def _wrap(self, name: str, original: Callable, size_param: str | None) -> Callable:
        params = list(inspect.signature(original).parameters)
        group_at = params.index("group") if "group" in params else -1
        size_at = params.index(size_param) if size_param in params else -1
        op = OPS.index(name)
        note = self._note
        getframe = sys._getframe
        compiling = _is_compiling()

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if compiling():  # torch.compile traces the collective itself, never the record
                return original(*args, **kwargs)
            try:
                group = (
                    kwargs.get("group") if len(args) <= group_at or group_at < 0 else args[group_at]
                )
                sized = (
                    kwargs.get(size_param) if len(args) <= size_at or size_at < 0 else args[size_at]
                )
                note(op, group, sized, getframe(1))
            except Exception:
                pass
            return original(*args, **kwargs)

        mark_wrapper(collective, original, owner=self)
        return collective

    def _note(
        self,
        op: int,
        group: Any,
        sized: Any,
        frame: Any,
        size: tuple[int, int] | None = None,
        ahead: int = 0,
    ) -> None:
        """Packs one collective into the next slot (the training thread: keep it lean).

        ``size``: its ``(dtype id, elements)`` where no tensor says (a coalesced broadcast's
        bucket); ``ahead``: its place after the group's next one (issued by one C++ call).
        """
        ring = self._ring
        if ring is None:
            return
        known = self._groups.get(id(group)) or self._group(group)
        seq = known.seq() + 1 + ahead
        if known.own is not None:
            known.own.value = seq
        if size is not None:
            dtype, numel = size
        elif sized is None:
            dtype, numel = -1, 0
        elif type(sized) in _SEQUENCES:
            dtype, numel = self._size(sized)
        else:
            dtype = self._dtype_ids.get(id(sized.dtype))
            if dtype is None:
                dtype = self._dtype_id(sized.dtype)
            numel = sized.numel()
        codes, library = self._code_ids, self._library_codes
        code = frame.f_code
        call_line = frame.f_lasti  # its line is looked up off this thread (f_lineno is not free)
        call_code = codes.get(id(code))
        if call_code is None:
            call_code = self._code_id(code)
        walked = 0  # up to the user's own code: one step when it calls torch.distributed
        said = None  # the framework frames that say what issued it (FSDP's hooks, DDP's)
        while walked < _MAX_WALK:
            lib = library.get(id(code))  # a code object's own hash is computed at each call
            if lib is None:
                lib = library[id(code)] = self._library_role(code)
            if not lib:
                break
            if lib > 1:
                if said is None:
                    said = []
                said.append((lib, frame))
            frame = frame.f_back
            if frame is None:
                break
            code = frame.f_code
            walked += 1
        user_code, user_line = (code, frame.f_lasti) if frame is not None else (None, 0)
        user = codes.get(id(user_code)) if user_code is not None else -1
        if user is None:
            user = self._code_id(user_code)
        origin, event, step, batch = -1, -1, 0, -1
        if said is not None:
            origin = self._origin_id(origin_of(OPS[op], said))
            if origin >= 0:
                event, step, batch = self._phase_fields()
        ident = get_ident()
        if ident not in self._threads:
            self._new_thread(ident)
        slot = next(self._counter)
        SLOT.pack_into(
            ring,
            HEADER_SIZE + (slot % SLOTS) * SLOT_SIZE,
            slot + 1,
            seq,
            numel,
            time(),
            ident,
            known.gid,
            op,
            dtype,
            user,
            user_line,
            call_code,
            call_line,
            origin,
            event,
            step,
            batch,
        )

    # -- what DDP issues from C++ (the training thread, once per forward) -----------------

    def _count_of(self, group: Any) -> int:
        """A group's count of collectives now (a DDP forward's start)."""
        known = self._groups.get(id(group)) or self._group(group)
        return known.seq()

    def _note_coalesced(self, group: Any, buckets: list[tuple[Any, int]], frame: Any) -> None:
        """The broadcasts one ``_broadcast_coalesced`` call issues, one slot each."""
        op = OPS.index("broadcast")
        for ahead, (dtype, numel) in enumerate(buckets):
            self._note(op, group, None, frame, size=(self._dtype_id(dtype), numel), ahead=ahead)

    def _mark_forward(self, ddp: Any, start: int) -> None:
        """Marks a DDP forward's end: its group's counts, whether a backward reduces after it."""
        ring = self._ring
        if ring is None:
            return
        group = ddp.process_group
        known = self._groups.get(id(group)) or self._group(group)
        index = self._ddp_ids.get(id(ddp))
        if index is None:
            index = self._adopt(ddp)
        elif index in self._ddp_reads:
            self._reread(ddp, index)
        reduces = self._grad_enabled() and bool(ddp.require_backward_grad_sync)
        event, step, batch = self._phase_fields()
        ident = get_ident()
        if ident not in self._threads:
            self._new_thread(ident)
        slot = next(self._counter)
        SLOT.pack_into(
            ring,
            HEADER_SIZE + (slot % SLOTS) * SLOT_SIZE,
            slot + 1,
            known.seq(),
            2 * start + int(reduces),
            time(),
            ident,
            known.gid,
            DDP_FORWARD_OP,
            index,
            -1,
            0,
            -1,
            0,
            -1,
            event,
            step,
            batch,
        )

    def _adopt(self, ddp: Any) -> int:
        """A DDP module's first forward: its buckets from its logger (once; rarely again)."""
        self._names.kept.append(ddp)
        index = self._ddp_ids[id(ddp)] = len(self._names.ddp)
        self._names.ddp.append(None)
        self._reread(ddp, index)
        if not ddp_rebuilt(ddp):
            self._ddp_reads[index] = _REBUILT_READS  # its buckets change when rebuilt
        return index

    def _reread(self, ddp: Any, index: int) -> None:
        """Reads DDP's buckets: its first ones, or once rebuilt, the rebuilt ones when logged."""
        rebuilt = ddp_rebuilt(ddp)
        if index in self._ddp_reads and not rebuilt and self._names.ddp[index] is not None:
            return  # not rebuilt yet: one attribute read a forward
        logged = ddp_logged(ddp)
        buckets = buckets_of(logged)
        if rebuilt and buckets is not None and not (logged or {}).get("rebuilt_bucket_sizes"):
            buckets = buckets._replace(sizes=())  # rebuilt, its sizes not logged yet
            left = self._ddp_reads.get(index, 0) - 1
            if left > 0:
                self._ddp_reads[index] = left
            else:
                self._ddp_reads.pop(index, None)
        elif rebuilt:
            self._ddp_reads.pop(index, None)
        self._names.ddp[index] = buckets._asdict() if buckets is not None else None
        self._write_names()

    def _phase_fields(self) -> tuple[int, int, int]:
        """The training thread's phase now as ``(event id, step, batch index)``; -1: none."""
        read = self._phase
        try:
            found = read() if read is not None else None
        except Exception:
            found = None
        if found is None:
            return -1, 0, -1
        event, step, batch = found
        event_id = self._event_ids.get(event)
        if event_id is None:
            event_id = self._event_ids[event] = len(self._names.events)
            self._names.events.append(event)
            self._write_names()
        return event_id, int(step), -1 if batch is None else int(batch)

    def _origin_id(self, origin: str | None) -> int:
        """The id of what issued a collective (rare: a few per model), -1 for ``None``."""
        if origin is None:
            return -1
        found = self._origin_ids.get(origin)
        if found is None:
            found = self._origin_ids[origin] = len(self._names.origins)
            self._names.origins.append(origin)
            self._write_names()
        return found

    def _new_thread(self, ident: int) -> None:
        self._threads.add(ident)
        self._names.threads[str(ident)] = threading.current_thread().name
        self._write_names()

    def _size(self, sized: Any) -> tuple[int, int]:
        if sized is None:
            return -1, 0
        if isinstance(sized, list | tuple):
            first = sized[0] if sized else None
            dtype = getattr(first, "dtype", "object")
            return self._dtype_id(dtype), len(sized)
        return self._dtype_id(sized.dtype), sized.numel()

    def _dtype_id(self, dtype: Any) -> int:
        found = self._names.dtype_ids.get(id(dtype))
        if found is None:
            self._names.kept.append(dtype)  # ids stay unique while the object is kept
            found = self._names.dtype_ids[id(dtype)] = len(self._names.dtypes)
            self._names.dtypes.append(str(dtype).removeprefix("torch."))
            self._write_names()
        return found

    def _code_id(self, code: Any) -> int:
        if code is None:
            return -1
        found = self._names.code_ids.get(id(code))
        if found is None:
            self._names.kept.append(code)
            found = self._names.code_ids[id(code)] = len(self._names.codes)
            lines = [(start, line) for start, _, line in code.co_lines() if line is not None]
            self._names.codes.append((code.co_filename, code_name(code), lines))
            self._write_names()
        return found

    def _library_role(self, code: Any) -> int:
        """0 for the user's own code; else a library frame's role bits (``role_of``)."""
        self._names.kept.append(code)
        filename = code.co_filename
        if filename.startswith("<"):
            return 1
        if not os.path.abspath(filename).startswith(self._libraries):
            return 0
        return role_of(filename, code.co_name)

    def _group(self, group: Any) -> _Group:
        """Registers a process group the first time a collective names it (rare)."""
        import torch.distributed as dist

        pg = dist.group.WORLD if group is None else group
        known = self._groups.get(id(pg))
        if known is None:
            try:
                ranks = group_members(dist.get_process_group_ranks(pg))
            except (RuntimeError, ValueError, AttributeError):
                ranks = group_members(range(dist.get_world_size()))
            name = str(getattr(pg, "group_name", len(self._groups)))
            reader = sequence_reader(pg)
            own = None if reader is not None else _OwnCount()
            known = _Group(len(self._names.groups), name, ranks, reader or own, own)
            self._names.groups.append({"name": name, "ranks": members_json(ranks)})
            self._groups[id(pg)] = known
            self._names.kept.append(pg)
            self._write_names()
        self._groups[id(group)] = known
        self._names.kept.append(group)
        return known

    def _write_names(self) -> None:
        path = self.directory / f"rank{self.rank}{NAMES_SUFFIX}"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(self._names.to_json(self.rank, os.getpid()), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            logger.debug("rankguard: could not write %s: %s", path, exc)

    # -- the watchdog thread: what the record says ----------------------------------------

    def counts(self) -> tuple[int, ...]:
        """Each known group's count now (cheap: the watchdog compares it between samples)."""
        return tuple(g.seq() for g in self._known())

    def _known(self) -> list[_Group]:
        groups = {g.gid: g for g in list(self._groups.values())}
        return [groups[gid] for gid in sorted(groups)]

    def snapshot(self) -> tuple[GroupRecord, ...]:
        """Per group: its members, its count, its last :data:`LAST` collectives (formatted here).

        DDP's bucket all-reduces are told from its forwards' marks; where the counts have
        not moved since the last snapshot (the rank issues nothing), the flight recorder's
        entries, where the running torch keeps them, tell what the others were.
        """
        # The counts before the ring: a call is noted before its collective is counted,
        # so every number counted here is in the ring read after it. One issued between a
        # ring read and a count read would be a number no Python call took, which after a
        # DDP forward is told as a gradient bucket: a mismatch with the others where none was.
        known = self._known()
        counts = tuple(g.seq() for g in known)
        ring = self._ring
        slots = newest_per_group(read_ring(ring) if ring is not None else [], LAST, MARKS)
        names = self._names.current()
        decoded = decode_all(slots, names)
        threads = {str(t.ident): t.name for t in threading.enumerate()}
        still, self._seen_counts = counts == self._seen_counts, counts
        buckets = buckets_list(names["ddp"])
        held = []
        for group in known:
            mine = [i for gid, i in decoded if gid == group.gid]
            last = [i for i in mine if isinstance(i, Issued)]
            last = [i._replace(thread=threads.get(i.thread, i.thread)) for i in last]
            marks = [m for m in mine if isinstance(m, Mark)]
            marks = [m._replace(thread=threads.get(m.thread, m.thread)) for m in marks]
            held.append((group, last, marks))

        def records(flight: list[dict] | None) -> tuple[GroupRecord, ...]:
            return tuple(
                group_record(
                    group.name,
                    group.ranks,
                    count,
                    last,
                    marks,
                    buckets,
                    last=LAST,
                    cut=len(last) >= LAST,
                    flight=flight_calls(flight, group.name) if flight else None,
                )
                for (group, last, marks), count in zip(held, counts, strict=True)
            )

        told = records(None)
        if still and any(_untold(record) for record in told):  # it issues nothing: ask torch
            flight = self._flight()
            if flight:
                return records(flight)
        return told

    @staticmethod
    def _flight() -> list[dict]:
        """The flight recorder's entries (where the running torch keeps any), else ``[]``."""
        try:
            return flight_recorder()[0]
        except Exception:
            return []
