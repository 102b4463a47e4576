"""The pure decision of the :class:`CheckpointPlanner`: will a save fit in host memory.

:func:`plan_save` turns what every rank reports (node, state size, memory
available) into a :class:`CheckpointPlan`: per node, the host memory a full
and a sharded save need against what is available, an action and a reason.
It runs on the side channel's deciding rank, so every rank gets the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rankguard.callbacks.core.ranks import format_ranks, rank_label

__all__ = [
    "MATERIALIZE",
    "MODES",
    "WRITER_OVERHEAD",
    "CheckpointPlan",
    "NodeBudget",
    "RankMemory",
    "format_bytes",
    "plan_save",
    "register_sharded_setting",
]

MODES = ("warn", "raise", "auto")
MATERIALIZE = ("rank0", "every_rank")

#: Peak host memory of serialising, as a multiple of the state bytes, on top of
#: the state itself; measured with ``benchmarks/checkpoint_memory.py`` (50M-500M
#: fp32 parameters + Adam, torch 2.7, both measured 0.000 and 1.000 at every
#: size): ``torch.save`` to a file writes each storage from its own memory;
#: through an ``io.BytesIO`` (Lightning's ``_atomic_save``) it grows a buffer
#: as large as the file, which ``getvalue()`` shares rather than copies.
WRITER_OVERHEAD: dict[str, float] = {"file": 0.0, "buffer": 1.0}

#: Per framework, its setting for sharded checkpoints, as its adapter registers it
#: (:func:`register_sharded_setting`): named in the fix when the job's adapter names none.
SHARDED_SETTINGS: dict[str, str] = {}
#: Named in the fix when the job's adapter names no setting and none is registered.
ANY_SHARDED_SETTING = "the training framework's setting for sharded checkpoints"
FIX_SHARDED = (
    "Fix: save sharded checkpoints, where each rank writes only its shard ({setting}; "
    "this needs a sharded model, FSDP), or give each node more host memory; if the memory "
    "read is wrong, set `host_memory_bytes`."
)
FIX_MORE_MEMORY = (
    "Fix: even a sharded save does not fit: give each node more host memory, spread the job "
    "over more nodes (a sharded save holds 1/world_size of the state per rank), or shrink the "
    "optimizer state; if the memory read is wrong, set `host_memory_bytes`."
)

FIX_SHARD_MODEL = (
    "Fix: shard the model (FSDP), so that each rank copies only its 1/world_size of the state, "
    "or give each node more host memory; if the memory read is wrong, set `host_memory_bytes`."
)


def format_bytes(n: int | None) -> str:
    """Formats bytes as ``"1.5 GiB"`` (``"unknown"`` for ``None``)."""
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"


@dataclass(frozen=True)
class RankMemory:
    """What one rank reports to the plan."""

    node: str
    local_rank: int
    state_bytes: int
    state_sharded: bool
    available_bytes: int | None
    source: str
    largest_bytes: int = 0


@dataclass(frozen=True)
class NodeBudget:
    """Host memory one node needs for a save, and has.

    Attributes:
        node: Node name (hostname, plus ``/node<NODE_RANK>`` when set).
        ranks: Global ranks on the node.
        available_bytes: Memory available (the smallest its ranks report).
        source: Where ``available_bytes`` comes from.
        full_bytes: Peak host memory of a full save on this node.
        sharded_bytes: Peak host memory of a sharded save on this node.
        needed_bytes: The one of the two the job does now.
    """

    node: str
    ranks: list[int]
    available_bytes: int | None
    source: str
    full_bytes: int
    sharded_bytes: int
    needed_bytes: int

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fits (unknown memory counts as fitting)."""
        return self.available_bytes is None or nbytes <= self.available_bytes


