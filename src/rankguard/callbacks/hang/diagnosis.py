"""Pure decisions of the HangWatchdog: phases, the cross-rank verdict, NCCL advice.

Nothing here touches a thread, a file or a process group, so every rule is
unit-tested with plain values. :mod:`rankguard.callbacks.hang.hang_watchdog` wires
them to a background thread and the side channel;
:mod:`rankguard.callbacks.hang.calibration` sets the deadlines.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.collective_compare import (
    Desync,
    GroupRecord,
    describe_difference,
    differences,
    mismatch_warning,
    record_desync,
)
from rankguard.callbacks.hang.deadlock import (
    EXCHANGE_CODE,
    RECORDER_CODE,
    deadlock_key,
    describe_deadlock,
    split_sentence,
)

__all__ = [
    "KINDS",
    "RankStatus",
    "Verdict",
    "blocked_in",
    "describe_frozen",
    "diagnose",
    "flight_recorder_note",
    "frozen_ranks",
    "in_runs",
    "nccl_timeout_advice",
    "next_step",
    "phase_label",
    "record_lines",
    "to_runs",
    "where_lines",
]

#: Phase kinds, each with its own deadline. ``done`` (after fit end) has none.
KINDS = ("startup", "train", "data", "eval", "post_eval", "checkpoint", "done")

#: At most this many stuck ranks are described one by one; the rest as ranges.
MAX_DETAILED = 16
#: At most this many phase groups are listed in one line.
MAX_GROUPS = 8

Runs = tuple[tuple[int, int], ...]
#: A stack as ``(file, line, function)`` frames, innermost first.
Frames = Sequence[tuple[str, int, str]]
#: An exchange a rank gave up waiting in: (exchange name, the ranks missing, its timeout).
GaveUp = tuple[str, tuple[int, ...], float]

#: Code in which a thread waits for other ranks (collectives, barriers, DDP's buffer
#: sync, rankguard's own checks, which wait on the store, and autograd's engine, where
#: DDP and FSDP reduce gradients across ranks from C++ hooks during backward).
AUTOGRAD_CODE = os.path.join("torch", "autograd", "")
PEER_WAIT_CODE = (
    os.path.join("torch", "distributed", ""),
    os.path.join("torch", "nn", "parallel", "distributed.py"),
    *EXCHANGE_CODE,
    AUTOGRAD_CODE,
    RECORDER_CODE,
)
#: Frames a waiting thread may sit in inside a peer wait: locks and events, and the
#: watchdog's own handler of a check's missing ranks (called from the check's exchange).
WAIT_MACHINERY = (threading.__file__, os.path.join(os.path.dirname(__file__), "hang_watchdog.py"))


@dataclass(frozen=True)
class RankStatus:
    """What one rank's watchdog thread sends at each exchange.

    Attributes:
        phase: Where the main thread is, e.g. ``"eval batch 3 of 'eval'"``.
        step: Global train step at the last heartbeat.
        idle_s: Seconds since the last heartbeat (progress).
        deadline_s: The deadline of the current phase (calibrated, at most the
            ceiling), or ``None`` (fit ended): past it, the rank is reported.
        host: Host name.
        pid: Process id.
        blocked_in: The ``torch.distributed`` call the training loop is blocked
            in, with its call site (see :func:`blocked_in`), or ``None``.
        ceiling_s: The phase's configured (or NCCL-fitted) deadline: past it,
            the incident ends (abort); ``None`` means the same as ``deadline_s``.
        gave_up: A rankguard exchange this rank stopped waiting in because some
            ranks never came, or ``None``: those ranks are stuck, now.
        user_frame: The innermost frame of the user's own code in the training
            loop, with its source line (see
            :func:`~rankguard.callbacks.hang.deadlock.user_frame`), or ``None``.
        waits_at: The rendezvous the training loop waits at (see
            :func:`~rankguard.callbacks.hang.deadlock.rendezvous`), or ``None``;
            :data:`~rankguard.callbacks.hang.deadlock.LEFT_LOOP` once fit ended.
        wait_s: How long it has been seen waiting there (sampled).
        settled: Whether ``wait_s`` is past this rank's settle time: a wait
            this long is no longer a collective on its way.
        progress: Heartbeats so far (unchanged between two samples: no progress).
        usual: Whether this rank had seen its wait point before, healthy.
        direct: Whether the user's own code calls the rendezvous (not a framework).
        decisions: ``(name, value, step)`` of the decisions that can split the
            ranks (``should_stop``, ``should_training_stop``, ``sync_dist_keys``,
            ``save``), as last reported.
        record: The collectives this rank issued, per process group (see
            :mod:`~rankguard.callbacks.hang.collectives`); ``()`` without a record.
        quiet: Whether it made no progress and issued no collective for its settle time.
    """

    phase: str
    step: int
    idle_s: float
    deadline_s: float | None
    host: str
    pid: int
    blocked_in: str | None = None
    ceiling_s: float | None = None
    gave_up: GaveUp | None = None
    user_frame: str | None = None
    waits_at: str | None = None
    wait_s: float = 0.0
    settled: bool = False
    progress: int = 0
    usual: bool = False
    direct: bool = False
    decisions: tuple[tuple[str, Any, int | None], ...] = ()
    record: tuple[GroupRecord, ...] = ()
    quiet: bool = False

    @property
    def overdue(self) -> bool:
        """Whether the rank is past its deadline."""
        return self.deadline_s is not None and self.idle_s > self.deadline_s

    @property
    def ceiling(self) -> float | None:
        """The phase's ceiling (its deadline when none was given)."""
        return self.deadline_s if self.ceiling_s is None else self.ceiling_s

    @property
    def past_ceiling(self) -> bool:
        """Whether the rank is past its phase's ceiling."""
        ceiling = self.ceiling
        return ceiling is not None and self.idle_s > ceiling

    def limits(self) -> str:
        """``"deadline 4 s"``, or ``"deadline 30 s, calibrated; ceiling 600 s"``."""
        if self.deadline_s is None:
            return "deadline none"
        if self.ceiling is None or self.ceiling == self.deadline_s:
            return f"deadline {self.deadline_s:g} s"
        return f"deadline {self.deadline_s:g} s, calibrated; ceiling {self.ceiling:g} s"


