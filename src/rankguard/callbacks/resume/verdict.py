"""The resume check's decision, from every rank's :class:`RankResume` (pure).

Four questions, asked in order; the first that finds a difference is the
error, because it explains the ones after it:

1. Did every rank load the same checkpoint (by name and identity), or did some
   find none? Where not, what each node sees in the folder "latest" was looked up
   in names a node-local or lagging copy.
2. Do the counters after the load match (steps, epochs, batches to skip)?
3. Is each data position as alike across ranks as it was when the checkpoint
   was saved? A position that differed per rank at the save and is the same on
   every rank now is one rank's position restored everywhere; one that matched
   and now differs was restored from different states.
4. Is each random generator as alike across ranks as expected: as at the save
   where the framework restores random states, else as at this fit's start? A
   warning: the run can still be right.

Patterns, not values, are compared for 3 and 4: a job that seeds or shards
per rank on purpose shows the same pattern at the save and at the resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rankguard.callbacks.core.ranks import format_groups, group_ranks, rank_label

__all__ = ["Partition", "RankResume", "ResumeVerdict", "judge", "partition"]

#: Ranks grouped by equal value, each group sorted, groups by lowest rank.
Partition = list[list[int]]


@dataclass(frozen=True)
class RankResume:
    """What one rank sends to the resume check.

    Attributes:
        node: The rank's node (``NodeId.key``).
        asked: How the job asked for the resume, in the framework's words.
        checkpoint: The checkpoint loaded, as resolved on this rank; ``None``: none found.
        identity: A cheap identity of it (a size), ``None`` if unknown.
        folder: Where the checkpoint was looked up.
        seen: The checkpoints this rank sees in ``folder``.
        counters: The framework's counters after the load.
        positions: Per data position, its digest now.
        position_text: Per data position, its value in a message.
        rng: Per generator, its digest now.
        rng_start: Per generator, its digest at this fit's start.
        saved: Per data position (``"data/<name>"``) and generator (``"rng/<name>"``),
            each rank's digest at the save, as the checkpoint's guard state holds it;
            empty where the checkpoint holds none, and from every rank but the deciding
            one (the decision reads the lowest rank's).
        restores_rng: Whether the framework restores each rank's random state.
        fix: How to resume every rank from one checkpoint in this framework.
        data_fix: How to keep each rank's own data position in this framework.
    """

    node: str
    asked: str
    checkpoint: str | None
    identity: str | None = None
    folder: str | None = None
    seen: tuple[str, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    positions: dict[str, str] = field(default_factory=dict)
    position_text: dict[str, str] = field(default_factory=dict)
    rng: dict[str, str] = field(default_factory=dict)
    rng_start: dict[str, str] = field(default_factory=dict)
    saved: dict[str, list[str]] = field(default_factory=dict)
    restores_rng: bool = False
    fix: str | None = None
    data_fix: str | None = None

    @property
    def name(self) -> str | None:
        """The checkpoint's name, which copies on other nodes share: its path in ``folder``."""
        if self.checkpoint is None:
            return None
        path = self.checkpoint.rstrip("/")
        folder = (self.folder or "").rstrip("/")
        if folder and path.startswith(folder + "/"):
            return path[len(folder) + 1 :]
        return path.rsplit("/", 1)[-1] or self.checkpoint


@dataclass(frozen=True)
class ResumeVerdict:
    """What the resume check found: at most one error, and warnings."""

    error: str | None = None
    warnings: tuple[str, ...] = ()


def partition(values: Mapping[int, object]) -> Partition:
    """Groups the ranks by equal value (each group sorted, groups by lowest rank)."""
    return sorted((ranks for ranks, _ in group_ranks(values)), key=lambda g: g[0])


def _pattern(groups: Partition) -> str:
    if len(groups) == 1:
        return "the same on every rank"
    if all(len(g) == 1 for g in groups):
        return "different on every rank"
    return "; ".join(rank_label(g) for g in groups) + " alike"


def judge(per_rank: Mapping[int, RankResume]) -> ResumeVerdict:
    """The resume check's verdict (see the module's docstring)."""
    error = _checkpoints(per_rank) or _counters(per_rank) or _positions(per_rank)
    return ResumeVerdict(error, tuple(_rng(per_rank)) if error is None else ())


def _counters_text(counters: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counters.items()) or "no counters"


def _checkpoints(per_rank: Mapping[int, RankResume]) -> str | None:
    first = per_rank[min(per_rank)]
    loaded = {r: (p.name, p.identity) for r, p in per_rank.items()}
    folders = _folders(per_rank)
    if len(set(loaded.values())) == 1:
        # One name and size (checkpoints of the same shapes), other counters, nodes that see
        # different checkpoints beside it: copies of one name from different saves.
        counters = {tuple(sorted(p.counters.items())) for p in per_rank.values()}
        if first.name is None or len(counters) == 1 or not folders:
            return None
    names = {r: p.name for r, p in per_rank.items()}

    def what(name: str | None) -> str:
        if name is None:
            return "no checkpoint (starts fresh)"
        counters = next(p.counters for p in per_rank.values() if p.name == name)
        return f"{name} ({_counters_text(counters)})"

    if None in names.values():
        lead = "Some ranks found no checkpoint to resume from while others did."
    elif len(set(names.values())) == 1:
        lead = f"Ranks resumed from different copies of {first.name}."
    else:
        lead = "Ranks resumed from different checkpoints."
    steps = len({tuple(sorted(p.counters.items())) for p in per_rank.values()}) > 1
    if len(set(names.values())) > 1:
        loads = format_groups(names, what)
    else:
        loads = format_groups(_copies(per_rank), str)
    lines = [lead, f"Loaded ({first.asked}): {loads}."]
    lines += folders
    lines.append(
        "Training on, the ranks would update different weights "
        + (
            "from different steps"
            if steps or len(set(names.values())) > 1
            else "(the copies differ)"
        )
        + ", silently, until they wait for each other at the end of the run or the next save."
    )
    lines.append(
        "Fix: "
        + (
            first.fix
            or "resume every rank from the same checkpoint: a path on storage every node "
            "mounts, or copy the newest checkpoint to every node before the restart"
        )
        + "."
    )
    return "\n".join(lines)


def _copies(per_rank: Mapping[int, RankResume]) -> dict[int, str]:
    """Per rank, its copy of one checkpoint name and every difference read between the copies.

    The counters that differ (steps first), then the identity (a size) where it differs:
    ``"last.ckpt (global_step 8, epoch 1; 13977 bytes)"``.
    """
    keys = sorted({k for p in per_rank.values() for k in p.counters}, key=lambda k: "step" not in k)
    differ = [k for k in keys if len({p.counters.get(k) for p in per_rank.values()}) > 1]
    sizes = len({p.identity for p in per_rank.values()}) > 1
    copies = {}
    for rank, p in per_rank.items():
        parts = [", ".join(f"{k} {p.counters.get(k, '?')}" for k in differ)] if differ else []
        if sizes:
            parts.append(p.identity or "size unknown")
        copies[rank] = f"{p.name} ({'; '.join(parts)})" if parts else str(p.name)
    return copies


def _folders(per_rank: Mapping[int, RankResume]) -> list[str]:
    """Per folder of the same name, what each node sees in it where nodes see differently."""
    by_node: dict[str, tuple[str | None, tuple[str, ...], list[int]]] = {}
    for rank in sorted(per_rank):
        p = per_rank[rank]
        folder, seen, ranks = by_node.setdefault(p.node, (p.folder, p.seen, []))
        ranks.append(rank)
    if len({seen for _, seen, _ in by_node.values()}) < 2:
        return []
    every = set.intersection(*(set(seen) for _, seen, _ in by_node.values()))
    anywhere = set().union(*(seen for _, seen, _ in by_node.values()))
    lines = []
    for node, (folder, seen, ranks) in by_node.items():
        only = [n for n in seen if n not in every]
        missing = sorted(anywhere - set(seen))
        parts = []
        if only:
            parts.append(f"{', '.join(only)} that not every node has")
        if missing:
            parts.append(f"not {', '.join(missing)}")
        detail = "; ".join(parts) or "every checkpoint the others see"
        lines.append(f"  node {node} ({rank_label(ranks)}) sees in {folder}: {detail}")
    return ["What each node sees (node-local or lagging storage):", *lines]


def _counters(per_rank: Mapping[int, RankResume]) -> str | None:
    counters = {r: tuple(sorted(p.counters.items())) for r, p in per_rank.items()}
    if len(set(counters.values())) == 1:
        return None
    first = per_rank[min(per_rank)]
    keys = sorted({k for p in per_rank.values() for k in p.counters})
    values = {k: {r: p.counters.get(k) for r, p in per_rank.items()} for k in keys}
    differ = [k for k in keys if len(set(values[k].values())) > 1]
    described = "; ".join(f"{k}: {format_groups(values[k], str, sep=', ')}" for k in differ)
    return "\n".join(
        [
            f"Ranks resumed from {first.name} at different points: {described}.",
            "Each rank would start its loop from its own counters: different batches, "
            "learning rates and save steps, until the ranks wait for each other.",
            "Fix: restore the counters from the checkpoint on every rank (not from a "
            "rank's own state).",
        ]
    )


def _positions(per_rank: Mapping[int, RankResume]) -> str | None:
    first = per_rank[min(per_rank)]
    world = len(per_rank)
    problems = []
    for name in sorted(first.positions):
        now = {r: p.positions.get(name) for r, p in per_rank.items()}
        saved_digests = first.saved.get(f"data/{name}")
        if saved_digests is None or len(saved_digests) != world:
            continue  # not saved with the checkpoint (or another world size): no pattern
        saved = partition(dict(enumerate(saved_digests)))
        groups = partition(now)
        if groups == saved:
            continue
        text = {r: per_rank[r].position_text.get(name, "?") for r in per_rank}
        if len(groups) == 1:
            whose = [r for r, d in enumerate(saved_digests) if d == now[min(now)]]
            origin = (
                f"{rank_label(whose)}'s saved position, restored on every rank"
                if whose and len(whose) < world
                else "one position on every rank"
            )
            problems.append(
                f"{name} is at the same position on every rank ({text[min(text)]}), but it was "
                f"{_pattern(saved)} when the checkpoint was saved: {origin}. Each rank would go "
                "on from that position instead of its own: batches repeated or skipped, silently."
            )
        else:
            problems.append(
                f"{name} was {_pattern(saved)} when the checkpoint was saved and is "
                f"{_pattern(groups)} now: {format_groups(text, str)}. The ranks would train on "
                "batches they were not meant to, silently."
            )
    if not problems:
        return None
    fix = first.data_fix or (
        "save each rank's own data position (one file or key per rank) and load each "
        "rank's own; a state written by one rank for all restores its position everywhere"
    )
    return "\n".join(
        ["Ranks did not resume their data where each left off.", *problems, f"Fix: {fix}."]
    )


def _rng(per_rank: Mapping[int, RankResume]) -> list[str]:
    first = per_rank[min(per_rank)]
    world = len(per_rank)
    warnings = []
    for gen in sorted(first.rng):
        now = partition({r: p.rng.get(gen) for r, p in per_rank.items()})
        saved_digests = first.saved.get(f"rng/{gen}")
        if first.restores_rng and saved_digests is not None and len(saved_digests) == world:
            expected = partition(dict(enumerate(saved_digests)))
            when = "when the checkpoint was saved"
        elif not first.restores_rng and all(gen in p.rng_start for p in per_rank.values()):
            start = {r: p.rng_start[gen] for r, p in per_rank.items()}
            expected, when = partition(start), "at this run's start"
        else:
            continue
        if now != expected:
            warnings.append(
                f"The {gen} random state was {_pattern(expected)} {when} and is "
                f"{_pattern(now)} after the resume: "
                + (
                    "one rank's state was restored on every rank (the same augmentations "
                    "and dropout on every rank)."
                    if len(now) == 1
                    else "ranks restored random states they did not save."
                )
                + " Fix: save each rank's own random state and restore it on that rank."
            )
    return warnings
