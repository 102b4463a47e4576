"""What DDP and FSDP issue, as the record of collectives sees it: from their hooks, or C++.

FSDP's all-gathers and reduce-scatters are Python calls, issued under its hooks: the
frames the record walks to the user's line say which hook (a forward's unshard, a
backward's, a prefetch, a gradient reduce-scatter) and which module (:data:`ROLES`).
DDP's buffer broadcast is a C++ call (``torch_private.COALESCED_BROADCAST``), wrapped
while the record is installed. DDP's gradient all-reduces are issued from C++ with no
Python call at all; the record marks each DDP forward's end (:class:`DdpForwards`), and
:mod:`~rankguard.callbacks.hang.collective_infer` tells the numbers after it. Nothing
here runs unless the record is installed; see docs/hang.md#the-collectives-ddp-and-fsdp-issue-told.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from rankguard.callbacks.core.torch_private import (
    COALESCED_BROADCAST,
    coalesced_broadcast_module,
    fsdp_module_name,
)

__all__ = [
    "BUFFERS",
    "ROLES",
    "DdpForwards",
    "coalesced_buckets",
    "mark_wrapper",
    "origin_of",
    "role_of",
    "wrap_coalesced_broadcast",
    "wrapped_original",
    "wrapper_owner",
]

#: The attributes that mark a wrapper of rankguard's on a framework's function: the function
#: it wraps, and the record of collectives that installed it (where one did).
_ORIGINAL, _OWNER = "_rankguard_original", "_rankguard_recorder"


def mark_wrapper(wrapper: Callable, original: Callable, owner: Any = None) -> None:
    """Marks ``wrapper`` as rankguard's wrapper of ``original`` (installed by ``owner``)."""
    setattr(wrapper, _ORIGINAL, original)
    if owner is not None:
        setattr(wrapper, _OWNER, owner)


def wrapped_original(function: Any) -> Any:
    """The function ``function`` wraps if it is a wrapper of rankguard's, else ``None``."""
    return getattr(function, _ORIGINAL, None)


def wrapper_owner(function: Any) -> Any:
    """The record of collectives that installed ``function`` as its wrapper, else ``None``."""
    return getattr(function, _OWNER, None)


# A frame's role, as bits (1: any library frame; 0: the user's own code).
LIBRARY = 1
OWNER = 2  # its ``self`` is the FSDP2 parameter group whose collective it is
PREFETCH = 4
FORWARD = 8
BACKWARD = 16
REDUCE = 32
SYNC_BUFFERS = 64
SYNC_STATES = 128

#: Per torch file (a path's end), the functions whose frame says what issued a collective.
ROLES: dict[str, dict[str, int]] = {
    "distributed/fsdp/": {  # FSDP2 (_fully_shard/) and FSDP1 (_runtime_utils.py)
        "unshard": OWNER,
        "post_backward": OWNER | REDUCE | BACKWARD,
        "_prefetch_unshard": PREFETCH,
        "_prefetch_handle": PREFETCH,
        "pre_forward": FORWARD,
        "_pre_forward": FORWARD,
        "_pre_forward_unshard": FORWARD,
        "_root_pre_forward": FORWARD,
        "pre_backward": BACKWARD,
        "_pre_backward": BACKWARD,
        "_pre_backward_hook": BACKWARD,
        "_backward_prefetch": BACKWARD,
        "_post_backward_hook": REDUCE | BACKWARD,
        "_root_post_backward_final_callback": BACKWARD,
        "_reduce_grad": REDUCE | BACKWARD,
    },
    "nn/parallel/distributed.py": {"_sync_module_buffers": SYNC_BUFFERS},
    "distributed/utils.py": {"_sync_params_and_buffers": SYNC_STATES},
}
#: What issued DDP's broadcast of module buffers (``{at}``: the phase of its forward).
BUFFERS = "module buffers in {at}'s forward (DDP's broadcast_buffers)"
#: What issued the broadcast of parameters and buffers from rank 0 when a module is wrapped.
STATES = "parameters and buffers from rank 0 (DDP's or FSDP's sync at wrapping)"


def role_of(filename: str, function: str) -> int:
    """A library frame's role bits (:data:`LIBRARY` at least) from its file and function."""
    path = filename.replace(os.sep, "/")
    for part, roles in ROLES.items():
        if part in path:
            return LIBRARY | roles.get(function, 0)
    return LIBRARY


