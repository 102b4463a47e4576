"""A replica's fingerprint, computed where its tensors live and read back off the training thread.

:func:`launch` queues one reduction per tensor on its device (the sum of its
bits viewed as integers, into an int64) and an asynchronous copy of the sums
to host memory; :meth:`Launched.sums` waits for them on the thread that reads
them. Summing integers is exact and order-free, so equal tensors give equal
sums on any device, and any single changed element changes its tensor's sum.
:func:`sample` reads a few tensors' values for a message (the error path only).
See docs/replica.md#what-a-check-costs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from rankguard.callbacks.replica.layout import ReplicaSet, local_tensor

__all__ = [
    "SAMPLED",
    "Launched",
    "ReplicaPrint",
    "Sample",
    "bits",
    "digest",
    "launch",
    "sample",
    "step_counter",
]

#: The integer type each element size is viewed as.
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Elements of a tensor a message's sample reads at most (evenly spaced; all of smaller ones).
SAMPLED = 4096


class ReplicaPrint(NamedTuple):
    """What a rank sends at a check (a tuple: it is pickled at every check).

    Attributes:
        step: The framework's step at the check.
        optimizer_steps: The optimizer's step count (its first state's ``step``), or
            ``None`` where it keeps none.
        digests: Per replica set key, the digest of its tensors' sums.
    """

    step: int
    optimizer_steps: int | None
    digests: dict[bytes, bytes]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as integers, without a copy.

    Its 8-byte words where its bytes are contiguous, aligned and a whole number of
    words (one int64 add per 8 bytes: the reduction streams at memory bandwidth on any
    device, where an int16 element view reads 5-100x slower on a CPU); else its elements
    as integers of their own size. A tensor is read the same way on every rank that
    holds it alike.
    """
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    size = tensor.element_size()
    if (
        tensor.is_contiguous()
        and (tensor.numel() * size) % 8 == 0
        and (tensor.storage_offset() * size) % 8 == 0
        and tensor.numel() > 0
    ):
        return tensor.reshape(-1).view(torch.int64)
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_floating_point():
        return tensor.view(_INTS[size])
    return tensor


def digest(sums: Sequence[int]) -> bytes:
    """A short digest of one replica set's sums (equal sums, equal digests)."""
    return hashlib.blake2b(repr(tuple(sums)).encode(), digest_size=8).digest()


class _Part(NamedTuple):
    positions: list[int]  # where each of these sums goes in the check's order
    sums: torch.Tensor  # on the host (pinned where copied from a CUDA device)
    ready: Any  # a CUDA event to wait for, or None


class Launched:
    """One check's reductions, queued on their devices; :meth:`sums` reads them back.

    Attributes:
        spans: Per replica set key, the slice of :meth:`sums` holding its tensors'.
        optimizer_steps: The optimizer's step count where it is on the host (else it is
            the last of the sums).
    """

    def __init__(
        self, parts: list[_Part], spans: dict[bytes, slice], steps: int | None, on_device: bool
    ) -> None:
        self._parts = parts
        self.spans = spans
        self.optimizer_steps = steps
        self._steps_on_device = on_device
        self._count = sum(len(p.positions) for p in parts)

    def sums(self) -> list[int]:
        """Every sum in order, once the devices have computed them (waits; any thread)."""
        out = [0] * self._count
        for part in self._parts:
            if part.ready is not None:
                part.ready.synchronize()
            for position, value in zip(part.positions, part.sums.tolist(), strict=True):
                out[position] = value
        return out

    def read(self, step: int) -> tuple[ReplicaPrint, list[int]]:
        """The check's print, and the sums it digests (kept for a later narrower exchange)."""
        sums = self.sums()
        steps = sums[-1] if self._steps_on_device else self.optimizer_steps
        digests = {key: digest(sums[span]) for key, span in self.spans.items()}
        return ReplicaPrint(step, steps, digests), sums


def step_counter(optimizer: Any) -> torch.Tensor | int | None:
    """The optimizer's step count: its first state's ``step`` (Adam's, AdamW's, ...).

    A tensor (on the host or a device), an int, or ``None`` where it keeps none
    (plain SGD) or has taken no step yet.
    """
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping) or not state:
        return None
    first = next(iter(state.values()), None)
    step = first.get("step") if isinstance(first, Mapping) else None
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        return step
    return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None


def launch(sets: Sequence[ReplicaSet], optimizer: Any = None) -> Launched:
    """Queues the reductions of every set's tensors (and the optimizer's step count).

    On a CUDA device nothing here waits for the device: the sums go to pinned host
    memory with ``non_blocking=True`` behind an event that :meth:`Launched.sums`
    waits for. On the CPU the sums are computed here, as any CPU op is.
    """
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    spans: dict[bytes, slice] = {}
    position = 0
    with torch.no_grad():
        for replica_set in sets:
            start = position
            for tensor in replica_set.tensors:
                local = local_tensor(tensor)
                positions, sums = by_device.setdefault(local.device, ([], []))
                positions.append(position)
                sums.append(torch.sum(bits(local)))  # integers sum into an int64
                position += 1
            spans[replica_set.key] = slice(start, position)
        steps = step_counter(optimizer)
        on_device = isinstance(steps, torch.Tensor) and steps.device.type != "cpu"
        host_steps: int | None = None
        if isinstance(steps, torch.Tensor) and on_device:
            positions, sums = by_device.setdefault(steps.device, ([], []))
            positions.append(position)
            sums.append(steps.detach().reshape(()).to(torch.int64))
        elif isinstance(steps, torch.Tensor):
            host_steps = int(steps.item())
        else:
            host_steps = steps
        parts = [_to_host(device, p, s) for device, (p, s) in by_device.items()]
    return Launched(parts, spans, host_steps, on_device)


def _to_host(device: torch.device, positions: list[int], sums: list[torch.Tensor]) -> _Part:
    stacked = torch.stack(sums)
    if device.type == "cpu":
        return _Part(positions, stacked, None)
    if device.type == "cuda":
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Part(positions, host, ready)
    return _Part(positions, stacked.cpu(), None)  # other devices: a plain (waiting) copy


class Sample(NamedTuple):
    """A few of one tensor's values, for a message (the error path).

    Attributes:
        name: The tensor's name.
        shape: Its (local) shape.
        values: Up to :data:`SAMPLED` of its elements, evenly spaced, as floats.
        sampled: Whether ``values`` leave some elements out.
    """

    name: str
    shape: tuple[int, ...]
    values: list[float]
    sampled: bool


def sample(name: str, tensor: torch.Tensor) -> Sample:
    """Reads up to :data:`SAMPLED` of ``tensor``'s elements (waits for its device)."""
    local = local_tensor(tensor)
    flat = local.reshape(-1)
    count = flat.numel()
    if count > SAMPLED:
        index = torch.linspace(0, count - 1, SAMPLED, device=flat.device).round().long()
        flat = flat[index]
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    values = flat.detach().to("cpu", torch.float64).tolist()
    return Sample(name, tuple(local.shape), values, count > SAMPLED)
