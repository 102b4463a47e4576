"""Every private ``torch`` name rankguard reads, one function each.

``torch.distributed`` keeps some of what rankguard needs behind private names:
the default process group's store and timeout, a process group's count of the
collectives it issued, the flight recorder's dumps, the coalesced broadcast DDP
and FSDP issue from C++, DDP's buckets as its logger has them, FSDP2's module names,
how the DDP-based ``replicate`` made a module data parallel. A module's forward hooks
are put back and taken off through its private hook dicts. Each read is here, with
why no public API serves it; ``tests/core/test_torch_private.py`` calls each
against the installed torch and fails when torch renames or moves what it reads.
Nothing else in rankguard reads a private ``torch`` name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "COALESCED_BROADCAST",
    "FLIGHT_RECORDER_DUMPS",
    "abort_process_groups",
    "ddp_logged",
    "ddp_rebuilt",
    "default_store",
    "flight_recorder_dumps",
    "forward_hook_dicts",
    "fsdp_module_name",
    "group_timeout_s",
    "replicate_settings",
    "sequence_reader",
]

#: The flight recorder's dump functions in ``torch._C._distributed_c10d``: torch 2.7 has
#: NCCL's (``TORCH_NCCL_TRACE_BUFFER_SIZE``); torch 2.8+ also every other backend's, both
#: sized by ``TORCH_FR_BUFFER_SIZE``.
FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
_SEQ = "_get_sequence_number_for_group"
#: ``torch.distributed._broadcast_coalesced(group, tensors, buffer_size, src)``: the C++
#: broadcast DDP's buffer sync (before each forward, ``broadcast_buffers=True``) and the
#: parameter sync at DDP's and FSDP's wrapping call, by this name on the module at each call.
COALESCED_BROADCAST = "_broadcast_coalesced"


def default_store() -> Any:
    """The key-value store the default process group was initialised with.

    No public getter: ``init_process_group`` keeps it in ``distributed_c10d``.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def abort_process_groups() -> bool:
    """Aborts every process group of this process (cancels NCCL's in-flight kernels).

    No public API: ``destroy_process_group`` waits for pending work, which a hung
    peer never completes; PyTorch's own NCCL watchdog calls this to end a hung
    process safely. On gloo it returns at once (nothing to cancel) and the store
    stays usable. ``False`` where no process group is initialised.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_available() or not dist.is_initialized():
        return False
    distributed_c10d._abort_process_group()
    return True


def group_timeout_s(device_type: str) -> float | None:
    """The default process group's timeout in seconds, for its backend on ``device_type``.

    No public getter: the backend's options hold it (``_timeout``). ``None``
    where this torch keeps it elsewhere.
    """
    import torch
    import torch.distributed as dist

    try:
        options = dist.group.WORLD._get_backend(torch.device(device_type)).options
        return float(options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return None


def sequence_reader(group: Any) -> Callable[[], int] | None:
    """The process group's count of collectives issued, as a callable, or ``None``.

    ``ProcessGroup._get_sequence_number_for_group`` (gloo and NCCL, torch 2.7 to
    2.13) counts every collective on the group, C++ callers such as DDP's
    gradient all-reduce included; no public counter exists.
    """
    read = getattr(group, _SEQ, None)
    if read is None:
        return None
    try:
        read()
    except (RuntimeError, AttributeError):
        return None
    return read


def flight_recorder_dumps() -> list[tuple[str, Callable[..., Any]]]:
    """The flight recorder dumps this torch has, by name (empty without ``torch.distributed``).

    PyTorch's flight recorder has no public reader in-process.
    """
    try:
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return []
    return [(n, d) for n in FLIGHT_RECORDER_DUMPS if (d := getattr(c10d, n, None)) is not None]


def forward_hook_dicts(module: Any) -> tuple[dict, dict, dict]:
    """A module's forward pre-hooks, forward hooks and always-called marks, by hook id.

    Putting a registered hook back (or taking it off) through these dicts costs a
    tenth of registering it again, and keeps its id and order; the public handles
    only remove.
    """
    return module._forward_pre_hooks, module._forward_hooks, module._forward_hooks_always_called


def coalesced_broadcast_module() -> Any:
    """The module whose :data:`COALESCED_BROADCAST` DDP and FSDP call (``torch.distributed``).

    No Python collective is behind it: it flattens the tensors into buckets of at most
    ``buffer_size`` bytes per dtype and device and broadcasts each from C++. Wrapping it
    there is how the record sees DDP's buffer broadcasts.
    """
    import torch.distributed as dist

    if not callable(getattr(dist, COALESCED_BROADCAST, None)):
        return None
    return dist


def ddp_logged(ddp: Any) -> dict | None:
    """What DDP's C++ logger holds of a ``DistributedDataParallel`` module, or ``None``.

    ``_get_ddp_logging_data()`` is the one place its buckets are told: ``bucket_sizes``
    (bytes, in the order all-reduced), ``rebuilt_bucket_sizes`` once logged after the
    rebuild in its second forward, ``dtypes``, ``find_unused_parameters``. ``None`` where
    its reducer does not all-reduce buckets (a compiled DDP's Python reducer, delayed
    all-reduce of all parameters).
    """
    if getattr(ddp, "_use_python_reducer", False) or getattr(
        ddp, "_delay_all_reduce_all_params", False
    ):
        return None
    try:
        return dict(ddp._get_ddp_logging_data())
    except (AttributeError, RuntimeError):
        return None


def ddp_rebuilt(ddp: Any) -> bool:
    """Whether DDP rebuilt its buckets (in its second forward: ``_has_rebuilt_buckets``)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def fsdp_module_name(param_group: Any) -> str | None:
    """The module an FSDP2 parameter group shards, by its name from the root (``_module_fqn``).

    ``None`` for anything else (FSDP1's handles name no module).
    """
    name = getattr(param_group, "_module_fqn", None)
    return name if isinstance(name, str) else None


def replicate_settings(module: Any) -> dict[str, Any] | None:
    """How ``torch.distributed._composable.replicate`` (DDP-based) made ``module`` data parallel.

    ``{"process_group": ..., "device_mesh": ..., "broadcast_buffers": ...}`` (``None`` where
    not given: the default group, DDP's default), or ``None`` where ``module`` is not under
    that ``replicate`` (OLMo-core's DDP applies it). No public reader: its state keeps the
    ``DistributedDataParallel`` it builds at the first forward in ``_ddp``, and the
    arguments until then in ``_init_kwargs``.
    """
    try:
        from torch.distributed._composable.replicate import DDP, replicate
    except ImportError:
        return None
    if not isinstance(module, DDP):
        return None
    state = replicate.state(module)
    ddp = getattr(state, "_ddp", None)
    if ddp is not None:
        return {
            "process_group": ddp.process_group,
            "device_mesh": None,
            "broadcast_buffers": ddp.broadcast_buffers,
        }
    kwargs = dict(getattr(state, "_init_kwargs", None) or {})
    return {
        "process_group": kwargs.get("process_group"),
        "device_mesh": kwargs.get("device_mesh"),
        "broadcast_buffers": kwargs.get("broadcast_buffers", True),
    }