@dataclass(frozen=True)
class CheckpointPlan:
    """The decision: ``action`` is ``"ok"``, ``"warn"``, ``"switch_to_sharded"`` or ``"raise"``.

    Attributes:
        action: What to do. ``"switch_to_sharded"`` is only decided for a job
            that can be switched (the adapter's ``switch_to_sharded`` fact).
        reason: One paragraph with the numbers and the fix.
        nodes: The per-node budget: every node up to :data:`TABLE_NODES`; beyond, rank 0's
            and the tightest others (those where a save fails first), in rank order.
        note: A line under the table where its figures need one, e.g. why a
            sharded save is estimated above a full one.
        others: The nodes not listed, summed up in one line (``""`` when every node is).
    """

    action: str
    reason: str
    nodes: list[NodeBudget]
    note: str = ""
    others: str = ""

    def node_of(self, rank: int) -> NodeBudget | None:
        """The budget of the node ``rank`` runs on (``None`` where the plan does not list it)."""
        return next((n for n in self.nodes if rank in n.ranks), None)

    def table(self) -> str:
        """The per-node table: needed (full and sharded save) vs available."""
        rows = [("node", "ranks", "available", "full save", "sharded save")]
        for n in self.nodes:
            rows.append(
                (
                    n.node,
                    format_ranks(n.ranks),
                    f"{format_bytes(n.available_bytes)} ({n.source})",
                    format_bytes(n.full_bytes) + ("" if n.fits(n.full_bytes) else " !"),
                    format_bytes(n.sharded_bytes) + ("" if n.fits(n.sharded_bytes) else " !"),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines += [self.others] if self.others else []
        return "\n".join([*lines, self.note] if self.note else lines)


def register_sharded_setting(framework: str, setting: str) -> None:
    """Registers ``framework``'s setting for sharded checkpoints (see :data:`SHARDED_SETTINGS`).

    Args:
        framework: The framework's name in messages, e.g. ``"Composer"``.
        setting: What a user sets to save sharded checkpoints.
    """
    SHARDED_SETTINGS[framework] = setting


def _registered_settings() -> str:
    """Every registered framework's setting, by framework name (the same on every rank)."""
    named = sorted(SHARDED_SETTINGS.items())
    return "; ".join(f"{name}: `{setting}`" for name, setting in named) or ANY_SHARDED_SETTING


def plan_save(
    per_rank: Mapping[int, RankMemory],
    *,
    materialize: str = "rank0",
    overhead: float = WRITER_OVERHEAD["file"],
    mode: str = "warn",
    state_dict_type: str = "full",
    switchable: bool = False,
    setting: str | None = None,
    host_copy: bool = False,
) -> CheckpointPlan:
    """Decides whether a checkpoint save fits in host memory on every node.

    Args:
        per_rank: What every rank reports, by global rank.
        materialize: ``"rank0"`` or ``"every_rank"`` (who holds the full state).
        overhead: Serialisation overhead, a multiple of the state bytes.
        mode: ``"warn"``, ``"raise"`` or ``"auto"``.
        state_dict_type: What the job saves now, ``"full"`` or ``"sharded"``.
        switchable: Whether the job can be switched to sharded saves
            (``mode="auto"`` raises instead where it cannot).
        setting: The job's framework setting for sharded checkpoints, named in
            the fix (when ``None``, every registered framework's: :data:`SHARDED_SETTINGS`).
        host_copy: Whether a save builds its whole state dict in host memory
            before writing it (OLMo-core's ``cpu_offload=True``): a full save
            holds a consolidated copy even of a model that is not sharded, and
            a sharded save of such a model (a replica per rank, DDP) holds the
            whole state on every rank, not ``1 / world_size`` of it.

    Returns:
        The plan (the same on every rank).
    """
    world, first = len(per_rank), min(per_rank)
    lead = per_rank[first]
    copied = lead.state_sharded or host_copy
    copy = 1.0 if copied else 0.0
    factor = copy + overhead
    streamed = 0 if copied else lead.largest_bytes  # one storage at a time
    per_copy = int(lead.state_bytes * factor) + streamed
    # A sharded save gathers each rank's shard as a sharded model does, whether or not
    # the model is sharded yet: the estimate says what switching would need. Where the
    # save copies each rank's state to the host first, a replica is copied whole.
    replicas = host_copy and not lead.state_sharded
    local = lead.state_bytes if replicas else -(-lead.state_bytes // world)
    per_shard = int(local * (1.0 + overhead))
    groups: dict[str, list[int]] = {}
    for rank in sorted(per_rank):
        groups.setdefault(per_rank[rank].node, []).append(rank)
    nodes = []
    for node, ranks in groups.items():
        reported = [per_rank[r] for r in ranks if per_rank[r].available_bytes is not None]
        least = min(reported, key=lambda m: m.available_bytes or 0, default=None)
        holders = len(ranks) if materialize == "every_rank" else int(first in ranks)
        full, sharded = per_copy * holders, per_shard * len(ranks)
        nodes.append(
            NodeBudget(
                node=node,
                ranks=ranks,
                available_bytes=least.available_bytes if least else None,
                source=least.source if least else "unknown",
                full_bytes=full,
                sharded_bytes=sharded,
                needed_bytes=sharded if state_dict_type == "sharded" else full,
            )
        )
    worst = max(nodes, key=lambda n: n.needed_bytes - _available_or(n, n.needed_bytes))
    kind = "sharded" if state_dict_type == "sharded" else "full"
    largest = (
        f" + largest tensor {format_bytes(lead.largest_bytes)} (copied one at a time)"
        if streamed and kind == "full"
        else ""
    )
    if kind == "sharded" and host_copy:
        part = (
            "its whole replica (the model is not sharded)"
            if replicas
            else f"its shard, 1/{world} of it"
        )
        how = (
            f"state {format_bytes(lead.state_bytes)}; each rank copies {part} into host memory "
            f"before writing, + {overhead:g} serialisation"
        )
    else:
        how = (
            f"state {format_bytes(lead.state_bytes)} x ({copy:g} consolidated copy + "
            f"{overhead:g} serialisation){largest}, materialised on "
            f"{'every local rank' if materialize == 'every_rank' else 'rank 0'}"
        )
    summary = (
        f"a {kind} checkpoint save needs {format_bytes(worst.needed_bytes)} of host memory on node "
        f"{worst.node} ({rank_label(worst.ranks)}; {how}) "
        f"and {format_bytes(worst.available_bytes)} is available ({worst.source})"
    )
    note = ""
    if streamed and any(n.sharded_bytes > n.full_bytes for n in nodes):
        note = (
            "(A sharded save is estimated as a copy of each rank's shard, 1/world_size of the "
            "state; a full save of this model, which is not sharded, copies one tensor at a "
            f"time, the largest: {format_bytes(lead.largest_bytes)}.)"
        )
    listed, others = _listed(nodes, first)
    if all(n.fits(n.needed_bytes) for n in nodes):
        return CheckpointPlan("ok", f"Checkpoint memory fits: {summary}.", listed, note, others)
    shard_fits = all(n.fits(n.sharded_bytes) for n in nodes)
    fix = FIX_SHARDED.format(setting=f"`{setting}`" if setting else _registered_settings())
    sharded_need = format_bytes(max(n.sharded_bytes for n in nodes))
    if kind == "full" and shard_fits and mode == "auto":
        if switchable:
            reason = (
                f"Switching to sharded checkpoints: {summary}; a sharded save needs at most "
                f"{sharded_need} per node."
            )
            return CheckpointPlan("switch_to_sharded", reason, listed, note, others)
        why = (
            "the model is not sharded (a sharded save needs FSDP)"
            if not lead.state_sharded
            else "the trainer's set-up has no sharded-checkpoint setting rankguard can change"
        )
        reason = (
            f"Checkpoint save will not fit: {summary}. A sharded save would fit (at most "
            f"{sharded_need} per node), but `mode='auto'` cannot switch this job to it: {why}. "
            f"{fix}"
        )
        return CheckpointPlan("raise", reason, listed, note, others)
    if kind == "sharded" and replicas:
        fix = FIX_SHARD_MODEL
    elif not (kind == "full" and shard_fits):
        fix = FIX_MORE_MEMORY
    action = "warn" if mode == "warn" else "raise"
    reason = f"Checkpoint save will not fit: {summary}. {fix}"
    return CheckpointPlan(action, reason, listed, note, others)


#: Nodes a plan lists at most: every rank reads the plan and logs its table, which would
#: otherwise grow with the nodes (2,048 rows, 230 KB to each of 16,384 ranks).
TABLE_NODES = 16


def _listed(nodes: list[NodeBudget], lead: int) -> tuple[list[NodeBudget], str]:
    """Every node up to :data:`TABLE_NODES`; else rank 0's and the tightest, and a summary."""
    if len(nodes) <= TABLE_NODES:
        return nodes, ""
    first = next(i for i, n in enumerate(nodes) if lead in n.ranks)
    tight = sorted(
        (i for i in range(len(nodes)) if i != first),
        key=lambda i: (_available_or(nodes[i], 0) - nodes[i].needed_bytes, i),
    )
    keep = sorted([first, *tight[: TABLE_NODES - 1]])
    rest = [n for i, n in enumerate(nodes) if i not in set(keep)]
    available = [n.available_bytes for n in rest if n.available_bytes is not None]
    least = format_bytes(min(available)) if available else "unknown"
    others = (
        f"... and {len(rest):,} more nodes ({sum(len(n.ranks) for n in rest):,} ranks): available "
        f"at least {least}; full save at most {format_bytes(max(n.full_bytes for n in rest))}, "
        f"sharded at most {format_bytes(max(n.sharded_bytes for n in rest))}"
    )
    return [nodes[i] for i in keep], others


def _available_or(node: NodeBudget, default: int) -> int:
    return default if node.available_bytes is None else node.available_bytes