def origin_of(op: str, frames: Sequence[tuple[int, Any]]) -> str | None:
    """What issued collective ``op`` from the library frames walked (innermost first).

    Each is ``(role bits, frame)``; ``None`` where no frame says (a library's own call).
    """
    roles = 0
    direction = None
    owner = None
    for bits, frame in frames:
        roles |= bits
        if direction is None and bits & (FORWARD | BACKWARD):
            direction = "forward" if bits & FORWARD else "backward"
        if owner is None and bits & OWNER:
            owner = frame
    if roles & SYNC_BUFFERS:
        return BUFFERS
    if roles & SYNC_STATES:
        return STATES
    if not roles & (FORWARD | BACKWARD | REDUCE | OWNER | PREFETCH):
        return None
    module = None
    if owner is not None:  # the FSDP2 parameter group whose unshard or reduce this is
        module = fsdp_module_name(owner.f_locals.get("self"))
    who = "a module" if module is None else f"module {module!r}" if module else "the root module"
    if op.startswith("reduce_scatter") or (roles & REDUCE and op.startswith("all_reduce")):
        what = "reduce-scatter" if op.startswith("reduce_scatter") else "all-reduce"
        return f"FSDP's {what} of the gradients of {who} in {{at}}'s backward"
    if op.startswith("all_gather"):
        prefetched = " (prefetched)" if roles & PREFETCH else ""
        phase = f"{{at}}'s {direction}" if direction else "{at}"
        return f"FSDP's all-gather of the parameters of {who}{prefetched} for {phase}"
    return None


def coalesced_buckets(tensors: Sequence[Any], limit: int) -> list[tuple[Any, int]]:
    """The broadcasts ``_broadcast_coalesced`` issues: ``(dtype, elements)`` of each, in order.

    C++'s ``compute_bucket_assignment_by_size``: tensors go to a bucket per dtype and
    device, in order; a bucket closes once it holds ``limit`` bytes or more; the buckets
    are broadcast in the order of their first tensor. Each is one flattened broadcast.
    """
    open_: dict[tuple[Any, Any], list[int]] = {}  # key -> [first index, bytes, elements]
    done: list[tuple[int, Any, int]] = []
    for index, tensor in enumerate(tensors):
        key = (tensor.dtype, tensor.device)
        bucket = open_.setdefault(key, [index, 0, 0])
        bucket[1] += tensor.numel() * tensor.element_size()
        bucket[2] += tensor.numel()
        if bucket[1] >= limit:
            done.append((bucket[0], key[0], bucket[2]))
            del open_[key]
    done += [(first, key[0], numel) for key, (first, _, numel) in open_.items()]
    return [(dtype, numel) for _, dtype, numel in sorted(done, key=lambda d: d[0])]


def wrap_coalesced_broadcast(note: Callable[..., None]) -> Callable[[], None] | None:
    """Wraps ``torch.distributed._broadcast_coalesced``; returns its undo, or ``None``.

    ``note(group, buckets, frame)`` is called with the broadcasts about to be issued
    (:func:`coalesced_buckets`) before the call, so a broadcast that never returns is
    in the record.
    """
    module = coalesced_broadcast_module()
    if module is None:
        return None
    original = getattr(module, COALESCED_BROADCAST)
    if wrapped_original(original) is not None:
        return None  # another record's wrapper is in place

    @functools.wraps(original)
    def broadcast_coalesced(group: Any, tensors: Any, buffer_size: int, *args: Any) -> Any:
        try:
            import sys

            note(group, coalesced_buckets(tensors, buffer_size), sys._getframe(1))
        except Exception:
            pass
        return original(group, tensors, buffer_size, *args)

    mark_wrapper(broadcast_coalesced, original)
    setattr(module, COALESCED_BROADCAST, broadcast_coalesced)

    def undo() -> None:
        if getattr(module, COALESCED_BROADCAST, None) is broadcast_coalesced:
            setattr(module, COALESCED_BROADCAST, original)

    return undo


class DdpForwards:
    """Marks each ``DistributedDataParallel`` forward's end in the record while installed.

    ``DistributedDataParallel.forward`` is wrapped on the class (every module, whenever
    wrapped): the group's count before and after, whether a backward with gradient
    all-reduces follows. A compiled region calls the original.

    Args:
        mark: ``mark(ddp, start_count)``, called as a forward returns.
        count: ``count(group)``: a group's count of collectives now.
        compiling: Whether torch.compile is tracing.
    """

    def __init__(
        self,
        mark: Callable[[Any, int], None],
        count: Callable[[Any], int],
        compiling: Callable[[], bool],
    ) -> None:
        self._mark, self._count, self._compiling = mark, count, compiling
        self._cls: Any = None
        self._original: Any = None
        self._wrapper: Any = None

    def install(self) -> bool:
        """Wraps the class's forward; ``False`` where DDP is not there or already wrapped."""
        try:
            from torch.nn.parallel import DistributedDataParallel as cls
        except ImportError:  # pragma: no cover - part of torch
            return False
        original = cls.__dict__.get("forward")
        if original is None or wrapped_original(original) is not None:
            return False
        mark, count, compiling = self._mark, self._count, self._compiling

        @functools.wraps(original)
        def forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if compiling():
                return original(ddp, *args, **kwargs)
            try:
                start = count(ddp.process_group)
            except Exception:
                return original(ddp, *args, **kwargs)
            out = original(ddp, *args, **kwargs)
            try:
                mark(ddp, start)
            except Exception:
                pass
            return out

        mark_wrapper(forward, original)
        cls.forward = forward
        self._cls, self._original, self._wrapper = cls, original, forward
        return True

    def uninstall(self) -> None:
        """Puts the class's own forward back (where no one replaced the wrapper since)."""
        cls, self._cls = self._cls, None
        if cls is not None and cls.__dict__.get("forward") is self._wrapper:
            cls.forward = self._original
