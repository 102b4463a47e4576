"""The hang timeline: every rank's phases over its recorded history, where each stopped.

``rankguard report DIR`` draws ``timeline.png`` from the ``rank{N}.jsonl``
files a :class:`~rankguard.callbacks.hang.hang_watchdog.HangWatchdog` writes on an
incident: each rank's last heartbeats, then one ``"report"`` record with what
the rank knew when it reported (its phase, how long it had been idle, its
deadline, the ``torch.distributed`` call it was blocked in, if any).

:func:`build_timeline` turns those records into a :class:`Timeline` (pure,
tested with plain values); :func:`plot_timeline` draws exactly that and
returns it, so a test can check what the picture shows: one row per rank with
its phases, a marker where its progress stopped, the rank that stopped first,
and the deadline that rank passed.

Times come from each rank's own clock (Unix time): across hosts they are as
close as the hosts' clocks.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rankguard.callbacks.core.events import Event
from rankguard.callbacks.hang.report import REPORT_EVENT

__all__ = [
    "PHASE_COLORS",
    "RankRow",
    "Span",
    "Timeline",
    "build_timeline",
    "plot_timeline",
    "row_label",
    "title",
]

#: Rows drawn at most; stuck ranks first, then the others by rank.
MAX_ROWS = 32

#: Phase drawn for the time after each heartbeat event (until the next one).
_PHASE_AFTER = {
    Event.FIT_START: "startup",
    Event.EPOCH_START: "train",
    Event.DATA_FETCH_START: "data fetch",
    Event.DATA_FETCH_END: "train",
    Event.TRAIN_BATCH_START: "train",
    Event.TRAIN_BATCH_END: "train",
    Event.EVAL_START: "eval",
    Event.EVAL_BATCH_START: "eval",
    Event.EVAL_BATCH_END: "eval",
    Event.EVAL_END: "after eval",
    Event.CHECKPOINT_SAVE_START: "checkpoint",
    Event.CHECKPOINT_SAVE_END: "train",
    Event.FIT_END: "fit ended",
}

#: Colour of each phase in the picture (and its legend).
PHASE_COLORS = {
    "startup": "#bdbdbd",
    "train": "#4c72b0",
    "data fetch": "#9ecae1",
    "eval": "#55a868",
    "after eval": "#c9b037",
    "checkpoint": "#dd8452",
    "fit ended": "#eeeeee",
}
_STUCK = "#c44e52"
_WAITING = "#8c8c8c"


@dataclass(frozen=True)
class Span:
    """One phase of one rank: ``[start, end)`` seconds on the timeline's axis."""

    start: float
    end: float
    phase: str


@dataclass
class RankRow:
    """One rank's row.

    Attributes:
        rank: The rank.
        spans: Its phases between heartbeats, oldest first, up to its last heartbeat.
        last_progress: Time of its last heartbeat (where its progress stopped).
        last_phase: Where that was, e.g. ``"after eval of 'eval'"``.
        reported_at: When it wrote its report (``None`` without a report record).
        deadline_s: The deadline of its phase when it reported, if known.
        ceiling_s: Its phase's ceiling (where the watchdog aborts), if known.
        blocked_in: The cross-rank call it was blocked in (it waited for another
            rank), or ``None`` (it was stuck on its own, or unknown).
    """

    rank: int
    spans: list[Span] = field(default_factory=list)
    last_progress: float = 0.0
    last_phase: str = ""
    reported_at: float | None = None
    deadline_s: float | None = None
    ceiling_s: float | None = None
    blocked_in: str | None = None

    @property
    def stalled(self) -> Span | None:
        """The time from its last heartbeat to its report: no progress."""
        if self.reported_at is None:
            return None
        return Span(self.last_progress, self.reported_at, "waiting" if self.blocked_in else "stuck")


