"""Pure decisions of a proven deadlock: wait points, the user's own frame, the split.

Nothing here touches a thread, a file or a process group.
:mod:`rankguard.callbacks.hang.hang_watchdog` samples the stuck rank's stack and
sends what these functions return; ``docs/hang.md`` explains the rule.
"""

from __future__ import annotations

import hashlib
import itertools
import linecache
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import rankguard
from rankguard.callbacks.core import background_exchange, side_channel
from rankguard.callbacks.core.ranks import group_ranks, rank_label

if TYPE_CHECKING:
    from rankguard.callbacks.hang.diagnosis import RankStatus

__all__ = [
    "DEADLOCK_EXIT_CODE",
    "LEFT_LOOP",
    "NAMES_DECISION",
    "RENDEZVOUS_CALLS",
    "STOP_FIXES",
    "called_from_user",
    "deadlock_key",
    "describe_deadlock",
    "left_at",
    "library_paths",
    "odd_rank",
    "rendezvous",
    "split_sentence",
    "user_frame",
]

#: Exit code of every rank on a proven deadlock: the code path differs between ranks, so a
#: restart replays it; 70 is EX_SOFTWARE ("fix the code", where 75 says "restart me").
DEADLOCK_EXIT_CODE = 70

#: The wait point of a rank whose fit ended (``waits_at``): it left the training loop and
#: can never reach a rendezvous the others wait at in it.
LEFT_LOOP = "left the training loop"

#: Per stop decision (its name in ``decisions``, as each framework calls it), how to make
#: it on every rank alike; a rank that left the loop with none set gets the general advice.
STOP_FIXES = {
    "should_stop": (
        "reduce the decision across ranks, e.g. Lightning's "
        "`trainer.strategy.reduce_boolean_decision`, or base it on a metric synced across ranks"
    ),
    "should_training_stop": (
        "reduce the metric across ranks before deciding, e.g. `EarlyStoppingCallback` on the "
        "metrics `trainer.evaluate()` returns, already gathered from every rank, or set "
        "`control.should_training_stop` on every rank alike"
    ),
}
_STOP_FIX = "reduce the decision across ranks, or base it on a metric synced across ranks"

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
#: DDP's buffer broadcast at the start of each forward (``broadcast_buffers=True``).
_DDP_BROADCAST = (
    os.path.join("torch", "nn", "parallel", "distributed.py"),
    "_distributed_broadcast_coalesced",
)
_TORCH = os.sep + os.path.join("torch", "")
_BACKWARD = (os.path.join("torch", "autograd", "graph.py"), "_engine_run_backward")
#: rankguard's own code (the package, wherever it is installed): never the user's frame.
_RANKGUARD = (os.path.dirname(os.path.abspath(rankguard.__file__)) + os.sep,)
#: Frames skipped before the innermost one is read: locks, events, the watchdog itself.
_MACHINERY = ("threading.py", "hang_watchdog.py", "c10d_logger.py")
_SOURCE_CHARS = 80
#: rankguard's wrapper of each ``torch.distributed`` collective (its record of collectives):
#: part of the collective a thread waits in, never its caller.
RECORDER_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives.py")
#: Code where a thread waits in a rankguard check's exchange: the exchange itself, or the
#: verdict of one a background thread runs for it.
EXCHANGE_CODE = (side_channel.__file__, background_exchange.__file__)

Frames = Sequence[tuple[str, int, str]]


def _skip_machinery(stack: Frames) -> list[tuple[str, int, str]]:
    return list(itertools.dropwhile(lambda f: os.path.basename(f[0]) in _MACHINERY, stack))


