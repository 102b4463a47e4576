"""Hang report files: what the HangWatchdog writes on an incident, and ``rankguard report DIR``.

Each rank writes ``rank{N}.txt`` (every thread's stack) and ``rank{N}.jsonl``
(its last heartbeats and the report record); the lowest answering rank writes
``summary.txt``; the CLI merges them into ``merged.txt`` and ``timeline.png``.
See docs/hang.md#report-files.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.timeline import REPORT_EVENT

if TYPE_CHECKING:
    from rankguard.callbacks.hang.status import RankStatus

__all__ = [
    "LOOP_MARK",
    "REPORT_EVENT",
    "add_arguments",
    "loop_stack",
    "main",
    "merge_stacks",
    "run",
    "write_heartbeats",
    "write_incident",
    "write_stacks",
    "write_summary",
]

SUMMARY_FILE = "summary.txt"
MERGED_FILE = "merged.txt"
TIMELINE_FILE = "timeline.png"

#: Added to the training loop thread's line in ``rank{N}.txt``.
LOOP_MARK = "[training loop]"

_RANK_FILE = re.compile(r"^rank(\d+)\.txt$")
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


def _stack_body(text: str) -> str:
    """The stack part of a rank file, with thread ids removed so equal stacks compare equal."""
    body = text.split("\n\n", 1)[-1]
    return re.sub(r"(Thread|Current thread) 0x[0-9a-f]+", r"\1", body).strip()


def loop_stack(text: str) -> str | None:
    """The training loop's stack (its frames) from a ``rank{N}.txt``, or ``None`` if unmarked."""
    for block in _stack_body(text).split("\n\n"):
        first, _, frames = block.partition("\n")
        if LOOP_MARK in first:
            return frames.rstrip()
    return None


def merge_stacks(stacks: dict[int, str]) -> str:
    """Groups ranks whose stacks are identical.

    Args:
        stacks: Content of ``rank{N}.txt`` per rank.

    Returns:
        One section per distinct stack, largest group first, each headed by
        its ranks, e.g. ``"== ranks 0,2-7 (7 ranks) =="``.
    """
    groups = group_ranks({rank: _stack_body(text) for rank, text in stacks.items()})
    sections = [
        f"== {rank_label(ranks)} ({len(ranks)} rank{'s' if len(ranks) > 1 else ''}) ==\n{body}\n"
        for ranks, body in groups
    ]
    return "\n".join(sections)


def _read_heartbeats(directory: Path) -> tuple[dict[int, list[dict]], list[str]]:
    """Each rank's records, and one note per file that was cut or could not be read.

    A rank killed while writing (the OOM killer, SIGKILL) leaves a truncated
    last line: the lines before it are kept.
    """
    beats: dict[int, list[dict]] = {}
    notes: list[str] = []
    for path in sorted(directory.glob("rank*.jsonl")):
        match = re.match(r"^rank(\d+)\.jsonl$", path.name)
        if not match:
            continue
        rank = int(match.group(1))
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as exc:
            notes.append(f"rank {rank}: {path.name} could not be read ({exc.strerror or exc}).")
            continue
        rows, cut = [], 0
        for line in filter(str.strip, lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                cut += 1
        if cut:
            notes.append(
                f"rank {rank}: {path.name} was cut ({cut} unreadable line(s), e.g. the rank was "
                f"killed while writing); read the {len(rows)} record(s) before."
            )
        beats[rank] = [row for row in rows if isinstance(row, dict)]
    return beats, notes


def _missing_ranks(stacks: dict[int, str], beats: dict[int, list[dict]]) -> list[str]:
    """Ranks below the highest one seen whose files are both absent."""
    seen = set(stacks) | set(beats)
    absent = [r for r in range(max(seen) + 1) if r not in seen] if seen else []
    return [f"rank {r}: no rank{r}.txt or rank{r}.jsonl (never written, or lost)." for r in absent]


def _read_stacks(directory: Path) -> tuple[dict[int, str], list[str]]:
    stacks: dict[int, str] = {}
    notes: list[str] = []
    for path in sorted(directory.glob("rank*.txt")):
        match = _RANK_FILE.match(path.name)
        if not match:
            continue
        try:
            stacks[int(match.group(1))] = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            notes.append(f"rank {match.group(1)}: {path.name} could not be read ({exc.strerror}).")
    return stacks, notes


#: ``rankguard report --help``: what it does, with examples.
REPORT_HELP = "merge a HangWatchdog report's stacks and draw its timeline"
REPORT_DESCRIPTION = """\
Reads what a HangWatchdog wrote when it found a hang: rank<N>.txt (each rank's
Python stacks), rank<N>.jsonl (each rank's last heartbeats) and summary.txt (the
verdict). Prints the verdict and the training loop's stack once per group of
ranks that stopped in the same place, and writes two files into DIR:

  merged.txt     the verdict, then every rank's stacks, identical ones grouped
  timeline.png   per rank, its phases over the recorded history and where its
                 progress stopped; the rank that stopped first and its deadline
                 (needs matplotlib: pip install 'rankguard[report]')

A rank's file cut mid-line (the rank was killed while writing) or missing is
named under "Incomplete report:"; the rest is read and the verdict given.

Exit code 0, or 2 when DIR holds no rank<N>.txt or rank<N>.jsonl file."""
REPORT_EPILOG = """\
examples:
  rankguard report ./rankguard_reports
  rankguard report out/examples/rankguard_reports   # after the post_eval_hang example"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Configures ``parser`` as ``rankguard report``: its help texts and its one argument."""
    parser.description = REPORT_DESCRIPTION
    parser.epilog = REPORT_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "directory",
        metavar="DIR",
        type=Path,
        help="a HangWatchdog report_dir (default ./rankguard_reports), or any folder with its "
        "rank<N>.txt / rank<N>.jsonl / summary.txt files",
    )
    return parser