@dataclass(frozen=True)
class Verdict:
    """The deciding rank's diagnosis, the same on every rank; its size does not grow per rank.

    Attributes:
        stuck: Ranks past their deadline (less those only waiting for them,
            see :func:`diagnose`), as ``(first, last)`` runs.
        summary: One line: the stuck ranks and what the others are doing
            (empty when no rank is stuck).
        details: One line per stuck rank (at most ``MAX_DETAILED``), with host and pid.
        phases: Every rank's phase, grouped (the last known state, kept for
            reporting ranks that stop answering).
        done: Ranks whose fit has ended, as runs.
        slack_s: The longest any running rank may still go without progress
            before passing its deadline (``inf`` when no rank has a deadline).
        first: The stuck rank without progress the longest (it stopped first),
            or ``None``.
        end: Whether the incident ends now (stage 2: abort, or the final
            report): a stuck rank is past its ceiling, or a rank gave up
            waiting for it in another check's exchange.
        ceiling_slack_s: As ``slack_s``, up to the ceilings.
        deadlock: Whether this is a proven deadlock (see
            :func:`~rankguard.callbacks.hang.deadlock.deadlock_key`): the watchdog
            ends the job now (``deadlock_action="abort"``); ``end`` still says
            whether a ceiling has passed.
        suspect: The fingerprint of a deadlock seen once, to confirm at the
            next exchange (which then comes at once), or ``None``.
        mismatch: Collectives paired with the wrong partner while the job runs
            (a key to tell it once, and the message), or ``None``.
    """

    stuck: Runs
    summary: str
    details: tuple[str, ...]
    phases: str
    done: Runs
    slack_s: float
    first: int | None = None
    end: bool = False
    ceiling_slack_s: float = math.inf
    deadlock: bool = False
    suspect: str | None = None
    mismatch: tuple[str, str] | None = None


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