@dataclass
class Timeline:
    """What the picture shows; times are seconds from ``origin`` (Unix time).

    Attributes:
        origin: Unix time of the axis' zero: the last progress of the rank that
            stopped first, else the earliest heartbeat.
        rows: One row per rank, by rank.
        first: The rank that stopped first: of the ranks not waiting for
            another, the one whose progress stopped earliest (``None`` if none).
        deadline: When ``first`` passed its deadline, or ``None`` if unknown.
        ceiling: When ``first`` reaches (or reached) its phase's ceiling, where it
            is later than the deadline (a calibrated deadline: the report came
            first, the abort at the ceiling); else ``None``.
        start: The earliest recorded heartbeat (left edge).
        end: The last report or heartbeat (right edge).
    """

    origin: float
    rows: dict[int, RankRow]
    first: int | None
    deadline: float | None
    start: float
    end: float
    ceiling: float | None = None

    @property
    def ceiling_drawn(self) -> bool:
        """Whether the ceiling is within the recorded time (it is drawn, else only named)."""
        return self.ceiling is not None and self.ceiling <= self.end

    def drawn_ranks(self) -> list[int]:
        """The ranks drawn, at most :data:`MAX_ROWS`: stuck ranks first, then by rank."""
        stuck = {
            r for r, row in self.rows.items() if row.reported_at is not None and not row.blocked_in
        }
        rest = [r for r in sorted(self.rows) if r not in stuck]
        return (sorted(stuck) + rest)[:MAX_ROWS]


def _phases(beats: list[dict]) -> list[str]:
    """The phase after each heartbeat: as :data:`_PHASE_AFTER`, startup until a step ended."""
    phases, trained = [], False
    for beat in beats:
        trained = trained or beat["event"] == Event.TRAIN_BATCH_END
        phase = _PHASE_AFTER.get(beat["event"], "train")
        phases.append("startup" if not trained and phase == "train" else phase)
    return phases


def build_timeline(records: Mapping[int, Iterable[dict]]) -> Timeline:
    """Builds the timeline from each rank's ``rank{N}.jsonl`` records.

    Args:
        records: Per rank, its heartbeats (``t``, ``event``, ``phase``) in
            order, optionally ending with a ``"report"`` record (``t``,
            ``deadline_s``, ``blocked_in``).

    Returns:
        The timeline; ranks without a heartbeat are left out.
    """
    raw: dict[int, tuple[list[dict], dict | None]] = {}
    for rank, rows in records.items():
        beats = [r for r in rows if r.get("event") != REPORT_EVENT]
        reports = [r for r in rows if r.get("event") == REPORT_EVENT]
        if beats:
            raw[rank] = (beats, reports[-1] if reports else None)
    if not raw:
        raise ValueError("no heartbeats to draw")
    last = {rank: beats[-1]["t"] for rank, (beats, _) in raw.items()}
    own = [r for r, (_, rep) in raw.items() if rep is not None and not rep.get("blocked_in")]
    candidates = own or [r for r, (_, rep) in raw.items() if rep is None]
    first = min(candidates, key=lambda r: (last[r], r)) if candidates else None
    origin = last[first] if first is not None else min(b[0]["t"] for b in raw.values())
    rows: dict[int, RankRow] = {}
    for rank, (beats, report) in sorted(raw.items()):
        times = [b["t"] - origin for b in beats]
        spans = [
            Span(start, end, phase)
            for start, end, phase in zip(times, times[1:], _phases(beats), strict=False)
            if end > start
        ]
        rows[rank] = RankRow(
            rank,
            spans,
            last_progress=times[-1],
            last_phase=beats[-1].get("phase", beats[-1]["event"]),
            reported_at=None if report is None else report["t"] - origin,
            deadline_s=None if report is None else report.get("deadline_s"),
            ceiling_s=None if report is None else report.get("ceiling_s"),
            blocked_in=None if report is None else report.get("blocked_in"),
        )
    deadline = ceiling = None
    if first is not None and rows[first].deadline_s is not None:
        deadline = rows[first].last_progress + rows[first].deadline_s
        ceiling_s = rows[first].ceiling_s
        if ceiling_s is not None and ceiling_s > rows[first].deadline_s:
            ceiling = rows[first].last_progress + ceiling_s
    ends = [max(row.last_progress, row.reported_at or 0.0) for row in rows.values()]
    start = min(row.spans[0].start if row.spans else row.last_progress for row in rows.values())
    end = max([*ends, deadline or 0.0])
    return Timeline(origin, rows, first, deadline, start, end, ceiling)