def rendezvous(stack: Frames) -> str | None:
    """The rendezvous a thread waits at, from its innermost frame, or ``None``.

    Narrower than :func:`~rankguard.callbacks.hang.diagnosis.blocked_in`: only
    a ``torch.distributed`` collective or barrier (not, say, a checkpoint
    writer under ``torch/distributed``), rankguard's own exchange, or
    autograd's engine (under DDP and FSDP, backward all-reduces gradients)
    or DDP's buffer broadcast before a forward count, since only these can
    wait forever for a rank that went elsewhere.

    Args:
        stack: The thread's frames ``(file, line, function)``, innermost first.

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
    if filename.endswith(_DDP_BROADCAST[0]) and function == _DDP_BROADCAST[1]:
        return "broadcast"
    return None


def library_paths() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, site-packages, rankguard."""
    scheme = sysconfig.get_paths()  # about 0.5 ms a call: once, not once a key
    paths = {scheme[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    paths.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    paths.add(os.path.dirname(os.__file__))
    paths.discard("")
    folders = tuple(os.path.join(os.path.abspath(p), "") for p in paths)
    return (*folders, *_RANKGUARD, sys.prefix + os.sep + "lib" + os.sep)


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
        if filename.startswith("<") or os.path.abspath(filename).startswith(libraries):
            continue
        where = f"{os.path.basename(filename)}:{line} ({function})"
        text = linecache.getline(filename, line).strip() if source else ""
        if len(text) > _SOURCE_CHARS:
            text = text[: _SOURCE_CHARS - 3] + "..."
        return f"{where}: {text}" if text else where
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
        return not (filename.startswith("<") or os.path.abspath(filename).startswith(libraries))
    return False


def _left(status: RankStatus) -> bool:
    return status.waits_at == LEFT_LOOP


def _stop(status: RankStatus) -> tuple[str, int | None] | None:
    """The stop decision this rank holds set (its name and step), or ``None``."""
    for name, value, step in status.decisions:
        if name in STOP_FIXES and value is True:
            return name, step
    return None


def _stopped(status: RankStatus) -> bool:
    return _stop(status) is not None


def _point(status: RankStatus) -> str:
    if _left(status):  # wherever its code went since: the same wait point at every exchange
        return LEFT_LOOP
    where = f" at {status.user_frame}" if status.user_frame else ""
    return f"{status.waits_at}{where}"


def deadlock_key(statuses: Mapping[int, RankStatus]) -> str | None:
    """A fingerprint of a proven deadlock's state, or ``None`` when there is none.

    Every rank must be waiting at a rendezvous (``waits_at``) for at least its
    settle time (``settled``), and the ranks must not all wait at the same one
    (wait point and the user's frame): then no rank can ever go on. A rank
    whose fit ended (:data:`LEFT_LOOP`) counts as waiting elsewhere: while
    another rank waits at a rendezvous of the loop it left, that rendezvous
    never completes (every rank having left is a normal end). A rank
    that computes, loads, saves or runs user code is not at a rendezvous, so
    a slow rank never makes a deadlock. Two exchanges in a row, a second
    apart, with the same fingerprint (same progress counters, same wait
    points) prove it; one is only a suspicion, since a rank's status may be
    older than another's.

    Args:
        statuses: Every rank's status.

    Returns:
        A short digest of each rank's progress counter and wait point.
    """
    if len(statuses) < 2 or not all(s.settled and s.waits_at for s in statuses.values()):
        return None
    if len({_point(s) for s in statuses.values()}) < 2:
        return None
    state = repr(sorted((r, s.progress, _point(s)) for r, s in statuses.items()))
    return hashlib.sha1(state.encode()).hexdigest()[:16]


def left_at(status: RankStatus) -> str:
    """A rank that left the loop, in words, with the decisions it holds set (a save excepted).

    E.g. ``"left the training loop at step 5 (should_stop set)"``.
    """
    reasons = [f"{name} set" for name, value, _ in status.decisions if value is True]
    reasons = [r for r in reasons if r != "save set"]
    why = f" ({', '.join(reasons)})" if reasons else ""
    return f"{LEFT_LOOP} at step {status.step}{why}"


def odd_rank(statuses: Mapping[int, RankStatus]) -> int:
    """The rank to look at first: its wait point differs from the others' usual one.

    A rank that left the training loop while the others wait in it comes
    first, then one that set a stop decision (:data:`STOP_FIXES`) while
    others did not (its stop decision split them). Else the smallest group of
    ranks sharing a wait point is the odd one; among
    equal groups, one whose rendezvous the user's own code calls (``direct``),
    then one whose wait point its own rank had seen before in a
    healthy sample (``usual``) is less likely the cause, and so are backward
    and rankguard's own exchanges, where ranks wait every step or epoch.
    """
    for alone in (_left, _stopped):
        ranks = sorted(r for r, s in statuses.items() if alone(s))
        if ranks and len(ranks) < len(statuses):
            return ranks[0]
    groups = group_ranks({r: _point(s) for r, s in statuses.items()})

    def score(group: tuple[list[int], str]) -> tuple[int, int, int, int, int]:
        ranks, _ = group
        sample = statuses[ranks[0]]
        routine = sample.waits_at in ("backward", "rankguard exchange")
        usual = all(statuses[r].usual for r in ranks)
        return (len(ranks), int(not sample.direct), int(usual), int(routine), ranks[0])

    return min(groups, key=score)[0][0]


def split_sentence(statuses: Mapping[int, RankStatus]) -> str | None:
    """The decision that split the ranks, in one sentence, where the adapters saw one.

    Each status carries ``decisions``: ``(name, value, step)`` of the facts an
    adapter reports cheaply (``should_stop``, ``should_training_stop``, the
    metric names logged with cross-rank sync in a step, ``save`` entered, the
    names a framework reduces, ``names:<reduction>``).
    The first name whose value differs between ranks is told, e.g. ``"rank 0
    set should_stop at step 83; rank 1 did not."``
    """
    names = {name for s in statuses.values() for name, _, _ in s.decisions}
    for name in sorted(names - set(_CONTEXT.values())):
        context = _CONTEXT.get(name)
        if context and len({_decision(s, context)[0] for s in statuses.values()}) > 1:
            continue  # read in different loops (training, validation): not comparable
        values = {r: _decision(s, name) for r, s in statuses.items()}
        # Not set and not reported read alike ("did not"): no split between them.
        said = {r: None if v is False or v == () else v for r, (v, _) in values.items()}
        if len(set(said.values())) < 2:
            continue
        groups = group_ranks(said)
        parts = []
        for ranks, value in groups[:4]:
            # The keys logged in the step each rank is in now, not when they last changed.
            step = statuses[ranks[0]].step if name == "sync_dist_keys" else values[ranks[0]][1]
            parts.append(_tell(name, value, step, rank_label(ranks)))
        return "; ".join(parts) + "."
    return None


#: The prefix of a decision holding the names a reduction check saw a rank reduce
#: (``names:composer_loss``, see hang/metric_reductions.py).
NAMES_DECISION = "names:"
#: Decisions told only between ranks that agree on their context (``sync_dist_loop``: the
#: loop the keys were logged in); the context itself is never told.
_CONTEXT = {"sync_dist_keys": "sync_dist_loop"}


def _decision(status: RankStatus, name: str) -> tuple[object, int | None]:
    for key, value, step in status.decisions:
        if key == name:
            return value, step
    return None, None


def _tell(name: str, value: object, step: int | None, who: str) -> str:
    at = f" at step {step}" if step is not None else ""
    if name == "sync_dist_keys":
        keys = ", ".join(sorted(value)) if value else "none"
        return f"{who} logged with sync_dist=True{at}: {keys}"
    if name == "save" and value is True:
        return f"{who} entered a checkpoint save{at}"
    if name.startswith(NAMES_DECISION):
        return f"{who} reduced {', '.join(value) if value else 'nothing'}{at}"
    if value is True:
        return f"{who} set {name}{at}"
    if value in (False, None):
        return f"{who} did not"
    return f"{who} had {name}={value!r}{at}"


def describe_deadlock(statuses: Mapping[int, RankStatus]) -> tuple[str, tuple[str, ...], int]:
    """The summary, detail lines and the rank to look at first for a proven deadlock."""
    left = {r: s for r, s in statuses.items() if _left(s)}
    groups = group_ranks({r: (s.phase, _point(s)) for r, s in statuses.items() if r not in left})
    parts = [
        f"{rank_label(ranks)} waiting {statuses[ranks[0]].wait_s:.0f} s in {point} ({phase})"
        for ranks, (phase, point) in groups[:8]
    ]
    first = odd_rank(statuses)
    split = split_sentence(statuses)
    if left:
        gone = group_ranks({r: left_at(s) for r, s in left.items()})
        parts = [
            f"{rank_label(ranks)} {where} {left[ranks[0]].wait_s:.0f} s ago"
            for ranks, where in gone[:8]
        ] + parts
        summary = (
            f"deadlock, {rank_label(sorted(left))} left the training loop while the others wait "
            "at a rendezvous in it: " + "; ".join(parts)
        )
    else:
        summary = "deadlock, every rank waits at a rendezvous the others never reach: " + (
            "; ".join(parts)
        )
    details = []
    if split:
        details.append(f"What split them: {split}")
    if first in left or _stopped(statuses[first]):
        status = statuses[first]
        stop = _stop(status)
        did = left_at(status)
        if first not in left and stop is not None:
            did = f"set {stop[0]} at step {stop[1]}"
        fix = STOP_FIXES[stop[0]] if stop is not None else _STOP_FIX
        details.append(
            f"Next: fix the stop decision of rank {first}: it {did} while "
            "the others went on, so their next collective never completes. Decide to stop on "
            f"every rank alike ({fix}). A restart would replay it: exit code "
            f"{DEADLOCK_EXIT_CODE}, do not restart."
        )
        return summary, tuple(details), first
    details.append(
        f"Next: fix the code path at rank {first}'s wait point ({_point(statuses[first])}): it "
        "runs on some ranks only (a collective under `if rank == 0`, a metric or a stop "
        "decision of one rank). A restart would replay it: exit code "
        f"{DEADLOCK_EXIT_CODE}, do not restart."
    )
    return summary, tuple(details), first