def _waits_for_peers(filename: str) -> bool:
    return any(marker in filename for marker in PEER_WAIT_CODE)


def blocked_in(stack: Frames) -> str | None:
    """Names the cross-rank call a thread is blocked in, from its stack.

    Args:
        stack: The training loop's frames, innermost first.

    Returns:
        ``None`` unless the innermost frame (past locks and events) is
        ``torch.distributed`` code (a collective, barrier or store wait), a
        rankguard check's exchange, or autograd's engine (``"backward"``: under
        DDP the gradient all-reduce): the thread waits for other ranks;
        else the call and its call site, past wrappers of the same name (a
        framework's ``all_reduce``), e.g.
        ``"all_reduce, called from trainer.py:3634 (_iter_dataloader)"``.
    """
    stack = list(itertools.dropwhile(lambda f: f[0] in WAIT_MACHINERY, stack))
    if not stack or not _waits_for_peers(stack[0][0]):
        return None
    call = stack[0][2]
    if stack[0][0] in EXCHANGE_CODE:
        call = "rankguard exchange"
    elif AUTOGRAD_CODE in stack[0][0]:
        call = "backward"
    callers = (f for f in stack if not _waits_for_peers(f[0]) and f[2] != call)
    caller = next(callers, None)
    if caller is None:
        return call
    filename, line, function = caller
    return f"{call}, called from {os.path.basename(filename)}:{line} ({function})"


def to_runs(ranks: Iterable[int]) -> Runs:
    """Compresses ranks into sorted ``(first, last)`` runs."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return tuple(runs)


def in_runs(rank: int, runs: Runs) -> bool:
    """Whether ``rank`` lies in one of ``runs``."""
    return any(first <= rank <= last for first, last in runs)


def _grouped(statuses: Mapping[int, RankStatus], template: str) -> list[str]:
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
                limits=sample.limits(),
                where=f" (blocked in {blocked})" if blocked else "",
                and_where=f"; blocked in {blocked}" if blocked else "",
            )
        )
    if len(groups) > MAX_GROUPS:
        parts.append(f"... {len(groups) - MAX_GROUPS} more groups")
    return parts


def diagnose(
    statuses: Mapping[int, RankStatus], incident: Runs = (), suspect: str | None = None
) -> Verdict:
    """The ``decide`` function of the status exchange (runs on rank 0).

    Ranks past their phase deadline are stuck; the stuck group that stopped
    first (longest without progress) is named first, as the likely cause.
    A rank past its deadline while blocked in a ``torch.distributed`` call
    waits for a peer: when some ranks past their deadline are blocked there
    and others are not, only the others are stuck; the blocked ones are
    listed as waiting (their last heartbeat may be the same, e.g. both
    after eval when Lightning broadcasts before the next batch). When every
    rank past its deadline is blocked, the stuck ones are the ranks not
    blocked that have made no progress for at least half as long (deadlines
    differ per phase: the rank waiting in a data fetch may pass its own
    before the rank it waits for, stuck after eval, passes its longer one).

    While an incident is open, its stuck ranks stay its cause as long as
    they are still past their deadline: ranks that pass theirs later while
    waiting for them (e.g. in a gradient all-reduce, which shows no Python
    frame) are listed as waiting. Ranks another rank gave up waiting for in
    a rankguard exchange are stuck, and end the incident at once.

    Every rank waiting at a rendezvous, not all at the same one, for two
    exchanges in a row without progress (``suspect`` is the first one's
    fingerprint) is a proven deadlock: every rank is named, and it ends now.

    Args:
        statuses: Every rank's status.
        incident: The stuck ranks of the open incident (``()`` when none).
        suspect: :attr:`Verdict.suspect` of the previous exchange.

    Returns:
        A verdict whose summary reads e.g. ``"rank 1 stuck 61 s in eval batch
        3 of 'eval' (deadline 60 s); ranks 0,2,3 waiting 58 s in train batch 2001"``.
    """
    key = deadlock_key(statuses)
    records = _records(statuses)
    desync = _record_desync(statuses, records)
    verdict = _diagnose(statuses, incident)
    verdict = replace(verdict, mismatch=mismatch_warning(records) if records else None)
    recorded = desync.key if desync is not None else None  # from what each rank issued
    if suspect is None or suspect not in (key, recorded):
        return replace(verdict, suspect=key or recorded)
    if key is not None:  # the stack proof where it sees too: the record's lines added
        summary, details, first = describe_deadlock(statuses)
        details = (*details, *record_lines(records))
    else:
        summary, details, first = desync.summary, desync.details, desync.first
        split = split_sentence(statuses)
        details = (*([f"What split them: {split}"] if split else []), *details)
    return replace(
        verdict,
        stuck=to_runs(statuses),
        summary=summary,
        details=(*details, *where_lines(statuses)),
        first=first,
        # Ends the incident: at once when the deadlock ends the job, else at the ceiling.
        end=verdict.end or any(s.past_ceiling for s in statuses.values()),
        deadlock=True,
    )


def _records(statuses: Mapping[int, RankStatus]) -> dict[int, tuple[GroupRecord, ...]]:
    """Every rank's record of collectives; empty unless every rank keeps one."""
    records = {r: s.record for r, s in statuses.items() if s.record}
    return records if len(records) == len(statuses) else {}


