"""Time a rank spends in its model's forward pass, with no collective inside the measure.

:class:`ForwardClock` registers a forward pre-hook and a forward hook (public
``torch.nn.Module`` APIs, so it works under every trainer) on a few modules of
the model and adds up the wall time spent inside any of them; nested calls
count once. Which modules (:func:`hook_targets`) decides what the measure
holds, because a forward pass can contain collectives in which a fast rank
waits for a slow one:

* ``DistributedDataParallel`` broadcasts the module's buffers from rank 0 at
  the start of its ``forward`` (when the module has buffers): the clock hooks
  the module DDP wraps, below that broadcast.
* FSDP (``FullyShardedDataParallel``) all-gathers a unit's parameters in the
  wrapper's ``forward`` before calling the module it wraps; FSDP2
  (``fully_shard``) does it in a forward pre-hook it registers first (with
  ``prepend=True``). A unit's forward therefore holds the all-gathers of
  every unit inside it, and a fast rank waits there for the slowest. The
  clock hooks the largest modules that hold no sharding unit: the module an
  FSDP wrapper wraps, or an FSDP2 unit with no unit below it (its own
  all-gather has finished when the clock's pre-hook runs), and the modules
  next to units (embeddings, heads). What a unit computes itself outside
  those modules (a residual add) is not counted.
* With no sharding unit it hooks the model and its direct children: the
  Lightning loop calls ``training_step``, which usually calls submodules
  rather than the module's own ``forward``.

What it does not hold: the backward pass (DDP's gradient all-reduce and
FSDP's reduce-scatters run inside it, so it cannot be timed as a rank's own
work without the waits) and the optimizer step. For one model and batch shape
the backward's compute is proportional to the forward's, so a rank whose
device or host is slower shows it in the forward too.

The clock reads ``time.perf_counter()``: on CPU that is the compute itself.
On a GPU a forward pass only queues kernels unless something in it waits for
the device, so there it measures the host's side of the forward.

Inside a region ``torch.compile`` traces (a model compiled in place), the
hooks do nothing, so they never break a graph; a model whose hooked modules
all run compiled is then not measured (:attr:`ForwardClock.total_s` stays 0).

Cost: two hook calls per hooked module call, about 3 us on a busy 2-core
machine (``benchmarks/overhead.py`` prints it).
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch
from torch.compiler import is_compiling

__all__ = ["ForwardClock", "hook_targets"]


def _sharding_types() -> tuple[type, ...]:
    """FSDP's and FSDP2's module classes (none where torch lacks distributed support)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return ()
    return (FullyShardedDataParallel, FSDPModule)


def _unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def hook_targets(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward the clock times (see the module docstring).

    Args:
        model: The model as the trainer holds it (possibly wrapped by DDP or FSDP).

    Returns:
        Modules, outermost first, none inside another unless they are the
        model and its children.
    """
    model = _unwrap_ddp(model)
    units = _sharding_types()
    fsdp1 = units[0] if units else None

    def has_unit_below(module: torch.nn.Module) -> bool:
        return any(isinstance(m, units) for m in module.modules() if m is not module)

    def targets(module: torch.nn.Module) -> list[torch.nn.Module]:
        if not has_unit_below(module):
            if fsdp1 is not None and isinstance(module, fsdp1):
                return list(module.children())  # the module it wraps, after its all-gather
            return [module]
        return [t for child in module.children() for t in targets(child)]

    found = targets(model)
    if found == [model] and not (units and isinstance(model, units)):
        found += list(model.children())
    return found


class ForwardClock:
    """Adds up the wall time spent inside the forward of :func:`hook_targets`.

    Example::

        clock = ForwardClock()
        clock.attach(model)
        before = clock.total_s
        loss = model(batch).sum()
        forward_s = clock.total_s - before
        clock.detach()

    Attributes:
        total_s: Seconds spent inside hooked forwards since :meth:`attach`.
        calls: Outermost hooked forward calls since :meth:`attach`.
        modules: How many modules are hooked.
        depth: Hooked forwards open now (nested); set it to 0 to forget one that
            raised before its hook could close it.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.calls = 0
        self.modules = 0
        self.depth = 0
        self._started = 0.0
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module) -> int:
        """Hooks ``model``'s :func:`hook_targets` (after removing earlier hooks).

        Returns:
            The number of modules hooked.
        """
        self.detach()
        self.total_s, self.calls, self.depth = 0.0, 0, 0
        for module in hook_targets(model):
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        self.modules = len(self._handles) // 2
        return self.modules

    def detach(self) -> None:
        """Removes every hook; safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.modules = 0

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling():
            return
        if self.depth == 0:
            self._started = perf_counter()
        self.depth += 1

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.depth == 0 or is_compiling():
            return
        self.depth -= 1
        if self.depth == 0:
            self.total_s += perf_counter() - self._started
            self.calls += 1
