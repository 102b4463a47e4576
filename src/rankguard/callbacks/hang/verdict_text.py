"""The words of a hang verdict: its summary, details, what split the ranks, and "Next".

Pure text from plain values; :mod:`rankguard.callbacks.hang.verdict` decides what is told.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rankguard.callbacks.core.events import SplitDecision
from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.collective_compare import (
    UNDESCRIBED,
    Difference,
    GroupRecord,
    Issued,
    describe_difference,
    describe_issued,
    differences,
    group_label,
    origin_text,
)
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, LEFT_LOOP, RankStatus

__all__ = [
    "NAMES_DECISION",
    "describe_deadlock",
    "describe_desync",
    "describe_frozen",
    "flight_recorder_note",
    "gave_up_lines",
    "grouped",
    "left_at",
    "nccl_timeout_advice",
    "next_step",
    "phase_label",
    "point",
    "record_lines",
    "split_sentence",
    "stop_of",
    "stuck_lines",
    "where_lines",
]

#: At most this many stuck ranks are described one by one; the rest as ranges.
MAX_DETAILED = 16
#: At most this many groups of ranks are listed in one line.
MAX_GROUPS = 8
#: The prefix of a decision holding the names a reduction check saw a rank reduce
#: (``names:<reduction>``, see hang/metric_reductions.py).
NAMES_DECISION = "names:"
#: The fix after a stop decision whose adapter gave none.
_STOP_FIX = "reduce the decision across ranks, or base it on a metric synced across ranks"
_REPLAYS = f"A restart would replay it: exit code {DEADLOCK_EXIT_CODE}, do not restart."


def phase_label(event: str, step: int, batch_index: int | None, loader: str | None) -> str:
    """Renders a heartbeat as a phase a person reads, e.g. ``"eval batch 3 of 'eval'"``."""
    of = f" of {loader!r}" if loader is not None else ""
    labels = {
        "fit_start": "fit start",
        "epoch_start": f"epoch start at step {step}",
        "data_fetch_start": f"data fetch for train batch {step}",
        "data_fetch_end": f"after data fetch for train batch {step}",
        "train_batch_start": f"train batch {step}",
        "train_batch_end": f"after train batch {step}",
        "eval_start": f"eval start{of}",
        "eval_batch_start": f"eval batch {batch_index}{of}",
        "eval_batch_end": f"after eval batch {batch_index}{of}",
        "eval_end": f"after eval{of}",
        "checkpoint_save_start": f"checkpoint save at step {step}",
        "checkpoint_save_end": f"after checkpoint save at step {step}",
        "fit_end": "fit end",
    }
    return labels.get(event, event.replace("_", " "))


def grouped(statuses: Mapping[int, RankStatus], template: str) -> list[str]:
    """One part per group of ranks in the same phase and call, the longest idle first.

    ``template``'s fields: ``who``, ``idle``, ``phase``, ``in_phase`` (``"in train batch
    5"``, or ``"left the training loop at step 5"``), ``limits``, ``where``, ``and_where``.
    """
    parts = []
    groups = group_ranks({rank: (s.phase, s.blocked_in) for rank, s in statuses.items()})
    groups.sort(key=lambda g: -max(statuses[r].idle_s for r in g[0]))
    for ranks, (phase, blocked) in groups[:MAX_GROUPS]:
        sample = max((statuses[r] for r in ranks), key=lambda s: s.idle_s)
        parts.append(
            template.format(
                who=rank_label(ranks),
                idle=sample.idle_s,
                phase=phase,
                in_phase=phase if phase.startswith(LEFT_LOOP) else f"in {phase}",
                limits=sample.limits(),
                where=f" (blocked in {blocked})" if blocked else "",
                and_where=f"; blocked in {blocked}" if blocked else "",
            )
        )
    if len(groups) > MAX_GROUPS:
        parts.append(f"... {len(groups) - MAX_GROUPS} more groups")
    return parts


def gave_up_lines(gave_up: Sequence[tuple[str, tuple[int, ...], float]]) -> tuple[str, ...]:
    """Per exchange a check gave up waiting in: the ranks that never came, and the fix."""
    return tuple(
        f"{rank_label(ranks)} did not reach rankguard exchange {name!r} within {timeout:g} s; "
        "the ranks waiting there gave up, so the incident ends now, before the ceiling (if "
        f"{'it is' if len(ranks) == 1 else 'they are'} only slow there, raise that check's "
        "timeout: `exchange_timeout_s`, or `batch_parity_guard`'s `eval_end_timeout_s` after "
        "eval)."
        for name, ranks, timeout in gave_up
    )


def stuck_lines(stuck: Mapping[int, RankStatus]) -> tuple[str, ...]:
    """One line per stuck rank: host, pid, phase, how long without progress, its limits."""
    return tuple(
        f"rank {r}: host {s.host}, pid {s.pid}, {s.phase} (step {s.step}), "
        f"no progress for {s.idle_s:.1f} s, {s.limits()}"
        + (f", blocked in {s.blocked_in}" if s.blocked_in else "")
        for r, s in sorted(stuck.items())[:MAX_DETAILED]
    )


def record_lines(records: Mapping[int, Sequence[GroupRecord]]) -> tuple[str, ...]:
    """Per group whose records differ: each rank's count and the first collective that differs."""
    if not records:
        return ()
    return tuple(
        f"Collectives issued: {describe_difference(records, d)}" for d in differences(records)
    )


