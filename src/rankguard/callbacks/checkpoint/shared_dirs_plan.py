"""The decisions of :func:`~rankguard.callbacks.checkpoint.shared_dir_barrier.ensure_shared_dirs`.

:class:`BarrierPlanner`'s methods are the ``decide`` functions of the
barrier's side-channel exchanges. They run on the deciding rank only, which
keeps what every rank reported at the first exchange (paths, nodes,
filesystems) to word later verdicts, so other ranks receive only a small
:class:`Verdict`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from rankguard.callbacks.checkpoint.dir_probe import PathState, name_below
from rankguard.callbacks.checkpoint.dir_view import ABSENT, BLOCKED, VISIBLE
from rankguard.callbacks.checkpoint.late_dirs import late_warning
from rankguard.callbacks.core.nodes import NodeId
from rankguard.callbacks.core.ranks import format_groups, group_ranks, rank_label

__all__ = [
    "FIX_CREATE",
    "FIX_TIMEOUT",
    "BarrierPlanner",
    "Verdict",
    "describe_nodes",
    "load_path_problem",
]

FIX_TIMEOUT = (
    "Fix: if the filesystem is shared but shows new directories late (NFS attribute and "
    "lookup caches), raise `timeout_s` or mount it with `lookupcache=positive` or a small "
    "`actimeo` (e.g. actimeo=1); if a rank is just late, raise `timeout_s`; or save to a "
    "node-local directory (each node then gets its own) and upload from there."
)
FIX_CREATE = (
    "Fix: remove or rename what is in the way, give the job write permission on the parent, "
    "or choose another checkpoint directory."
)


@dataclass(frozen=True)
class Verdict:
    """What every rank learns from one exchange of the barrier.

    Attributes:
        error: A message to raise on every rank, or ``None``.
        timeout: Whether ``error`` is a timeout (else a creation failure).
        pending: Path indices some rank does not see yet (look).
        probe: Path indices to probe with a marker: the pending ones and, in a
            multi-node job asked to, every other one (look).
        creators: Per probed path, the ranks that create it, each its own path (seen).
        shared: Per probed path, whether every node shares it (seen).
        node_local: Per probed path whose folder some nodes do not share with
            rank 0 although their ranks name it, which nodes and ranks those are
            and what they see, for messages (seen).
        max_waited_s: The longest any rank polled (visible).
        summary: One line per path for the log (seen, visible).
        late: A warning for a folder some rank saw ``warn_late_s`` or more after the
            first did, or ``""`` (visible).
    """

    error: str | None = None
    timeout: bool = False
    pending: list[int] = field(default_factory=list)
    probe: list[int] = field(default_factory=list)
    creators: dict[int, list[int]] = field(default_factory=dict)
    shared: dict[int, bool | None] = field(default_factory=dict)
    node_local: dict[int, str] = field(default_factory=dict)
    max_waited_s: float = 0.0
    summary: str = ""
    late: str = ""


class BarrierPlanner:
    """The deciding rank's side of one barrier.

    Args:
        timeout_s: The barrier's polling timeout, quoted in errors.
        probe_existing: Also probe paths every rank already sees, when the
            ranks run on more than one node (one node shares every path).
        warn_late_s: A folder some rank sees this much later than the first rank is
            worth a warning (:attr:`Verdict.late`).
    """

    def __init__(
        self, timeout_s: float, probe_existing: bool = False, warn_late_s: float = math.inf
    ) -> None:
        self.timeout_s = timeout_s
        self.probe_existing = probe_existing
        self.warn_late_s = warn_late_s
        self.nodes: dict[int, NodeId] = {}
        self.states: dict[int, list[PathState]] = {}
        #: Per path index, the rank that creates each rank's folder.
        self.made_by: dict[int, dict[int, int]] = {}
        self.described: dict[int, str] = {}

    def _where(self, i: int, ranks: list[int] | None = None, most: int = 4) -> str:
        """Path ``i`` as ``ranks`` name it: one path, or per rank (``most`` shown, then a count)."""
        ranks = sorted(self.states) if ranks is None else ranks
        paths = {r: self.states[r][i].path for r in ranks}
        groups = group_ranks(paths)
        if len(groups) == 1:
            return groups[0][1]
        shown = "; ".join(f"{rank_label(rs)}: {path}" for rs, path in groups[:most])
        rest = len(groups) - most
        return shown if rest <= 0 else f"{shown}; and {rest} more paths"

    def _hosts(self, ranks: list[int]) -> str:
        return ", ".join(sorted({self.nodes[r].key for r in ranks}))

    def look(self, per_rank: Mapping[int, tuple[NodeId, list[PathState]]]) -> Verdict:
        """Finds blocked paths and the paths some rank does not see yet."""
        self.nodes = {r: node for r, (node, _) in per_rank.items()}
        self.states = {r: states for r, (_, states) in per_rank.items()}
        counts = {r: len(states) for r, states in self.states.items()}
        if len(set(counts.values())) > 1:
            described = format_groups(counts, lambda n: f"{n} directories")
            return Verdict(error=f"Ranks pass different directories to the barrier: {described}.")
        problems = []
        for i in range(next(iter(counts.values()))):
            blocked = sorted(r for r, s in self.states.items() if s[i].state == BLOCKED)
            if blocked:
                at = format_groups({r: self.states[r][i].existing for r in blocked})
                problems.append(
                    f"Cannot create directory {self._where(i, blocked)}: something that is not "
                    f"a directory is in the way for {rank_label(blocked)} "
                    f"({self._hosts(blocked)}): {at}."
                )
        if problems:
            return Verdict(error=f"{' '.join(problems)} {FIX_CREATE}")
        n_paths = next(iter(counts.values()))
        pending = [
            i for i in range(n_paths) if any(s[i].state != VISIBLE for s in self.states.values())
        ]
        several_nodes = len({node.key for node in self.nodes.values()}) > 1
        probe = list(range(n_paths)) if self.probe_existing and several_nodes else pending
        return Verdict(pending=pending, probe=probe)

    def awaited(self, per_rank: Mapping[int, tuple[NodeId, list[PathState]]]) -> Verdict:
        """:meth:`look` for folders the framework creates itself: nothing is probed or created.

        A path some rank does not see yet is waited for; the lowest rank that
        sees it is named as its creator (the framework's rank 0 made it).
        """
        verdict = self.look(per_rank)
        for i in verdict.pending:
            seeing = [r for r in sorted(self.states) if self.states[r][i].state == VISIBLE]
            late = sorted(set(self.states) - set(seeing))
            self.made_by[i] = dict.fromkeys(self.states, seeing[0]) if seeing else {}
            fs = format_groups({r: s[i].fs for r, s in self.states.items()})
            made = f"made by {rank_label(seeing[:1])}" if seeing else "seen by no rank"
            self.described[i] = (
                f"{self._where(i)}: {made}, not seen at first by {rank_label(late)}; "
                f"filesystem {fs}"
            )
        return replace(verdict, probe=[])

    def folders(self, i: int, seen: Mapping[int, bool], levels: int | None) -> dict[int, tuple]:
        """Which ranks name the same directory at path ``i``: a key per rank, equal for those.

        Ranks that saw rank 0's marker (``levels`` above their path) share the
        marker's directory, so they name one folder when the path below it
        (:func:`~rankguard.callbacks.checkpoint.dir_probe.name_below`) is the same:
        ``ckpt/rank0`` and ``ckpt/rank1`` are two folders, one name seen from
        two nodes' mounts one folder. Other ranks name one folder when they
        are on the same node with the same path.
        """
        keys: dict[int, tuple] = {}
        places: dict[tuple[str, str], tuple] = {}
        for rank in sorted(self.nodes):
            if seen[rank] and levels is not None:
                path = self.states[rank][i].path
                keys[rank] = ("shared", name_below(path, levels))
                places.setdefault((self.nodes[rank].key, path), keys[rank])
        for rank in sorted(self.nodes):
            if rank not in keys:
                place = (self.nodes[rank].key, self.states[rank][i].path)
                keys[rank] = places.get(place, ("node", *place))
        return keys

    def creators_of(self, keys: Mapping[int, tuple], missing: Mapping[int, bool]) -> dict[int, int]:
        """Who creates each missing folder, per rank that names it.

        A folder on rank 0's filesystem is created by the lowest rank that
        names it (rank 0 for its own); a folder on a node that does not share
        it, by that node's lowest local rank that names it.
        """
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(keys):
            groups.setdefault(keys[rank], []).append(rank)
        node = self.nodes
        made_by: dict[int, int] = {}
        for key, ranks in groups.items():
            if not any(missing[r] for r in ranks):
                continue
            if key[0] == "shared":
                creator = ranks[0]
            else:
                creator = min(
                    ranks, key=lambda r: (node[r].local_rank is None, node[r].local_rank or 0, r)
                )
            made_by.update(dict.fromkeys(ranks, creator))
        return made_by

    def creators(
        self, per_rank: Mapping[int, dict[int, bool]], levels: Mapping[int, int | None]
    ) -> Verdict:
        """Decides, per probed path, whether it is shared and who creates it (if missing).

        Args:
            per_rank: Each rank's view of rank 0's markers: per probed path, whether it
                saw it. Whether the path is absent there comes from :meth:`look`.
            levels: Per probed path, how far above rank 0's path its marker is
                (``None``: no marker).
        """
        verdict = Verdict(creators={}, shared={}, node_local={})
        by_node: dict[str, list[int]] = {}
        for rank in sorted(self.nodes):
            by_node.setdefault(self.nodes[rank].key, []).append(rank)
        for i in next(iter(per_rank.values())):
            seen = {r: p[i] for r, p in per_rank.items()}
            missing = {r: self.states[r][i].state == ABSENT for r in per_rank}
            keys = self.folders(i, seen, levels.get(i))
            self.made_by[i] = self.creators_of(keys, missing)
            creators = sorted(set(self.made_by[i].values()))
            sharing = {self.nodes[r].key for r, s in seen.items() if s}
            shared = None if not sharing else len(sharing) == len(by_node)
            local_nodes = sorted(set(by_node) - sharing)
            verdict.creators[i], verdict.shared[i] = creators, shared
            fs = format_groups({r: s[i].fs for r, s in self.states.items()})
            kind = {
                True: f"shared by all {len(by_node)} node(s)",
                False: f"not shared with rank 0 by {', '.join(local_nodes)} (node-local)",
                None: "sharing unknown (rank 0 could not write a marker)",
            }[shared]
            n_folders = len(set(keys.values()))
            if n_folders > 1:
                kind += f"; {n_folders} different folders (ranks name their own)"
            if not any(missing.values()):
                made = "there already"
            else:
                made = f"created by {rank_label(creators)}" if creators else "created by none"
            self.described[i] = f"{self._where(i)}: {kind}; {made}; filesystem {fs}"
            if shared is False:
                problem = self.node_local(i, local_nodes, levels.get(i), fs)
                if problem:
                    verdict.node_local[i] = problem
        return replace(verdict, summary="; ".join(self.described.values()))

    def node_local(self, i: int, local_nodes: list[str], levels: int | None, fs: str) -> str:
        """Names the ranks on ``local_nodes`` that name rank 0's folder and do not see it.

        Ranks that name folders of their own (``ckpt/rank3``) are not meant to
        see rank 0's: only the same name below the marker counts.
        """
        if levels is None:
            return ""
        leader = min(self.nodes)
        own = name_below(self.states[leader][i].path, levels)
        outside = [
            r
            for r in sorted(self.nodes)
            if self.nodes[r].key in local_nodes
            and name_below(self.states[r][i].path, levels) == own
        ]
        if not outside:
            return ""
        n_nodes = len({self.nodes[r].key for r in outside})
        return (
            f"{describe_nodes({r: n.key for r, n in self.nodes.items()}, outside)} "
            f"{'does' if n_nodes == 1 else 'do'} not see what rank {leader} "
            f"({self.nodes[leader].key}) writes there (filesystem {fs})"
        )

    def created(self, per_rank: Mapping[int, dict[int, str]]) -> Verdict:
        """Turns creation failures on any rank into one error for every rank."""
        problems = [
            f"Could not create directory {self.states[r][i].path} on rank {r} "
            f"({self.nodes[r].key}): {error}."
            for r, errors in sorted(per_rank.items())
            for i, error in sorted(errors.items())
        ]
        return Verdict(error=f"{' '.join(problems)} {FIX_CREATE}" if problems else None)

    def visible(self, per_rank: Mapping[int, dict[int, float | None]]) -> Verdict:
        """Names the ranks that never saw a path; else releases everyone together."""
        waits = [w for waited in per_rank.values() for w in waited.values() if w is not None]
        longest = max(waits, default=0.0)
        problems = []
        for i in sorted(next(iter(per_rank.values()))):
            late = sorted(r for r, waited in per_rank.items() if waited[i] is None)
            if not late:
                continue
            fine = sorted(set(per_rank) - set(late))
            fs = format_groups({r: self.states[r][i].fs for r in late})
            made_by = self.made_by.get(i, {})
            creators = sorted({made_by[r] for r in late if r in made_by})
            made = rank_label(creators) if creators else "nobody"
            problems.append(
                f"Directory {self._where(i, late)} (created by {made} on "
                f"{self._hosts(creators) or 'no node'}) was not visible to "
                f"{rank_label(late)} ({self._hosts(late)}) after they waited {self.timeout_s:g} s "
                f"(`timeout_s`); {rank_label(fine) if fine else 'no rank'} "
                f"{'sees' if len(fine) == 1 else 'see'} it. Filesystem: {fs}."
            )
        if problems:
            return Verdict(error=f"{' '.join(problems)} {FIX_TIMEOUT}", timeout=True)
        lines = "; ".join(self.described.values())
        return Verdict(
            max_waited_s=longest,
            summary=f"{lines}; every rank saw it within {longest:.2f} s",
            late=self._late(per_rank),
        )

    def _late(self, per_rank: Mapping[int, dict[int, float | None]]) -> str:
        """The warning for the path seen latest, if some rank saw it ``warn_late_s`` late."""
        late: dict[int, dict[int, float]] = {}
        for i in next(iter(per_rank.values())):
            seen = {r: waited[i] or 0.0 for r, waited in per_rank.items()}
            first = min(seen.values())
            lags = {r: w - first for r, w in seen.items() if w - first >= self.warn_late_s}
            if lags:
                late[i] = lags
        if not late:
            return ""
        i = max(late, key=lambda i: max(late[i].values()))
        lags = late[i]
        hosts = {r: self.nodes[r].key for r in lags}
        filesystems = {r: (self.states[r][i].fs, self.states[r][i].mount) for r in lags}
        return late_warning(self._where(i, sorted(lags)), lags, hosts, filesystems, self.timeout_s)


def describe_nodes(node_of: Mapping[int, str], ranks: list[int], most: int = 4) -> str:
    """Names the nodes of ``ranks`` with their ranks, e.g. ``"node gpu-3 (ranks 8-15)"``.

    Args:
        node_of: Each rank's node name.
        ranks: The ranks to describe.
        most: Nodes named one by one; the rest are summed up.
    """
    by_node: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        by_node.setdefault(node_of[rank], []).append(rank)
    keys = sorted(by_node, key=lambda k: by_node[k][0])
    shown = [f"{k} ({rank_label(by_node[k])})" for k in keys[:most]]
    if len(keys) > most:
        rest = [r for k in keys[most:] for r in by_node[k]]
        shown.append(f"{len(keys) - most} more ({rank_label(rest)})")
    return f"{'node' if len(keys) == 1 else 'nodes'} {', '.join(shown)}"


def load_path_problem(per_rank: Mapping[int, tuple[NodeId, str, bool]]) -> str:
    """Names the ranks that cannot see a checkpoint to resume from that others see.

    Args:
        per_rank: Each rank's node, absolute path and whether the path exists there.

    Returns:
        The problem, or ``""`` when every rank sees the checkpoint, or none does
        (the framework then fails on every rank with its own error).
    """
    missing = sorted(r for r, (_, _, seen) in per_rank.items() if not seen)
    if not missing or len(missing) == len(per_rank):
        return ""
    present = sorted(set(per_rank) - set(missing))
    node_of = {r: node.key for r, (node, _, _) in per_rank.items()}
    paths = {r: path for r, (_, path, _) in per_rank.items()}
    where = paths[present[0]] if len(set(paths.values())) == 1 else format_groups(paths)
    return (
        f"Checkpoint to resume from {where} is not there on "
        f"{describe_nodes(node_of, missing)}; {describe_nodes(node_of, present)} "
        f"{'sees' if len(present) == 1 else 'see'} it."
    )
