"""Where a thread is, read from its Python frames: one classifier for every hang decision.

A stack is ``(file, line, function)`` frames, innermost first. The rule that uses
what these functions return is in :mod:`rankguard.callbacks.hang.verdict`.
"""

from __future__ import annotations

import itertools
import linecache
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from typing import Any

import rankguard
from rankguard.callbacks.core import background_exchange, side_channel

__all__ = [
    "EXCHANGE_CODE",
    "RECORDER_CODE",
    "RENDEZVOUS_CALLS",
    "Frames",
    "blocked_in",
    "called_from_user",
    "code_name",
    "describe_frame",
    "library_paths",
    "rendezvous",
    "user_frame",
]

#: A stack as ``(file, line, function)`` frames, innermost first.
Frames = Sequence[tuple[str, int, str]]

#: ``torch.distributed`` functions whose frame, innermost, means the thread waits for peers.
RENDEZVOUS_CALLS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "_store_based_barrier",
    }
)
_C10D = os.path.join("torch", "distributed", "")
_TORCH = os.sep + os.path.join("torch", "")
#: Autograd's engine: under DDP and FSDP, backward reduces gradients from C++ hooks.
AUTOGRAD_CODE = os.path.join("torch", "autograd", "")
_BACKWARD = (os.path.join("torch", "autograd", "graph.py"), "_engine_run_backward")
#: DDP's buffer broadcast at the start of each forward (``broadcast_buffers=True``).
_DDP = os.path.join("torch", "nn", "parallel", "distributed.py")
_DDP_BROADCAST = "_distributed_broadcast_coalesced"
#: rankguard's own code (the package, wherever it is installed): never the user's frame.
_RANKGUARD = os.path.dirname(os.path.abspath(rankguard.__file__)) + os.sep
#: rankguard's wrapper of each ``torch.distributed`` collective (its record of collectives):
#: part of the collective a thread waits in, never its caller.
RECORDER_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives.py")
#: Code where a thread waits in a rankguard check's exchange: the exchange itself, or the
#: verdict of one a background thread runs for it.
EXCHANGE_CODE = (side_channel.__file__, background_exchange.__file__)
#: Frames skipped before the innermost one is read: locks and events, torch's logging
#: wrapper of collectives, and the watchdog's handler of a check's missing ranks (called
#: from inside the check's exchange) and its thread's (joined by the training thread).
_MACHINERY = ("threading.py", "c10d_logger.py", "hang_watchdog.py", "watchdog_thread.py")
#: rankguard's wrappers of the calls DDP makes (its buffer broadcast): skipped like the
#: machinery, so a thread waiting in DDP's broadcast reads as waiting there.
_FRAMEWORK_WRAPPERS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "collective_sources.py"
)
#: Code in which a thread waits for other ranks, in the wide sense of :func:`blocked_in`.
_PEER_WAIT_CODE = (_C10D, _DDP, *EXCHANGE_CODE, AUTOGRAD_CODE, RECORDER_CODE)
#: Functions Python gives frames of their own that a person does not call by name.
_NESTED = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>"})
_SOURCE_CHARS = 80


def code_name(code: Any) -> str:
    """A code object's function as a person names it: a comprehension's is its enclosing one.

    Python 3.11 runs a list comprehension in a frame named ``<listcomp>``; its
    qualified name holds the function it is written in (``reduce_metrics``).
    """
    name = code.co_name
    if name not in _NESTED:
        return name
    outer = getattr(code, "co_qualname", name).split(".")
    outer = [part for part in outer if part != "<locals>"][:-1]
    return outer[-1] if outer and outer[-1] not in _NESTED else name


def describe_frame(filename: str, line: int, function: str, source: bool = True) -> str:
    """``"train.py:107 (epoch_end): dist.all_reduce(t)"``: file, line, function, source."""
    where = f"{os.path.basename(filename)}:{line} ({function})"
    text = linecache.getline(filename, line).strip() if source else ""
    if len(text) > _SOURCE_CHARS:
        text = text[: _SOURCE_CHARS - 3] + "..."
    return f"{where}: {text}" if text else where


def _skip_machinery(stack: Frames) -> list[tuple[str, int, str]]:
    def machinery(frame: tuple[str, int, str]) -> bool:
        return os.path.basename(frame[0]) in _MACHINERY or frame[0] == _FRAMEWORK_WRAPPERS

    return list(itertools.dropwhile(machinery, stack))


