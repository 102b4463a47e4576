"""Which ranks hold equal copies of which tensors, read from the job's structure.

Holds :func:`replica_layout` and what it returns. A ``DistributedDataParallel`` (or
``replicate``) makes every rank of its process group a replica; a DTensor parameter
(FSDP2, HSDP, tensor parallel) is the same on the ranks its mesh places it on with
``Replicate()``; a plain parameter nothing is known about is left out.
See docs/replica.md#which-ranks-are-compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rankguard.callbacks.core import torch_private
from rankguard.callbacks.core.ranks import rank_label

__all__ = [
    "RUNNING_STATS",
    "ReplicaLayout",
    "ReplicaSet",
    "local_tensor",
    "replica_layout",
    "set_key",
]

#: The buffers of a normalization layer with ``track_running_stats``: each rank's batches
#: update them (outside ``SyncBatchNorm``), so they differ between ranks by design.
RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")

#: Kinds of layout, as the likely causes tell them apart.
DDP, MESH, WORLD = "ddp", "mesh", "world"


@dataclass
class ReplicaSet:
    """Tensors this rank holds of which the same ranks hold equal copies.

    Attributes:
        ranks: The global ranks holding equal copies, this one among them, sorted.
        key: A short id of ``ranks``, the same on each of them.
        kind: ``"ddp"`` (a ``DistributedDataParallel``), ``"mesh"`` (DTensor
            placements) or ``"world"`` (``replicas="world"``).
        how: What makes them replicas, for messages.
        names: The tensors' names, in the model's order.
        tensors: The tensors (DTensor parameters as they are; :func:`local_tensor`
            reads their local part at each check).
    """

    ranks: tuple[int, ...]
    key: bytes
    kind: str
    how: str
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ReplicaLayout:
    """What a rank compares, and what it leaves out and why.

    Attributes:
        sets: The replica sets this rank belongs to, in the order first met.
        left_out: Per reason, how many tensors it leaves out.
    """

    sets: list[ReplicaSet] = field(default_factory=list)
    left_out: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: what is compared across which ranks, and what is not."""
        parts = [
            f"{len(s.names)} tensors across {rank_label(s.ranks)} ({s.how})" for s in self.sets
        ]
        compared = "; ".join(parts) if parts else "nothing"
        if not self.left_out:
            return f"compares {compared}"
        out = "; ".join(f"{n} {why}" for why, n in self.left_out.items())
        return f"compares {compared}; leaves out {out}"


