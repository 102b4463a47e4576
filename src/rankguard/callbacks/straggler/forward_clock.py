"""Time a rank spends in its model's forward pass, with no collective inside the measure.

Holds :class:`ForwardClock` (host time of the forward pass, hooks on
:func:`hook_targets`) and :class:`EventTimer` (device time on CUDA).
See docs/straggler.md#the-forward-clock-what-it-hooks-and-why.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from functools import partial
from time import perf_counter
from typing import Any, Protocol

import torch
from torch.compiler import is_compiling

from rankguard.callbacks.core.torch_private import forward_hook_dicts

__all__ = ["EventTimer", "ForwardClock", "TimingEvent", "cuda_events", "hook_targets"]


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
    """The modules whose forward the clock times.

    Which and why: docs/straggler.md#the-forward-clock-what-it-hooks-and-why.

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


class TimingEvent(Protocol):
    """What :class:`EventTimer` needs of an event: ``torch.cuda.Event``'s methods."""

    def record(self) -> None:
        """Marks the point the device's stream has reached now."""

    def query(self) -> bool:
        """Whether the device has passed the mark (never waits)."""

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this mark to ``end_event``'s; both must have completed."""


class _CudaEvent:
    """A timing ``torch.cuda.Event`` recorded on ``device``'s current stream."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return self._event.query()

    def elapsed_time(self, end_event: _CudaEvent) -> float:
        return self._event.elapsed_time(end_event._event)


def cuda_events(model: torch.nn.Module) -> Callable[[], TimingEvent] | None:
    """Makes timing events for ``model``'s CUDA device, or ``None`` when it is not on one.

    The device is that of the model's first parameter (or buffer): each event
    is recorded on that device's current stream, the one the forward's
    kernels are queued on.
    """
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if first is None or first.device.type != "cuda":
        return None
    return partial(_CudaEvent, first.device)


class EventTimer:
    """Times spans with device events: recorded in the hooks, read once they have completed.

    Each :meth:`record` marks the device stream's current point with an event
    from a pool, with the host's time; marks pair up as spans (start, end).
    :meth:`close_batch` closes the spans marked in a batch's host time as one batch, and
    :meth:`ready` returns, oldest first, the device time of every closed batch
    whose events have all completed (``query()``), leaving the others pending
    for a later call; their events go back to the pool. Nothing waits for
    the device.

    Args:
        new_event: Makes one event (``torch.cuda.Event(enable_timing=True)``'s
            ``record``, ``query`` and ``elapsed_time`` in milliseconds).
        max_pending: Closed batches kept pending at most (>= 1); beyond that
            the oldest is dropped (counted in :attr:`dropped`) and its events
            reused: a device that stops completing work cannot grow the pool.

    Attributes:
        created: Events made so far (the pool's size).
        dropped: Batches dropped while pending.
    """

    def __init__(self, new_event: Callable[[], TimingEvent], max_pending: int = 1024) -> None:
        self.new_event = new_event
        self.max_pending = max_pending
        self.created = 0
        self.dropped = 0
        self._free: list[TimingEvent] = []
        self._marks: list[tuple[float, TimingEvent]] = []
        self._pending: deque[list[TimingEvent]] = deque()

    def record(self, at: float) -> None:
        """Marks a span's start or end on the device's stream; ``at``: the host's clock now."""
        if self._free:
            event = self._free.pop()
        else:
            event = self.new_event()
            self.created += 1
        event.record()
        self._marks.append((at, event))

    def close_batch(self, start: float, end: float, keep: bool = True) -> None:
        """Closes the spans marked from ``start`` to ``end`` (host clock) as one batch.

        They are pending until read when ``keep``, else forgotten; marks made
        before ``start`` (outside any batch) are forgotten.
        """
        marks, taken = self._marks, 0
        for at, _ in marks:  # the hooks may append later marks meanwhile: read a prefix
            if at > end:
                break
            taken += 1
        batch = [event for at, event in marks[:taken] if at >= start]
        self._free.extend(event for at, event in marks[:taken] if at < start)
        del marks[:taken]
        if len(batch) % 2:  # a span left open
            self._free.append(batch.pop())
        if not keep:
            self._free.extend(batch)
            return
        self._pending.append(batch)
        if len(self._pending) > self.max_pending:
            self._free.extend(self._pending.popleft())
            self.dropped += 1

    def ready(self) -> list[float]:
        """Seconds on the device of each closed batch whose events have completed, oldest first."""
        done: list[float] = []
        pending = self._pending
        while pending:
            marks = pending[0]
            if marks and not (marks[-1].query() and all(e.query() for e in marks)):
                break  # batches complete in order: the later ones are not done either
            pending.popleft()
            ms = sum(marks[i].elapsed_time(marks[i + 1]) for i in range(0, len(marks), 2))
            done.append(ms / 1000)
            self._free.extend(marks)
        return done

    @property
    def pending(self) -> int:
        """Closed batches not read yet."""
        return len(self._pending)

    def clear(self) -> None:
        """Forgets every mark and pending batch (keeps the pool)."""
        marks, self._marks = self._marks, []
        self._free.extend(event for _, event in marks)
        while self._pending:
            self._free.extend(self._pending.popleft())


class ForwardClock:
    """Adds up the time spent inside the forward of :func:`hook_targets`, per batch.

    Example::

        clock = ForwardClock()
        clock.attach(model)
        start = time.perf_counter()
        loss = model(batch).sum()
        clock.close_batch(start, time.perf_counter())  # may be later, on another thread
        forward_s = clock.ready()  # [seconds]; on CUDA, once the device has run it
        clock.detach()

    Args:
        new_event: Times forwards with these device events (:class:`TimingEvent`)
            whatever the model's device; ``None`` (default): CUDA events when
            the model's parameters are on a CUDA device, else the host's clock.

    Attributes:
        total_s: Host seconds spent inside hooked forwards since :meth:`attach`.
        calls: Outermost hooked forward calls since :meth:`attach`.
        modules: How many modules are hooked (or, while not :attr:`armed`, would be).
        armed: Whether the hooks are on the modules now (see :meth:`arm`).
        depth: Hooked forwards open now (nested); set it to 0 to forget one that
            raised before its hook could close it.
        timer: The device timer, or ``None`` when forwards are timed on the host.
        paused: While set, forwards are not timed (evaluation's).
    """

    def __init__(self, new_event: Callable[[], TimingEvent] | None = None) -> None:
        self.new_event = new_event
        self.total_s = 0.0
        self.calls = 0
        self.modules = 0
        self.armed = False
        self.depth = 0
        self.timer: EventTimer | None = None
        self.paused = False
        self._started = 0.0
        #: (start, end) of each outermost forward not yet assigned to a batch.
        self.spans: list[tuple[float, float]] = []
        self._ready: list[float] = []
        self._hooked: list[tuple[torch.nn.Module, Any, Any]] = []
        self._entered: set[int] | None = set()  # None once keep_entered ran

    def attach(self, model: torch.nn.Module) -> int:
        """Hooks ``model``'s :func:`hook_targets` (after removing earlier hooks).

        Returns:
            The number of modules hooked.
        """
        self.detach()
        self.total_s, self.calls, self.depth, self.paused = 0.0, 0, 0, False
        self._ready, self.spans, self._entered = [], [], set()
        new_event = self.new_event or cuda_events(model)
        self.timer = None if new_event is None else EventTimer(new_event)
        self._hooked = [self._hook(module) for module in hook_targets(model)]
        self.modules, self.armed = len(self._hooked), True
        return self.modules

    def detach(self) -> None:
        """Removes every hook and forgets the modules; safe to call twice."""
        for _, enter, leave in self._hooked:
            enter.remove()
            leave.remove()
        self._hooked.clear()
        self.armed = False
        self._entered = set()
        self.modules = 0

    def arm(self, on: bool) -> None:
        """Puts the hooks back on the modules (``on``) or takes them off, keeping the modules.

        A module with no hooks takes PyTorch's fast call path, and a forward while
        unarmed costs nothing: a caller that times only some batches arms the clock
        at their start and disarms it at the next batch's. Outside any forward only.

        The hooks keep the ids :meth:`attach` registered them under: this puts them
        in (or takes them out of) the module's hook dicts, a tenth of the cost of
        registering them again, in the same order after any hook registered first.
        """
        if on == self.armed:
            return
        self.armed = on
        if on:
            self.depth = 0  # a forward that raised while unarmed is forgotten
            enter, leave = self._enter, self._leave
            for module, entering, leaving in self._hooked:
                pre, post, always = forward_hook_dicts(module)
                pre[entering.id] = enter
                post[leaving.id] = leave
                always[leaving.id] = True
            return
        for module, entering, leaving in self._hooked:
            pre, post, always = forward_hook_dicts(module)
            pre.pop(entering.id, None)
            post.pop(leaving.id, None)
            always.pop(leaving.id, None)

    def _hook(self, module: torch.nn.Module) -> tuple[torch.nn.Module, Any, Any]:
        enter = module.register_forward_pre_hook(self._enter)
        leave = module.register_forward_hook(self._leave, always_call=True)
        return module, enter, leave

    def keep_entered(self) -> int:
        """Removes the hooks of modules never called from outside every hooked module.

        The model and its children are hooked because a loop may call either
        (Lightning's ``training_step`` calls submodules); once the loop has run a
        few batches, the hooks of modules only ever called inside another hooked
        one only count depth, yet each makes PyTorch take its slower call path.
        Nothing is removed before a hooked forward has run.

        Returns:
            The number of modules still hooked.
        """
        entered = self._entered
        if not entered:
            return self.modules
        self._entered = None  # learned: the hooks stop recording which module they enter
        kept = []
        for module, enter, leave in self._hooked:
            if id(module) in entered:
                kept.append((module, enter, leave))
            else:
                enter.remove()
                leave.remove()
        self._hooked = kept
        self.modules = len(kept)
        return self.modules

    def close_batch(self, start: float, end: float, keep: bool = True) -> float:
        """Closes the batch that ran from ``start`` to ``end`` (``time.perf_counter()``).

        Its forwards are the outermost hooked forwards that started in it; their
        time is handed out by :meth:`ready` when ``keep``. Forwards before
        ``start`` (outside any batch) are forgotten. May run on another thread
        than the hooks, after the batch (the hooks only append later spans).

        Returns:
            The host seconds of the batch's forwards.
        """
        spans, taken, host = self.spans, 0, 0.0
        for began, ended in spans:
            if began > end:
                break
            taken += 1
            if began >= start:
                host += ended - began
        del spans[:taken]
        if self.timer is not None:
            self.timer.close_batch(start, end, keep)
        elif keep:
            self._ready.append(host)
        return host

    def ready(self) -> list[float]:
        """Forward seconds of each ended batch whose time is known now, oldest first (once).

        On the host that is every ended batch; with device events, those whose
        events have completed (the rest come in a later call).
        """
        if self.timer is not None:
            return self.timer.ready()
        ready, self._ready = self._ready, []
        return ready

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling():
            return
        if self.depth == 0:
            if self.paused:
                return
            if self._entered is not None:
                self._entered.add(id(module))
            self._started = started = perf_counter()
            if self.timer is not None:
                self.timer.record(started)
        self.depth += 1

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.depth == 0 or is_compiling():
            return
        self.depth -= 1
        if self.depth == 0:
            ended = perf_counter()
            if self.timer is not None:
                self.timer.record(ended)
            self.total_s += ended - self._started
            self.calls += 1
            self.spans.append((self._started, ended))