def rendezvous(stack: Frames) -> str | None:
    """The rendezvous a thread waits at, from its innermost frame, or ``None``.

    Narrower than :func:`blocked_in`: only a ``torch.distributed`` collective
    or barrier (not, say, a checkpoint writer under ``torch/distributed``),
    rankguard's own exchange, autograd's engine (under DDP and FSDP, backward
    all-reduces gradients) or DDP's buffer broadcast before a forward, since
    only these can wait forever for a rank that went elsewhere.

    Returns:
        ``"all_reduce"``, ``"rankguard exchange"``, ``"backward"``, ... or ``None``.
    """
    stack = _skip_machinery(stack)
    if not stack:
        return None
    filename, _, function = stack[0]
    if filename in EXCHANGE_CODE:
        return "rankguard exchange"
    if filename.endswith(_BACKWARD[0]) and function == _BACKWARD[1]:
        return "backward"
    if _C10D in filename and function in RENDEZVOUS_CALLS:
        return function
    if filename.endswith(_DDP) and function == _DDP_BROADCAST:
        return "broadcast"
    return None


def _waits_for_peers(filename: str) -> bool:
    return any(marker in filename for marker in _PEER_WAIT_CODE)


def blocked_in(stack: Frames) -> str | None:
    """Names the cross-rank call a thread is blocked in, with its call site, or ``None``.

    ``None`` unless the innermost frame (past locks and events) is
    ``torch.distributed`` code (a collective, barrier or store wait), a
    rankguard check's exchange, or autograd's engine (``"backward"``); else
    the call and its call site, past wrappers of the same name, e.g.
    ``"all_reduce, called from trainer.py:3634 (_iter_dataloader)"``.
    """
    stack = _skip_machinery(stack)
    if not stack or not _waits_for_peers(stack[0][0]):
        return None
    call = stack[0][2]
    if stack[0][0] in EXCHANGE_CODE:
        call = "rankguard exchange"
    elif AUTOGRAD_CODE in stack[0][0]:
        call = "backward"
    callers = (
        f
        for f in stack
        if not _waits_for_peers(f[0]) and f[2] != call and f[0] != _FRAMEWORK_WRAPPERS
    )
    caller = next(callers, None)
    if caller is None:
        return call
    filename, line, function = caller
    return f"{call}, called from {os.path.basename(filename)}:{line} ({function})"


def library_paths() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, site-packages, rankguard."""
    scheme = sysconfig.get_paths()  # about 0.5 ms a call: once, not once a key
    paths = {scheme[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    paths.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    paths.add(os.path.dirname(os.__file__))
    paths.discard("")
    folders = tuple(os.path.join(os.path.abspath(p), "") for p in paths)
    return (*folders, _RANKGUARD, sys.prefix + os.sep + "lib" + os.sep)


def _is_library(filename: str, libraries: tuple[str, ...]) -> bool:
    return filename.startswith("<") or os.path.abspath(filename).startswith(libraries)


def user_frame(stack: Frames, libraries: Iterable[str], source: bool = True) -> str | None:
    """The innermost frame of the user's own code, with its source line.

    Args:
        stack: The thread's frames, innermost first.
        libraries: Folders that are not the user's code (:func:`library_paths`).
        source: Add the line's source text (read with :mod:`linecache`).

    Returns:
        E.g. ``"train.py:107 (epoch_end): dist.all_reduce(t)"``, or ``None``
        when every frame is library code.
    """
    libraries = tuple(libraries)
    for filename, line, function in stack:
        if not _is_library(filename, libraries):
            return describe_frame(filename, line, function, source)
    return None


def called_from_user(stack: Frames, libraries: Iterable[str]) -> bool:
    """Whether the rendezvous is called by the user's own code, not by a framework.

    A framework's collectives (a data fetch's, DDP's, a metric sync) are where
    every rank waits, step after step; one the user's code calls under a
    condition is the likely odd one.
    """
    libraries = tuple(libraries)
    for filename, _, _ in _skip_machinery(stack):
        if filename in EXCHANGE_CODE or _TORCH in filename or filename == RECORDER_CODE:
            continue
        return not _is_library(filename, libraries)
    return False