def _record_desync(
    statuses: Mapping[int, RankStatus], records: Mapping[int, tuple[GroupRecord, ...]]
) -> Desync | None:
    if not records:
        return None
    return record_desync(
        records,
        quiet={r: s.quiet or bool(s.waits_at and s.settled) for r, s in statuses.items()},
        # At a rendezvous and quiet for the record's settle time: it waits for the others.
        waiting={r: bool(s.waits_at and (s.settled or s.quiet)) for r, s in statuses.items()},
        progress={r: s.progress for r, s in statuses.items()},
    )


def record_lines(records: Mapping[int, tuple[GroupRecord, ...]]) -> tuple[str, ...]:
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


def _diagnose(statuses: Mapping[int, RankStatus], incident: Runs) -> Verdict:
    gave_up = sorted({s.gave_up for s in statuses.values() if s.gave_up is not None})
    missing = {r for _, ranks, _ in gave_up for r in ranks if r in statuses}
    overdue = {r: s for r, s in statuses.items() if s.overdue}
    stuck = {r: s for r, s in overdue.items() if in_runs(r, incident)}
    if missing:  # ranks that another rank's check waited for in vain
        stuck = {r: statuses[r] for r in missing}
    elif not stuck:
        stuck = {r: s for r, s in overdue.items() if not s.blocked_in}
    if overdue and not stuck:  # every rank past its deadline waits for peers: for ranks
        # that are not waiting and stopped about when they did (their deadline may be
        # longer); half the wait tells them from ranks making progress, whatever the skew
        # between two ranks' last heartbeats and status samples.
        since = min(s.idle_s for s in overdue.values()) / 2
        stuck = {
            r: s
            for r, s in statuses.items()
            if s.deadline_s is not None and not s.blocked_in and s.idle_s >= since
        } or overdue
    others = {r: s for r, s in statuses.items() if r not in stuck}
    summary = ""
    if stuck:
        template = "{who} stuck {idle:.0f} s in {phase} ({limits}{and_where})"
        parts = _grouped(stuck, template)
        parts += _grouped(others, "{who} waiting {idle:.0f} s in {phase}{where}")
        summary = "; ".join(parts)
    details = tuple(
        f"{rank_label(ranks)} did not reach rankguard exchange {name!r} within {timeout:g} s; "
        "the ranks waiting there gave up, so the incident ends now, before the ceiling (if "
        f"{'it is' if len(ranks) == 1 else 'they are'} only slow there, raise that check's "
        "timeout: `exchange_timeout_s`, or `batch_parity_guard`'s `eval_end_timeout_s` after "
        "eval)."
        for name, ranks, timeout in gave_up
    ) + tuple(
        f"rank {r}: host {s.host}, pid {s.pid}, {s.phase} (step {s.step}), "
        f"no progress for {s.idle_s:.1f} s, {s.limits()}"
        + (f", blocked in {s.blocked_in}" if s.blocked_in else "")
        for r, s in sorted(stuck.items())[:MAX_DETAILED]
    )
    if stuck:
        split = split_sentence(statuses)
        details += (*where_lines(statuses), *([f"What split them: {split}"] if split else []))
    running = [s for s in statuses.values() if s.deadline_s is not None]
    return Verdict(
        stuck=to_runs(stuck),
        summary=summary,
        details=details,
        phases="; ".join(_grouped(statuses, "{who} in {phase}{where}")),
        done=to_runs(r for r, s in statuses.items() if s.deadline_s is None),
        slack_s=max((s.deadline_s - s.idle_s for s in running), default=math.inf),
        first=max(stuck, key=lambda r: (stuck[r].idle_s, -r)) if stuck else None,
        end=bool(missing) or any(s.past_ceiling for s in stuck.values()),
        ceiling_slack_s=max((s.ceiling - s.idle_s for s in running), default=math.inf),
    )


