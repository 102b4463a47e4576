"""Hang report files: what the HangWatchdog writes on an incident.

Each rank writes ``rank{N}.txt`` (every thread's stack) and ``rank{N}.jsonl``
(its last heartbeats and the report record); the lowest answering rank writes
``summary.txt``; the CLI merges them into ``merged.txt`` and ``timeline.png``.
See docs/hang.md#report-files.
"""

# The reader, ``rankguard report DIR``, is the package ``rankguard.report``.

from __future__ import annotations

import faulthandler
import json
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankguard.callbacks.hang.status import RankStatus

__all__ = [
    "LOOP_MARK",
    "RANK_STACKS",
    "REPORT_EVENT",
    "SUMMARY_FILE",
    "write_heartbeats",
    "write_incident",
    "write_stacks",
    "write_summary",
]

SUMMARY_FILE = "summary.txt"
#: A rank's stacks file, ``rank{N}.txt``.
RANK_STACKS = re.compile(r"^rank(\d+)\.txt$")
#: Added to the training loop thread's line in ``rank{N}.txt``.
LOOP_MARK = "[training loop]"
#: The ``event`` of the record a rank adds to ``rank{N}.jsonl`` when it reports (its
#: status then: the timeline's end, deadline and waits); every other record is a heartbeat.
REPORT_EVENT = "report"

_THREAD_LINE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")


def _mark_thread(stacks: str, thread: int) -> str:
    """Marks the line that opens ``thread``'s stack in a faulthandler dump with LOOP_MARK."""
    lines = stacks.split("\n")
    for i, line in enumerate(lines):
        match = _THREAD_LINE.match(line)
        if match and int(match.group(2), 16) == thread:
            lines[i] = f"{match.group(0)} {LOOP_MARK}{line[match.end() :]}"
    return "\n".join(lines)


def write_stacks(
    directory: str | Path, rank: int, header: str, loop_thread: int | None = None
) -> Path:
    """Writes ``header`` and every thread's Python stack to ``rank{rank}.txt``.

    Args:
        directory: The report directory (created if needed).
        rank: This rank.
        header: The first line.
        loop_thread: Ident of the training loop's thread, marked with
            :data:`LOOP_MARK`; ``None`` if unknown.
    """
    path = Path(directory) / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile("w+", encoding="utf-8") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)  # writes to the descriptor
        dump.seek(0)
        stacks = dump.read()
    if loop_thread is not None:
        stacks = _mark_thread(stacks, loop_thread)
    note = f"(The training loop's thread is marked {LOOP_MARK}; the watchdog is the current one.)"
    path.write_text(f"{header.rstrip()}\n{note}\n\n{stacks}", encoding="utf-8")
    return path


def write_summary(directory: str | Path, text: str) -> Path:
    """Writes the incident summary to ``summary.txt``."""
    path = Path(directory) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    return path


def write_heartbeats(directory: str | Path, rank: int, beats: Iterable[dict]) -> Path:
    """Writes recent heartbeats to ``rank{rank}.jsonl``, one JSON object a line."""
    path = Path(directory) / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(b) + "\n" for b in beats), encoding="utf-8")
    return path


def write_incident(
    directory: str | Path,
    rank: int,
    header: str,
    beats: Iterable[dict],
    summary: str | None,
    loop_thread: int | None = None,
    status: RankStatus | None = None,
) -> None:
    """Writes one rank's part of an incident report.

    Args:
        directory: The report directory (created if needed).
        rank: This rank.
        header: First line of ``rank{rank}.txt``: rank, host, pid, phase.
        beats: Recent heartbeats for ``rank{rank}.jsonl``.
        summary: The verdict for ``summary.txt``, on the one rank that writes it.
        loop_thread: Ident of the training loop's thread, marked in the stacks.
        status: This rank's status when it reported, added to ``rank{rank}.jsonl``
            as a ``report`` record (the timeline's end, deadline and waits).
    """
    write_stacks(directory, rank, header, loop_thread)
    records = list(beats)
    if status is not None:
        records.append(
            {
                "t": time.time(),
                "event": REPORT_EVENT,
                "phase": status.phase,
                "step": status.step,
                "idle_s": status.idle_s,
                "deadline_s": status.deadline_s,
                "ceiling_s": status.ceiling_s,
                "blocked_in": status.blocked_in,
                "user_frame": status.user_frame,
                "waits_at": status.waits_at,
                "wait_s": status.wait_s,
                "usual": status.usual,
                "direct": status.direct,
            }
        )
    write_heartbeats(directory, rank, records)
    if summary is not None:
        stacks = f"Stacks: {Path(directory)}/rank<N>.txt per rank (merge: rankguard report DIR)."
        write_summary(directory, f"{summary.rstrip()}\n{stacks}")
