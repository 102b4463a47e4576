"""A hand-written loop's backward passes and optimizer steps, announced in the step log.

A loop has no hook at its backward: ``torch.autograd.backward`` (which ``Tensor.backward``
calls, and with it Accelerate's, a grad scaler's and Lightning Fabric's) is wrapped while a
fit runs, for the thread that runs it, and the optimizer given to ``guard.fit`` gets a step
pre-hook. See docs/integrations.md#what-the-wrappers-infer.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from rankguard.callbacks.core.step_log import BACKWARD, BACKWARD_END, OPTIMIZER_STEP, StepLog

__all__ = ["announce_phases"]

#: The step log of the fit each thread runs (only those threads' backward passes are told).
_LOGS: dict[int, StepLog] = {}
#: Threads inside a backward they announced (a backward inside it, as reentrant activation
#: checkpointing runs, is part of it).
_INSIDE: set[int] = set()
_LOCK = threading.Lock()
#: While wrapped: ``torch.autograd.backward`` as it was, and the wrapper put in its place.
_ORIGINAL: list[Callable[..., Any]] = []
_WRAPPER: list[Callable[..., Any]] = []


def _announcing(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.backward`` that announces its start and end to the thread's step log.

    Named ``backward`` as what it wraps: a report's call site of a wait in backward skips
    wrappers of the call's own name (``stacks.blocked_in``), so it names the user's line.
    """

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        ident = threading.get_ident()
        log = _LOGS.get(ident)
        if log is None or ident in _INSIDE:
            return original(*args, **kwargs)
        _INSIDE.add(ident)
        log.backward()
        try:
            return original(*args, **kwargs)
        finally:
            _INSIDE.discard(ident)
            log.backward_end()

    return backward


def announce_phases(
    steps: StepLog, optimizer: Any = None
) -> tuple[tuple[str, ...], Callable[[], None]]:
    """Announces this thread's backward passes (and ``optimizer``'s steps) in ``steps``.

    One wrapper whatever the number of fits (one per thread): the first fit wraps
    ``torch.autograd.backward``, the last to end puts it back, unless another wrapper
    was put over it since (then it stays, passing every call through).

    Returns:
        The parts announced (``step_log.SUBPHASES`` names, for ``EventFacts.phases``), and
        the undo (safe to call twice).
    """
    ident = threading.get_ident()
    with _LOCK:
        if not _LOGS and not _ORIGINAL:
            _ORIGINAL.append(torch.autograd.backward)
            _WRAPPER.append(_announcing(_ORIGINAL[0]))
            torch.autograd.backward = _WRAPPER[0]
        _LOGS[ident] = steps
    handle = None
    announced: tuple[str, ...] = (BACKWARD, BACKWARD_END)
    if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
        handle = optimizer.register_step_pre_hook(lambda *_: steps.optimizer_step())
        announced += (OPTIMIZER_STEP,)
    done = threading.Event()

    def undo() -> None:
        if done.is_set():
            return
        done.set()
        if handle is not None:
            handle.remove()
        with _LOCK:
            if _LOGS.get(ident) is steps:
                del _LOGS[ident]
            if not _LOGS and _WRAPPER and torch.autograd.backward is _WRAPPER[0]:
                torch.autograd.backward = _ORIGINAL.pop()  # nothing was put over it since
                _WRAPPER.pop()

    return announced, undo