def where_lines(statuses: Mapping[int, RankStatus]) -> tuple[str, ...]:
    """Per group of ranks: the user's own frame and the framework call it is blocked in."""
    groups = group_ranks({r: (s.user_frame, s.blocked_in) for r, s in statuses.items()})
    lines = []
    for ranks, (frame, blocked) in groups[:MAX_GROUPS]:
        if frame is None and blocked is None:
            continue
        own = f"your code at {frame}" if frame else "no frame of your own code"
        lines.append(f"{rank_label(ranks)}: {own}" + (f"; blocked in {blocked}" if blocked else ""))
    if len(groups) > MAX_GROUPS:
        lines.append(f"... {len(groups) - MAX_GROUPS} more groups")
    return tuple(lines)


def point(status: RankStatus) -> str:
    """A rank's wait point: the rendezvous and the user's frame that called it."""
    if status.left:  # wherever its code went since: the same wait point at every exchange
        return LEFT_LOOP
    where = f" at {status.user_frame}" if status.user_frame else ""
    return f"{status.waits_at}{where}"


def stop_of(
    status: RankStatus, words: Mapping[str, SplitDecision]
) -> tuple[str, int | None] | None:
    """The stop decision this rank holds set (its name and step), or ``None``."""
    for name, value, step in status.decisions:
        said = words.get(name)
        if said is not None and said.fix is not None and value is True:
            return name, step
    return None


def left_at(status: RankStatus) -> str:
    """A rank that left the loop, in words, with the decisions it holds set (a save excepted).

    E.g. ``"left the training loop at step 5 (stop set)"``.
    """
    reasons = [f"{name} set" for name, value, _ in status.decisions if value is True]
    reasons = [r for r in reasons if r != "save set"]
    why = f" ({', '.join(reasons)})" if reasons else ""
    return f"{LEFT_LOOP} at step {status.step}{why}"


def _decision(status: RankStatus, name: str) -> tuple[object, int | None]:
    for key, value, step in status.decisions:
        if key == name:
            return value, step
    return None, None


def _tell(name: str, value: object, step: int | None, who: str, said: SplitDecision | None) -> str:
    at = f" at step {step}" if step is not None else ""
    if name.startswith(NAMES_DECISION):
        return f"{who} reduced {', '.join(value) if value else 'nothing'}{at}"  # type: ignore[arg-type]
    if value in (False, None):
        return f"{who} did not"
    if said is not None and said.told is not None:
        names = ", ".join(sorted(value)) if isinstance(value, tuple | list | frozenset) else value
        return f"{who} {said.told.format(name=name, value=names or 'none', at=at)}"
    if name == "save" and value is True:
        return f"{who} entered a checkpoint save{at}"
    if value is True:
        return f"{who} set {name}{at}"
    return f"{who} had {name}={value!r}{at}"


def split_sentence(
    statuses: Mapping[int, RankStatus], words: Mapping[str, SplitDecision] | None = None
) -> str | None:
    """The decision that split the ranks, in one sentence, where the adapters saw one.

    Each status carries ``decisions``: ``(name, value, step)`` of the facts an
    adapter reports cheaply (a stop decision, the metric names synced in a step,
    ``save`` entered, the names a framework reduces, ``names:<reduction>``); the
    adapter's :class:`~rankguard.callbacks.core.events.SplitDecision` says how
    each is told. The first name whose value differs between ranks is told, the
    ranks that did it first, e.g. ``"rank 0 set stop at step 83; rank 1 did not."``
    """
    words = words or {}
    contexts = {w.context for w in words.values() if w.context}
    names = {name for s in statuses.values() for name, _, _ in s.decisions}
    for name in sorted(names - contexts):
        said = words.get(name)
        context = said.context if said is not None else None
        if context and len({_decision(s, context)[0] for s in statuses.values()}) > 1:
            continue  # read in different loops (training, validation): not comparable
        values = {r: _decision(s, name) for r, s in statuses.items()}
        # Not set and not reported read alike ("did not"): no split between them.
        told = {r: None if v is False or v == () else v for r, (v, _) in values.items()}
        if len(set(told.values())) < 2:
            continue
        groups = sorted(group_ranks(told), key=lambda g: (g[1] is None, g[0][0]))
        parts = []
        for ranks, value in groups[:4]:
            now = said is not None and said.now
            step = statuses[ranks[0]].step if now else values[ranks[0]][1]
            parts.append(_tell(name, value, step, rank_label(ranks), said))
        return "; ".join(parts) + "."
    return None


