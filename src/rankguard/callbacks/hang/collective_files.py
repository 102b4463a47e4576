"""The record of collectives on disk: the ring's format, its reader, the flight recorder.

What :class:`~rankguard.callbacks.hang.collectives.CollectiveRecorder` writes per rank
(``rank{N}.collectives``: fixed-size slots in an ``mmap``; ``rank{N}.collectives.json``:
the names they refer to), read back by the watchdog and by ``rankguard report DIR``
after the ranks died; and PyTorch's flight recorder, where the running torch keeps one.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

from rankguard.callbacks.core.step_log import PAIRS
from rankguard.callbacks.core.torch_private import flight_recorder_dumps
from rankguard.callbacks.hang.collective_compare import (
    GroupRecord,
    Issued,
    Mark,
    group_members,
)
from rankguard.callbacks.hang.stacks import describe_frame
from rankguard.callbacks.hang.verdict_text import phase_label

__all__ = [
    "DDP_FORWARD_OP",
    "FAULT_SUFFIX",
    "FLIGHT_SUFFIX",
    "RING_SUFFIX",
    "decode",
    "decode_all",
    "flight_recorder",
    "newest_per_group",
    "read_files",
    "read_ring",
    "write_flight_recorder",
]

logger = logging.getLogger(__name__)

#: Slots in the ring (the last collectives kept, every group together).
SLOTS = 256
MAGIC = b"RGCR0002"
# slot number + 1 (0: empty), seq, numel, time, thread ident, group, op, dtype, user code,
# user instruction offset, call code, call instruction offset, origin, and the phase it was
# issued in: event, step, batch index (-1: none)
SLOT = struct.Struct("<qqqdQiiiiiiiiiii")
#: The op id of a slot that marks a DDP forward's end (not a collective): its ``seq`` is
#: the group's count then, ``numel`` the count at its start times 2 plus whether it reduces,
#: ``dtype`` the DDP module's index in the names' ``ddp`` list.
DDP_FORWARD_OP = -2
SLOT_SIZE = SLOT.size
HEADER = struct.Struct("<8sqq")  # magic, slots, pid
HEADER_SIZE = 64
RING_SUFFIX = ".collectives"
NAMES_SUFFIX = ".collectives.json"
FAULT_SUFFIX = ".fault.txt"
FLIGHT_SUFFIX = ".flight.json"


def flight_recorder() -> tuple[list[dict], str]:
    """PyTorch's flight recorder entries of this process, where the running torch keeps them.

    The dump functions are private and change across versions
    (``torch_private.flight_recorder_dumps``): each this torch has is read, and their
    entries are joined.

    Returns:
        The entries (dicts with ``collective_seq_id``, ``profiling_name``, ``input_sizes``,
        ``state``, ``frames``, ...) and where they came from, or ``[]`` and why not.
    """
    entries: list[dict] = []
    sources: list[str] = []
    why: list[str] = []
    for name, dump in flight_recorder_dumps():
        found, reason = _dump_entries(name, dump)
        entries += found
        (sources if found else why).append(name if found else reason)
    if entries:
        return entries, ", ".join(sources)
    return [], "; ".join(why) or "no flight recorder dump in this torch"


def _dump_entries(name: str, dump: Any) -> tuple[list[dict], str]:
    """One flight recorder's entries, or ``[]`` and why not."""
    try:
        try:
            text = dump(includeCollectives=True, onlyActive=False)
        except TypeError:
            text = dump()
        entries = json.loads(text).get("entries", [])
    except (ValueError, AttributeError) as exc:
        return [], f"{name} gave no JSON: {exc}"
    except Exception as exc:
        return [], f"{name} failed: {exc}"
    if not entries:
        return [], f"{name}: no entries (flight recorder off or nothing recorded)"
    return list(entries), name


def write_flight_recorder(directory: str | os.PathLike, rank: int) -> Path | None:
    """Writes the flight recorder's entries to ``rank{N}.flight.json`` where torch keeps any."""
    entries, source = flight_recorder()
    if not entries:
        return None
    path = Path(directory) / f"rank{rank}{FLIGHT_SUFFIX}"
    try:
        path.write_text(json.dumps({"source": source, "entries": entries}, default=str))
    except OSError as exc:
        logger.debug("rankguard: could not write %s: %s", path, exc)
        return None
    return path


def read_ring(buffer: Any) -> list[tuple]:
    """The ring's slots in the order written, ``[]`` when ``buffer`` is not a ring.

    Each is ``(seq, numel, t, thread, group, op, dtype, user code, user line, call
    code, call line, origin, event, step, batch)``.
    """
    magic, slots, _ = HEADER.unpack_from(buffer, 0)
    if magic != MAGIC:
        return []
    rows = [SLOT.unpack_from(buffer, HEADER_SIZE + n * SLOT_SIZE) for n in range(slots)]
    return [row[1:] for row in sorted(rows) if row[0]]


def _line(lines: list, lasti: int) -> int:
    """The source line of the instruction at offset ``lasti`` (a code object's line table)."""
    found = 0
    for start, line in lines:
        if start > lasti:
            break
        found = line
    return found