def _report_folders(directory: Path) -> list[Path]:
    """Folders under ``directory`` that hold report files (e.g. one per restart)."""
    found = {p.parent for p in directory.rglob("rank*.txt") if _RANK_FILE.match(p.name)}
    return sorted(found)


def _collectives(directory: Path) -> str:
    """What the ranks' record files say, or ``""``.

    Their last collectives and the first difference, and which ranks died of a
    fatal signal (their ``rank{N}.fault.txt``).
    """
    from rankguard.callbacks.hang.collective_compare import describe_records
    from rankguard.callbacks.hang.collective_files import FAULT_SUFFIX, read_files

    if not directory.is_dir():
        return ""
    records = read_files(directory)
    text = describe_records(records) if records else ""
    for path in sorted(directory.glob(f"rank*{FAULT_SUFFIX}")):
        try:
            fault = path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue
        if fault:
            first = fault.splitlines()[0]
            text += f"{path.name[: -len(FAULT_SUFFIX)]} died of a fatal signal ({first}); "
            text += f"every thread's stack: {path.name}\n"
    return text + "\n" if text else ""


def run(args: argparse.Namespace) -> int:
    """Runs ``rankguard report`` with parsed arguments; returns the exit code."""
    directory: Path = args.directory
    stacks, notes = _read_stacks(directory)
    records, cut = _read_heartbeats(directory)
    beats = {rank: rows for rank, rows in records.items() if rows}
    notes += cut + _missing_ranks(stacks, records)
    collectives = _collectives(directory)
    if not stacks and not beats and not collectives:
        sys.stderr.write(f"rankguard report: no rank<N>.txt or rank<N>.jsonl file in {directory}\n")
        folders = _report_folders(directory) if directory.is_dir() else []
        if folders:
            listed = "".join(f"  {folder}\n" for folder in folders)
            sys.stderr.write(f"Reports in its subfolders; pass one of them:\n{listed}")
        return 2
    summary = directory / SUMMARY_FILE
    try:
        head = summary.read_text(encoding="utf-8") + "\n" if summary.exists() else ""
    except OSError as exc:
        head = ""
        notes.append(f"{SUMMARY_FILE} could not be read ({exc.strerror}).")
    if notes:
        head += "Incomplete report:\n" + "".join(f"  {note}\n" for note in notes) + "\n"
    head += collectives
    if stacks:
        unmarked = "  (training loop not marked: see the rank file)"
        loops = {rank: loop_stack(text) or unmarked for rank, text in stacks.items()}
        sys.stdout.write(head + "Training loop stacks, ranks grouped where identical:\n")
        for ranks, frames in group_ranks(loops):
            sys.stdout.write(f"== {rank_label(ranks)} ==\n{frames}\n")
        (directory / MERGED_FILE).write_text(head + merge_stacks(stacks), encoding="utf-8")
        sys.stdout.write(f"wrote {directory / MERGED_FILE}\n")
    else:
        sys.stdout.write(head)
    if beats:
        from rankguard.callbacks.hang.timeline import plot_timeline

        plot_timeline(beats, directory / TIMELINE_FILE)
        sys.stdout.write(f"wrote {directory / TIMELINE_FILE}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``rankguard report DIR`` on its own (``rankguard`` itself dispatches to :func:`run`).

    Args:
        argv: Command-line arguments after ``rankguard report``.

    Returns:
        The process exit code: 0 on success, 2 when ``DIR`` holds no rank files.
    """
    parser = add_arguments(argparse.ArgumentParser(prog="rankguard report"))
    return run(parser.parse_args(argv))
