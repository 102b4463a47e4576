"""``rankguard report DIR``: the verdict, the ranks' stacks grouped, and the timeline.

Prints the summary and the training loop's stack once per group of ranks that
stopped in the same place; writes ``merged.txt`` and ``timeline.png`` into ``DIR``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.report import RANK_STACKS, SUMMARY_FILE
from rankguard.report.reader import (
    loop_stack,
    merge_stacks,
    missing_ranks,
    read_heartbeats,
    read_stacks,
)

__all__ = ["REPORT_HELP", "add_arguments", "main", "run"]

MERGED_FILE = "merged.txt"
TIMELINE_FILE = "timeline.png"

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
    found = {p.parent for p in directory.rglob("rank*.txt") if RANK_STACKS.match(p.name)}
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
    stacks, notes = read_stacks(directory)
    records, cut = read_heartbeats(directory)
    beats = {rank: rows for rank, rows in records.items() if rows}
    notes += cut + missing_ranks(stacks, records)
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
        from rankguard.report.timeline import plot_timeline

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