def _where(codes: list, code_id: int, lasti: int, source: bool = True) -> str | None:
    if code_id < 0 or code_id >= len(codes):
        return None
    filename, function, lines = codes[code_id]
    return describe_frame(filename, _line(lines, lasti), function, source)


def newest_per_group(rows: list[tuple], per_group: int, marks: int = 0) -> list[tuple]:
    """The last ``per_group`` collectives of each group and its last ``marks`` DDP marks.

    A slot's group is its 5th field; the slots are kept in the order written.
    """
    kept: list[tuple] = []
    seen: dict[tuple[int, bool], int] = {}
    for row in reversed(rows):
        key = (row[4], row[5] == DDP_FORWARD_OP)
        if seen.get(key, 0) < (marks if key[1] else per_group):
            seen[key] = seen.get(key, 0) + 1
            kept.append(row)
    kept.reverse()
    return kept


def _phase(events: list, event: int, step: int, batch: int) -> str | None:
    """A slot's phase in words (``phase_label``'s), or ``None`` where it has none."""
    if not 0 <= event < len(events):
        return None
    name = events[event]
    pair = PAIRS.get(name)
    if pair is not None:  # a batch's end and the next fetch's start: the later one
        name, step = pair[1], (batch if pair[1] == "data_fetch_start" and batch >= 0 else step)
    return phase_label(name, step, batch if batch >= 0 else None, None)


def decode(rows: list[tuple], names: dict) -> list[tuple[int, Issued]]:
    """Slots as ``(group id, Issued)`` (marks left out); a thread is its ident until named."""
    return [(gid, item) for gid, item in decode_all(rows, names) if isinstance(item, Issued)]


def decode_all(rows: list[tuple], names: dict) -> list[tuple[int, Issued | Mark]]:
    """Slots as ``(group id, Issued or Mark)``, in the order written."""
    ops, dtypes, codes = names["ops"], names["dtypes"], names["codes"]
    threads = names.get("threads", {})
    origins, events = names.get("origins", []), names.get("events", [])
    out: list[tuple[int, Issued | Mark]] = []
    for row in rows:
        seq, numel, t, thread, gid, op, dtype, ucode, uline, ccode, cline, *rest = row
        origin, event, step, batch = rest or (-1, -1, 0, -1)
        thread_name = threads.get(str(thread), str(thread))
        phase = _phase(events, event, step, batch)
        if op == DDP_FORWARD_OP:
            mark = Mark(numel >> 1, seq, bool(numel & 1), dtype, phase, thread_name, t)
            out.append((gid, mark))
            continue
        where = _where(codes, ucode, uline) or _where(codes, ccode, cline)
        issued = Issued(
            seq=seq,
            op=ops[op] if 0 <= op < len(ops) else "?",
            dtype=dtypes[dtype] if 0 <= dtype < len(dtypes) else "-",
            numel=numel,
            where=where,
            thread=thread_name,
            t=t,
            origin=origins[origin] if 0 <= origin < len(origins) else None,
            phase=phase if 0 <= origin < len(origins) else None,
        )
        out.append((gid, issued))
    return out


def read_files(directory: str | os.PathLike) -> dict[int, tuple[GroupRecord, ...]]:
    """Every rank's record left in ``directory`` (``rank{N}.collectives`` and its names).

    The counts are the last collective numbers the ring holds per group (the
    group's own counter died with the process).
    """
    records = {}
    for path in sorted(Path(directory).glob(f"rank*{RING_SUFFIX}")):
        rank_text = path.name[len("rank") : -len(RING_SUFFIX)]
        names_path = path.with_name(f"rank{rank_text}{NAMES_SUFFIX}")
        if not rank_text.isdigit() or not names_path.exists():
            continue
        try:
            names = json.loads(names_path.read_text(encoding="utf-8"))
            rows = read_ring(path.read_bytes())
        except (OSError, ValueError, struct.error):
            continue
        cut = len(rows) >= SLOTS  # the ring went round: older calls may have left it
        records[int(rank_text)] = _groups(decode_all(rows, names), names, cut)
    return records


def _groups(
    decoded: list[tuple[int, Issued | Mark]], names: dict, cut: bool
) -> tuple[GroupRecord, ...]:
    """Per group of a rank's names: every call its ring holds, DDP's bucket all-reduces told."""
    from rankguard.callbacks.hang.collective_infer import buckets_list, group_record

    buckets = buckets_list(names.get("ddp", []))
    groups = []
    for gid, group in enumerate(names["groups"]):
        mine = [i for g, i in decoded if g == gid]
        calls = [i for i in mine if isinstance(i, Issued)]
        marks = [m for m in mine if isinstance(m, Mark)]
        count = max([i.seq for i in calls] + [m.end for m in marks], default=0)
        ranks = group_members(group["ranks"])
        record = group_record(
            group["name"], ranks, count, calls, marks, buckets, last=len(calls) + 8, cut=cut
        )
        groups.append(record)
    return tuple(groups)