def describe_deadlock(
    statuses: Mapping[int, RankStatus], first: int, words: Mapping[str, SplitDecision]
) -> tuple[str, tuple[str, ...]]:
    """The summary and detail lines of a deadlock proven from where every rank waits."""
    left = {r: s for r, s in statuses.items() if s.left}
    groups = group_ranks({r: (s.phase, point(s)) for r, s in statuses.items() if r not in left})
    parts = [
        f"{rank_label(ranks)} waiting {statuses[ranks[0]].wait_s:.0f} s in {where} ({phase})"
        for ranks, (phase, where) in groups[:MAX_GROUPS]
    ]
    if left:
        gone = group_ranks({r: left_at(s) for r, s in left.items()})
        parts = [
            f"{rank_label(ranks)} {where} {left[ranks[0]].wait_s:.0f} s ago"
            for ranks, where in gone[:MAX_GROUPS]
        ] + parts
        summary = (
            f"deadlock, {rank_label(sorted(left))} left the training loop while the others wait "
            "at a rendezvous in it: " + "; ".join(parts)
        )
    else:
        summary = "deadlock, every rank waits at a rendezvous the others never reach: " + (
            "; ".join(parts)
        )
    split = split_sentence(statuses, words)
    details = [f"What split them: {split}"] if split else []
    status = statuses[first]
    stop = stop_of(status, words)
    if first in left or stop is not None:
        did = left_at(status)
        if first not in left and stop is not None:
            did = f"set {stop[0]} at step {stop[1]}"
        fix = words[stop[0]].fix if stop is not None else _STOP_FIX
        details.append(
            f"Next: fix the stop decision of rank {first}: it {did} while the others went on, "
            "so their next collective never completes. Decide to stop on every rank alike "
            f"({fix}). {_REPLAYS}"
        )
        return summary, tuple(details)
    details.append(
        f"Next: fix the code path at rank {first}'s wait point ({point(status)}): it runs on "
        "some ranks only (a collective under `if rank == 0`, a metric or a stop decision of "
        f"one rank). {_REPLAYS}"
    )
    return summary, tuple(details)


def describe_desync(
    records: Mapping[int, Sequence[GroupRecord]],
    proven: Sequence[Difference],
    first: Difference,
    odd: int,
) -> tuple[str, tuple[str, ...]]:
    """The summary and detail lines of a desync proven from what every rank issued."""
    issued = first.issued.get(odd)
    call = describe_issued(issued) if issued is not None else UNDESCRIBED
    counts = dict(first.counts)  # once: rebuilt per member, it made this the square of the world
    never = [r for r in first.members if counts.get(r, 0) < first.seq]
    calls = {r: i for r, i in first.issued.items() if i is not None}
    what = (
        f"rank {odd} issued collective #{first.seq} of {group_label(first)}, {call}, which "
        f"{rank_label(never)} never issued"
        if first.kind == "count"
        else f"collective #{first.seq} of {group_label(first)} is a different call on "
        "different ranks: "
        + "; ".join(
            f"{rank_label(ranks)}: {_call(calls[ranks[0]])}"
            for ranks, _ in group_ranks({r: _call(i) for r, i in calls.items()})[:MAX_GROUPS]
        )
    )
    summary = f"desync, every rank waits for a collective another never issued: {what}"
    details = tuple(f"Collectives issued: {describe_difference(records, d)}" for d in proven)
    framework = all(i.origin is not None for i in calls.values())
    if first.kind == "call" and calls and framework and issued is not None:
        return summary, (*details, _framework_fix(first, odd, calls))
    fix = (
        f"Next: fix the code path that issued rank {odd}'s {issued.op} "
        if issued is not None
        else f"Next: fix the code path of rank {odd} "
    )
    details += (
        fix + f"(collective #{first.seq} of {group_label(first)}): it runs on some ranks "
        "only, or issues a different collective on some (a metric recorded on some ranks, "
        f"a collective under `if rank == 0`, collectives issued in a different order). {_REPLAYS}",
    )
    return summary, details