def row_label(row: RankRow, first: int | None) -> str:
    """A row's label: the rank, and where and how long it had made no progress."""
    stalled = row.stalled
    if stalled is None:
        what = f"last progress: {row.last_phase}"
    elif row.blocked_in:
        what = f"waiting {stalled.end - stalled.start:.1f} s in {row.last_phase}"
        what += f" (blocked in {row.blocked_in})"
    else:
        what = f"stuck {stalled.end - stalled.start:.1f} s in {row.last_phase}"
    head = f"rank {row.rank}" + (" - stopped first" if row.rank == first else "")
    return "\n".join([head, *textwrap.wrap(what, 40)])


def title(timeline: Timeline) -> str:
    """The picture's title: which rank stopped first and when it passed its deadline."""
    if timeline.first is None:
        text = "no rank is known to be stuck"
    else:
        row = timeline.rows[timeline.first]
        text = f"rank {timeline.first} stopped first, in {row.last_phase}"
        if row.deadline_s is not None:
            text += f"; its deadline ({row.deadline_s:g} s) passed at {timeline.deadline:.1f} s"
        if timeline.ceiling is not None and row.ceiling_s is not None:
            when = "reached" if timeline.ceiling_drawn else "due"
            text += f"; its ceiling ({row.ceiling_s:g} s, abort) {when} at {timeline.ceiling:.1f} s"
    hidden = len(timeline.rows) - len(timeline.drawn_ranks())
    return text + (f" ({hidden} more ranks not drawn: see merged.txt)" if hidden else "")


def plot_timeline(records: Mapping[int, Iterable[dict]], path: str | Path) -> Timeline:
    """Draws the timeline to a PNG and returns what it drew.

    Args:
        records: Per rank, its ``rank{N}.jsonl`` records (see :func:`build_timeline`).
        path: The PNG to write.

    Returns:
        The :class:`Timeline` the picture shows.

    Raises:
        ImportError: matplotlib is missing (the ``report`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "The timeline needs matplotlib: pip install 'rankguard[report]'."
        ) from exc
    timeline = build_timeline(records)
    ranks = timeline.drawn_ranks()
    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.55 * len(ranks)), layout="constrained")
    for y, rank in enumerate(ranks):
        row = timeline.rows[rank]
        for span in row.spans:
            ax.barh(y, span.end - span.start, left=span.start, color=PHASE_COLORS[span.phase])
        stalled = row.stalled
        if stalled is not None:
            color = _WAITING if row.blocked_in else _STUCK
            ax.barh(y, stalled.end - stalled.start, left=stalled.start, color="white",
                    edgecolor=color, hatch="///", linewidth=0)  # fmt: skip
        ax.plot(row.last_progress, y, marker="D", color="black", markersize=6)
    if timeline.deadline is not None:
        ax.axvline(timeline.deadline, color=_STUCK, linestyle="--", linewidth=1.5)
    if timeline.ceiling_drawn:
        ax.axvline(timeline.ceiling, color=_STUCK, linestyle=":", linewidth=1.5)
    labels = [row_label(timeline.rows[r], timeline.first) for r in ranks]
    ax.set_yticks(range(len(ranks)), labels, fontsize=8)
    ax.invert_yaxis()
    pad = 0.5 if timeline.end - timeline.start < 1e-3 else 0.0  # a single instant
    ax.set_xlim(timeline.start - pad, timeline.end + pad)
    ax.set_title(title(timeline), fontsize=10, loc="left")
    ax.set_xlabel(
        f"seconds from rank {timeline.first}'s last progress"
        if timeline.first is not None
        else "seconds from the first recorded heartbeat"
    )
    used = {s.phase for r in ranks for s in timeline.rows[r].spans}
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items() if p in used]
    handles += [
        Patch(facecolor="white", edgecolor=_STUCK, hatch="///", label="no progress (stuck)"),
        Patch(facecolor="white", edgecolor=_WAITING, hatch="///", label="waiting for a rank"),
        Line2D([], [], marker="D", color="black", linestyle="", label="last progress"),
        Line2D([], [], color=_STUCK, linestyle="--", label="deadline"),
    ]
    if timeline.ceiling_drawn:
        handles.append(Line2D([], [], color=_STUCK, linestyle=":", label="ceiling (abort)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=6, fontsize=8, frameon=False)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return timeline