def set_key(ranks: Iterable[int]) -> bytes:
    """A short id of a set of ranks, the same on every rank that computes it."""
    return hashlib.blake2b(repr(tuple(sorted(ranks))).encode(), digest_size=8).digest()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; any other tensor itself)."""
    to_local = getattr(tensor, "to_local", None)
    with torch.no_grad():  # to_local then returns the local tensor itself, no autograd node
        return (to_local() if to_local is not None else tensor).detach()


@dataclass(frozen=True)
class _DataParallel:
    """A data-parallel wrapper as the layout needs it."""

    ranks: tuple[int, ...]
    broadcast_buffers: bool
    params: frozenset[int]  # ids of the parameters it keeps in sync
    how: str


def _group_ranks(group: Any, mesh: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    if group is None and mesh is not None:
        group = mesh.get_group()
    return tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))


def _data_parallel(model: Any, wrapper: Any) -> _DataParallel | None:
    """The ``DistributedDataParallel`` (or DDP-based ``replicate``) over ``model``, if any."""
    from torch.nn.parallel import DistributedDataParallel

    for candidate in (wrapper, model):
        if isinstance(candidate, DistributedDataParallel):
            ignored = getattr(candidate, "parameters_to_ignore", ()) or ()
            params = frozenset(
                id(p) for n, p in candidate.module.named_parameters() if n not in ignored
            )
            ranks = _group_ranks(candidate.process_group, None)
            return _DataParallel(ranks, bool(candidate.broadcast_buffers), params, "DDP")
        settings = (
            torch_private.replicate_settings(candidate)
            if isinstance(candidate, torch.nn.Module)
            else None
        )
        if settings is not None:
            ranks = _group_ranks(settings["process_group"], settings["device_mesh"])
            params = frozenset(id(p) for p in candidate.parameters() if not _is_dtensor(p))
            broadcast = settings["broadcast_buffers"] is not False
            return _DataParallel(ranks, broadcast, params, "replicate")
    return None


def _is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


def _mesh_ranks(tensor: Any) -> tuple[tuple[int, ...], str] | None:
    """The ranks a DTensor's mesh gives the same local tensor as this rank's, and how.

    ``None`` where a placement is neither ``Replicate()`` nor ``Shard`` (``Partial``: a
    pending reduction, no copy to compare).
    """
    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None or any(not (p.is_replicate() or p.is_shard()) for p in placements):
        return None
    index = tuple(
        slice(None) if p.is_replicate() else c for p, c in zip(placements, coordinate, strict=True)
    )
    ranks = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
    names = getattr(mesh, "mesh_dim_names", None) or [f"dim {i}" for i in range(mesh.ndim)]
    replicated = [str(n) for n, p in zip(names, placements, strict=True) if p.is_replicate()]
    how = f"mesh {tuple(mesh.mesh.shape)}, replicated over {', '.join(replicated) or 'none'}"
    return ranks, how


def _running_stats(model: torch.nn.Module) -> set[int]:
    """Ids of the running statistics of normalization layers that keep them per rank."""
    from torch.nn.modules.batchnorm import SyncBatchNorm, _NormBase

    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, _NormBase) and not isinstance(module, SyncBatchNorm):
            ids.update(id(b) for n, b in module.named_buffers(recurse=False) if n in RUNNING_STATS)
    return ids


def _fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _named(model: Any) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` of the model under any DDP wrapper, params first."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    for name, param in inner.named_parameters():
        yield name, param, True
    for name, buffer in inner.named_buffers():
        yield name, buffer, False


class _Builder:
    """Puts each tensor in its replica set, or counts it under the reason it is left out."""

    def __init__(self) -> None:
        self.layout = ReplicaLayout()
        self._sets: dict[bytes, ReplicaSet] = {}

    def add(self, ranks: tuple[int, ...], kind: str, how: str, name: str, tensor: Any) -> None:
        if len(ranks) < 2:
            self.leave(f"sharded with no replica ({how})")
            return
        key = set_key(ranks)
        found = self._sets.get(key)
        if found is None:
            found = self._sets[key] = ReplicaSet(ranks, key, kind, how)
            self.layout.sets.append(found)
        found.names.append(name)
        found.tensors.append(tensor)

    def leave(self, why: str) -> None:
        self.layout.left_out[why] = self.layout.left_out.get(why, 0) + 1


def replica_layout(model: Any, wrapper: Any = None, replicas: str = "auto") -> ReplicaLayout:
    """Which of this rank's tensors which ranks hold equal copies of.

    Parameters: a DTensor's by its mesh and placements; a plain one by the
    ``DistributedDataParallel`` (or DDP-based ``replicate``) that keeps it in sync,
    found as ``wrapper`` or ``model`` itself; with ``replicas="world"``, any other
    plain parameter by every rank. Buffers: only where nothing else keeps them equal
    (a DDP with ``broadcast_buffers=False``, or ``replicas="world"``), and never a
    normalization layer's running statistics (each rank's batches update them).

    Args:
        model: The model (a ``torch.nn.Module``, a DDP wrapper included).
        wrapper: What makes ``model`` data parallel where the framework keeps it apart
            (Lightning's ``strategy.model``, the HF Trainer's ``model_wrapped``), or ``None``.
        replicas: ``"auto"`` or ``"world"`` (every rank holds the whole model).

    Returns:
        The layout; its sets are empty where nothing can be compared.
    """
    import torch.distributed as dist

    builder = _Builder()
    if not isinstance(model, torch.nn.Module):
        builder.leave(f"(the model is a {type(model).__name__}, not a torch.nn.Module)")
        return builder.layout
    dp = _data_parallel(model, wrapper)
    world = tuple(range(dist.get_world_size()))
    fsdp1 = _fsdp1(model)
    stats = _running_stats(model)
    for name, tensor, is_param in _named(model):
        if _is_dtensor(tensor):
            placed = _mesh_ranks(tensor)
            if placed is None:
                builder.leave("with a Partial placement")
            else:
                builder.add(placed[0], MESH, placed[1], name, tensor)
        elif id(tensor) in stats:
            builder.leave("running statistics (each rank's own batches update them)")
        elif dp is not None and (id(tensor) in dp.params if is_param else not dp.broadcast_buffers):
            builder.add(dp.ranks, DDP, dp.how, name, tensor)
        elif dp is not None and not is_param:
            builder.leave(f"buffers ({dp.how} copies rank 0's to every rank at each forward)")
        elif replicas == "world":
            builder.add(world, WORLD, 'replicas="world"', name, tensor)
        elif fsdp1:
            builder.leave("under FullyShardedDataParallel (FSDP1: its layout is not read)")
        elif is_param:
            builder.leave(_UNKNOWN)
        else:
            builder.leave("buffers (no data-parallel wrapper says which ranks share them)")
    return builder.layout


_UNKNOWN = (
    "plain parameters no data-parallel wrapper keeps in sync (which ranks hold the same "
    'ones is not known: pass the DDP-wrapped model, or set replicas="world")'
)
