"""Hang report files: what the HangWatchdog writes on an incident, and ``rankguard report DIR``.

Files in the report directory (default ``./rankguard_reports``):

================  ===========  ==========================================================
file              written by   content
================  ===========  ==========================================================
``summary.txt``   rank 0 [1]_  the verdict: stuck ranks, what the others wait in, the fix
``rank{N}.txt``   rank N       header (rank, host, pid, phase) + every thread's Python stack,
                               the training loop's marked ``[training loop]``
``rank{N}.jsonl`` rank N       the last heartbeats, one JSON object a line (``t``: Unix
                               time, ``event``, ``phase``, ``step``)
``merged.txt``    the CLI      the summary, then ranks grouped by identical stacks
``timeline.png``  the CLI      per-rank phases over time (needs the ``report`` extra)
================  ===========  ==========================================================

.. [1] or the lowest rank that still answers when rank 0 is frozen or dead.

Stacks come from :func:`faulthandler.dump_traceback`: function names, files
and lines only, never variable values or the environment.

``rankguard report DIR`` prints the summary and the training loop's stack
per group of ranks where it is identical (the ranks that stopped in the same
place), and writes ``merged.txt`` and ``timeline.png``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from rankguard.callbacks.ranks import group_ranks, rank_label

__all__ = [
    "LOOP_MARK",
    "loop_stack",
    "main",
    "merge_stacks",
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
) -> None:
    """Writes one rank's part of an incident report.

    Args:
        directory: The report directory (created if needed).
        rank: This rank.
        header: First line of ``rank{rank}.txt``: rank, host, pid, phase.
        beats: Recent heartbeats for ``rank{rank}.jsonl``.
        summary: The verdict for ``summary.txt``, on the one rank that writes it.
        loop_thread: Ident of the training loop's thread, marked in the stacks.
    """
    write_stacks(directory, rank, header, loop_thread)
    write_heartbeats(directory, rank, beats)
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


def _read_heartbeats(directory: Path) -> dict[int, list[dict]]:
    beats: dict[int, list[dict]] = {}
    for path in directory.glob("rank*.jsonl"):
        match = re.match(r"^rank(\d+)\.jsonl$", path.name)
        if match:
            lines = path.read_text(encoding="utf-8").splitlines()
            beats[int(match.group(1))] = [json.loads(line) for line in lines if line.strip()]
    return beats


def plot_timeline(beats: dict[int, list[dict]], path: Path) -> Path:
    """Draws each rank's phases over time (one row per rank) to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "The timeline needs matplotlib: pip install 'rankguard[report]'."
        ) from exc
    start = min(b["t"] for rows in beats.values() for b in rows)
    end = max(b["t"] for rows in beats.values() for b in rows)
    colors = {"train": "tab:blue", "eval": "tab:green", "checkpoint": "tab:orange"}
    fig, ax = plt.subplots(figsize=(10, 1 + 0.4 * len(beats)))
    for row, rank in enumerate(sorted(beats)):
        rows = beats[rank]
        for beat, nxt in zip(rows, [*rows[1:], None], strict=True):
            stop = nxt["t"] if nxt else end
            kind = next((k for k in colors if k in beat["event"]), "other")
            color = colors.get(kind, "tab:gray")
            ax.barh(row, max(stop - beat["t"], 1e-3), left=beat["t"] - start, color=color)
        ax.text(end - start, row, f" {rows[-1]['phase']}", va="center", fontsize=8)
    ax.set_yticks(range(len(beats)), [f"rank {r}" for r in sorted(beats)])
    ax.set_xlabel("seconds since the first recorded heartbeat")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``rankguard report DIR``: merges per-rank stacks and draws the heartbeat timeline.

    Args:
        argv: Command-line arguments after the program name.

    Returns:
        The process exit code: 0 on success, 2 when ``DIR`` holds no rank files.
    """
    parser = argparse.ArgumentParser(prog="rankguard report", description=main.__doc__)
    parser.add_argument("directory", type=Path, help="a HangWatchdog report directory")
    args = parser.parse_args(argv)
    directory: Path = args.directory
    stacks = {
        int(m.group(1)): p.read_text(encoding="utf-8")
        for p in sorted(directory.glob("rank*.txt"))
        if (m := _RANK_FILE.match(p.name))
    }
    if not stacks:
        sys.stderr.write(f"rankguard report: no rank*.txt files in {directory}\n")
        return 2
    summary = directory / SUMMARY_FILE
    head = summary.read_text(encoding="utf-8") + "\n" if summary.exists() else ""
    unmarked = "  (training loop not marked: see the rank file)"
    loops = {rank: loop_stack(text) or unmarked for rank, text in stacks.items()}
    sys.stdout.write(head + "Training loop stacks, ranks grouped where identical:\n")
    for ranks, frames in group_ranks(loops):
        sys.stdout.write(f"== {rank_label(ranks)} ==\n{frames}\n")
    (directory / MERGED_FILE).write_text(head + merge_stacks(stacks), encoding="utf-8")
    sys.stdout.write(f"wrote {directory / MERGED_FILE}\n")
    beats = {rank: rows for rank, rows in _read_heartbeats(directory).items() if rows}
    if beats:
        plot_timeline(beats, directory / TIMELINE_FILE)
        sys.stdout.write(f"wrote {directory / TIMELINE_FILE}\n")
    return 0