def _call(issued: Issued) -> str:
    """A collective in a few words: its op, size and what issued it (else the user's line)."""
    if issued.origin is None:
        return describe_issued(issued)
    return describe_issued(issued._replace(where=None)).split(", thread ")[0]


def _framework_fix(first: Difference, odd: int, calls: Mapping[int, Issued]) -> str:
    """The "Next" line where DDP or FSDP issued the unlike calls: forwards and backwards."""
    mine = calls[odd]
    others = [r for r, i in calls.items() if _call(i) != _call(mine)]
    theirs = calls[others[0]] if others else mine
    return (
        f"Next: rank {odd} issued {origin_text(mine) or mine.op} where {rank_label(others)} "
        f"issued {origin_text(theirs) or theirs.op} (collective #{first.seq} of "
        f"{group_label(first)}): the ranks ran their forwards and backwards in a different "
        "order. Make every rank run the same forwards and backwards, in the same order: a "
        "`continue` or an `if` that skips `loss.backward()` on some ranks, a forward more on "
        "some (for logging, a retry, an eval outside `torch.no_grad()`), a different number "
        f"of microbatches per step. {_REPLAYS}"
    )


def describe_frozen(ranks: list[int], waited_s: float, phases: str | None) -> str:
    """One line for ranks that stopped answering on the side channel."""
    seen = f"last seen: {phases}" if phases is not None else "never seen by the watchdog"
    return (
        f"{rank_label(ranks)} frozen or dead (no answer on the side channel for "
        f"{waited_s:.0f} s; {seen})"
    )


def next_step(first: int | None, frozen: Sequence[int]) -> str:
    """What to look at first, for the report of a stall or a lost rank."""
    if frozen:
        return (
            f"Next: on the host of {rank_label(frozen)}, look for an OOM kill (dmesg, the "
            "launcher's log), a stopped process, or one call that holds the interpreter (a "
            "C extension that keeps the GIL); `py-spy dump --pid PID` shows the stack of a "
            "live one."
        )
    return (
        f"Next: read rank{first}.txt (the rank that stopped first): the frame its training "
        "loop is in is the cause; ranks waiting in a collective are blocked on it. If that rank "
        "is only slow, raise the deadline shown."
    )


def nccl_timeout_advice(
    nccl_timeout_s: float | None, deadlines: Mapping[str, float], detect_s: float
) -> str | None:
    """Says whether NCCL's own timeout would end a hang before the watchdog reports it.

    Args:
        nccl_timeout_s: The training process group's timeout, or ``None`` if unknown.
        deadlines: The watchdog deadlines that apply after the first step, by
            argument name (e.g. ``{"timeout_s": 600}``).
        detect_s: Time the watchdog needs after a deadline to report
            (exchange period + exchange timeout).

    Returns:
        A warning with the fix, or ``None`` when the watchdog reports first.
    """
    if nccl_timeout_s is None or not deadlines:
        return None
    name, longest = max(deadlines.items(), key=lambda item: item[1])
    needed = longest + detect_s
    if nccl_timeout_s > needed:
        return None
    return (
        f"the NCCL process-group timeout ({nccl_timeout_s:g} s) is shorter than the time the "
        f"hang watchdog needs to report a hang (`{name}`={longest:g} s + {detect_s:g} s), so "
        "NCCL would end the job first without naming the stuck rank. Fix: raise the "
        f"process-group timeout above {math.ceil(needed)} s (the `timeout` of "
        "init_process_group, or your trainer's setting for it), or lower the watchdog's "
        f"`{name}`."
    )


def flight_recorder_note(env: Mapping[str, str], rank: int) -> str:
    """Where the NCCL flight recorder writes, or how to turn it on (for NCCL runs)."""
    size = env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0").strip()
    if size not in ("", "0"):
        prefix = env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
        dump = env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "0") == "1"
        when = "on NCCL timeout" if dump else "only if TORCH_NCCL_DUMP_ON_TIMEOUT=1 is also set"
        return (
            f"NCCL flight recorder is on (TORCH_NCCL_TRACE_BUFFER_SIZE={size}); it dumps the "
            f"last collectives of rank {rank} to {prefix}{rank} {when}."
        )
    return (
        "NCCL flight recorder is off: set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and "
        "TORCH_NCCL_DUMP_ON_TIMEOUT=1 to record each rank's last collectives "
        "(dumped to TORCH_NCCL_DEBUG_INFO_TEMP_FILE, default /tmp/nccl_trace_rank_<rank>)."
    )
