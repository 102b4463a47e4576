"""Reading a hang report folder: each rank's stacks and records, and what is missing.

A :class:`~rankguard.callbacks.hang.hang_watchdog.HangWatchdog` writes the files
(:mod:`rankguard.callbacks.hang.report`); a rank killed while writing leaves one cut
or absent, and what is left is still read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.report import LOOP_MARK, RANK_STACKS

__all__ = ["loop_stack", "merge_stacks", "missing_ranks", "read_heartbeats", "read_stacks"]


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


def read_heartbeats(directory: Path) -> tuple[dict[int, list[dict]], list[str]]:
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


def missing_ranks(stacks: dict[int, str], beats: dict[int, list[dict]]) -> list[str]:
    """Ranks below the highest one seen whose files are both absent."""
    seen = set(stacks) | set(beats)
    absent = [r for r in range(max(seen) + 1) if r not in seen] if seen else []
    return [f"rank {r}: no rank{r}.txt or rank{r}.jsonl (never written, or lost)." for r in absent]


def read_stacks(directory: Path) -> tuple[dict[int, str], list[str]]:
    """Each rank's ``rank{N}.txt``, and one note per file that could not be read."""
    stacks: dict[int, str] = {}
    notes: list[str] = []
    for path in sorted(directory.glob("rank*.txt")):
        match = RANK_STACKS.match(path.name)
        if not match:
            continue
        try:
            stacks[int(match.group(1))] = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            notes.append(f"rank {match.group(1)}: {path.name} could not be read ({exc.strerror}).")
    return stacks, notes