def frozen_ranks(
    missing: Iterable[int], *, rank: int, waited_s: float, last: Verdict | None, default_s: float
) -> list[int]:
    """Decides which ranks that stopped answering to report as frozen or dead.

    A rank is reported once it has been silent longer than any running rank
    could legitimately go without progress (``last.slack_s``), so a rank whose
    Python is only briefly busy is never reported. Ranks whose fit had ended
    (they close at their own pace) and this rank itself are never reported.

    Args:
        missing: Ranks the side channel named as missing.
        rank: This rank.
        waited_s: Time since the last successful exchange, counted the same
            way on every rank (failed exchanges x their timeout).
        last: The last successful verdict, or ``None`` if there was none.
        default_s: Slack before any verdict (the first-step deadline).

    Returns:
        The ranks to report, sorted; empty while it is too early.
    """
    slack = default_s if last is None else last.slack_s
    done = () if last is None else last.done
    if in_runs(rank, done) or waited_s <= slack:
        return []
    return sorted(r for r in set(missing) if r != rank and not in_runs(r, done))


def describe_frozen(ranks: list[int], waited_s: float, last: Verdict | None) -> str:
    """One line for ranks that stopped answering on the side channel."""
    seen = f"last seen: {last.phases}" if last is not None else "never seen by the watchdog"
    return (
        f"{rank_label(ranks)} frozen or dead (no answer on the side channel for "
        f"{waited_s:.0f} s; {seen})"
    )


def next_step(first: int | None, frozen: list[int]) -> str:
    """What to look at first, for the report."""
    if frozen:
        return (
            f"Next: on the host of {rank_label(frozen)}, look for an OOM kill (dmesg, the "
            "launcher's log) or a stopped process; `py-spy dump --pid PID` shows the stack "
            "of a live one."
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
        f"process-group timeout above {math.ceil(needed)} s (init_process_group(timeout=...), "
        "Composer `dist_timeout`, Lightning `DDPStrategy(timeout=...)`), or lower the "
        f"watchdog's `{name}`."
    )


def flight_recorder_note(env: Mapping[str, str], rank: int) -> str:
    """Where the NCCL flight recorder writes, or how to turn it on (for NCCL runs).

    Args:
        env: The environment (``os.environ``).
        rank: This rank, to name its dump file.

    Returns:
        A sentence for the hang report.
    """
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
