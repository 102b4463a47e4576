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

from rankguard.callbacks.core.torch_private import flight_recorder_dumps
from rankguard.callbacks.hang.collective_compare import GroupRecord, Issued, group_members
from rankguard.callbacks.hang.stacks import describe_frame

__all__ = [
    "FAULT_SUFFIX",
    "FLIGHT_SUFFIX",
    "RING_SUFFIX",
    "decode",
    "flight_recorder",
    "newest_per_group",
    "read_files",
    "read_ring",
    "write_flight_recorder",
]

logger = logging.getLogger(__name__)

#: Slots in the ring (the last collectives kept, every group together).
SLOTS = 256
MAGIC = b"RGCR0001"
# slot number + 1 (0: empty), seq, numel, time, thread ident, group, op, dtype, user code,
# user instruction offset, call code, call instruction offset
SLOT = struct.Struct("<qqqdQiiiiiii")
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
    code, call line)``.
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


def newest_per_group(rows: list[tuple], per_group: int) -> list[tuple]:
    """The last ``per_group`` slots of each group, in the order written (a slot's 5th field)."""
    kept: list[tuple] = []
    seen: dict[int, int] = {}
    for row in reversed(rows):
        if seen.get(row[4], 0) < per_group:
            seen[row[4]] = seen.get(row[4], 0) + 1
            kept.append(row)
    kept.reverse()
    return kept


def decode(rows: list[tuple], names: dict) -> list[tuple[int, Issued]]:
    """Slots as ``(group id, Issued)``; the thread is its ident until a name is known."""
    ops, dtypes, codes = names["ops"], names["dtypes"], names["codes"]
    threads = names.get("threads", {})
    out = []
    for seq, numel, t, thread, gid, op, dtype, ucode, uline, ccode, cline in rows:
        where = _where(codes, ucode, uline) or _where(codes, ccode, cline)
        out.append(
            (
                gid,
                Issued(
                    seq=seq,
                    op=ops[op] if 0 <= op < len(ops) else "?",
                    dtype=dtypes[dtype] if 0 <= dtype < len(dtypes) else "-",
                    numel=numel,
                    where=where,
                    thread=threads.get(str(thread), str(thread)),
                    t=t,
                ),
            )
        )
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
        issued = decode(rows, names)
        groups = []
        for gid, group in enumerate(names["groups"]):
            mine = [i for g, i in issued if g == gid]
            count = max((i.seq for i in mine), default=0)
            groups.append(
                GroupRecord(group["name"], group_members(group["ranks"]), count, tuple(mine))
            )
        records[int(rank_text)] = tuple(groups)
    return records
