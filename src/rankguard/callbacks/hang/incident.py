"""The incident state machine and its report's words: what a verdict makes this rank do.

Pure: :func:`after_verdict` and :func:`after_missing` return steps; the watchdog performs them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from rankguard.callbacks.hang.status import (
    DEADLOCK_EXIT_CODE,
    EXIT_CODES,
    HANG_EXIT_CODE,
    GaveUp,
    Runs,
    Verdict,
)
from rankguard.callbacks.hang.verdict import gone

__all__ = [
    "HANG_EXIT_CODE",
    "PROVEN_KINDS",
    "Hold",
    "Policy",
    "Recovered",
    "Report",
    "State",
    "Step",
    "WarnMismatch",
    "after_missing",
    "after_verdict",
    "header",
    "heading_and_lead",
    "message",
    "outcome",
    "recovered_text",
    "stage_sentence",
    "summary_text",
    "where",
    "writer",
]


class Policy(NamedTuple):
    """The settings that decide what an incident does (the watchdog's, as given)."""

    action: str  # "abort" or "report": stage 2
    abort_at: str  # "ceiling" or "calibrated"
    deadlock_action: str  # "abort" or "report"
    collective_mismatch: str  # "warn" or "abort"


class State(NamedTuple):
    """The open incident as this rank knows it."""

    reported: bool  # a report of it was made (stage 1 or 2)
    ended: bool  # it reached stage 2 (with action="report": it waits)


class Report(NamedTuple):
    """Report the incident: stage 1 (``final`` false) or stage 2, then exit with ``code``."""

    summary: str
    details: tuple[str, ...]
    frozen: tuple[int, ...]  # ranks that stopped answering (they write nothing)
    final: bool
    deadlock: bool = False
    code: int | None = None  # the exit code after the report, or None: no exit


class Hold(NamedTuple):
    """The incident's ranks are now ``runs`` (what the next diagnosis compares with)."""

    runs: Runs


class WarnMismatch(NamedTuple):
    """Warn once (the leader) that collectives were paired with the wrong partner."""

    key: str
    text: str


class Recovered(NamedTuple):
    """Every rank makes progress again: say so and close the incident."""

    ended: bool  # it had reached stage 2


Step = Report | Hold | WarnMismatch | Recovered


def _report(
    summary: str,
    details: tuple[str, ...],
    frozen: Iterable[int],
    policy: Policy,
    *,
    final: bool,
    deadlock: bool = False,
) -> Report:
    """A report, with the exit code that follows it: 70 for a deadlock, 75 on ``abort``."""
    aborts = final and (deadlock or policy.action == "abort")
    code = EXIT_CODES["deadlock" if deadlock else "stall"] if aborts else None
    return Report(summary, details, tuple(frozen), final, deadlock, code)


def _stage(
    summary: str,
    details: tuple[str, ...],
    frozen: Iterable[int],
    end: bool,
    state: State,
    policy: Policy,
) -> Report | None:
    """A stuck verdict: stage 1 (once per incident) or stage 2 (once, at its end)."""
    if state.ended:
        return None  # stage 2 done (action="report"): once per incident
    if end or policy.abort_at == "calibrated":
        return _report(summary, details, frozen, policy, final=True)
    if not state.reported:
        return _report(summary, details, frozen, policy, final=False)
    return None


def after_verdict(
    verdict: Verdict, state: State, policy: Policy, *, leader: bool, told: Collection[str]
) -> tuple[Step, ...]:
    """What this rank does after an exchange's verdict, in order.

    A mismatch of collectives is warned once per key by the leader, or ends
    the job as a deadlock (``collective_mismatch="abort"``). A proven deadlock
    is reported at once and ends the job (``deadlock_action="abort"``), or is
    reported once and then ends at the ceiling like any hang. A stuck rank is
    reported at its calibrated deadline (stage 1), and the incident ends at the
    ceiling (stage 2; at once with ``abort_at="calibrated"``). A reported
    incident with no rank stuck any more has recovered.

    Args:
        verdict: The exchange's verdict.
        state: The open incident before it.
        policy: The watchdog's settings.
        leader: Whether this rank is the lowest (it warns for all).
        told: The mismatch keys already warned about.

    Returns:
        The steps to perform, in order; a report with a ``code`` exits, so it is the last.
    """
    steps: list[Step] = []

    def report(step: Report | None) -> None:
        nonlocal state
        if step is not None:
            steps.append(step)
            state = State(True, state.ended or step.final)

    if verdict.mismatch is not None:
        key, text = verdict.mismatch
        if policy.collective_mismatch == "abort":  # every rank got the same verdict
            summary = f"collective mismatch, {text.rstrip('.')}"
            report(_report(summary, (), (), policy, final=True, deadlock=True))
        elif key not in told and leader:
            steps.append(WarnMismatch(key, text))
    summary, details = verdict.summary, verdict.details
    if verdict.deadlock:
        steps.append(Hold(verdict.stuck))
        if policy.deadlock_action == "abort":
            report(_report(summary, details, (), policy, final=True, deadlock=True))
        elif not state.reported:
            report(_report(summary, details, (), policy, final=False, deadlock=True))
        elif verdict.end and not state.ended:
            report(_report(summary, details, (), policy, final=True))
    elif verdict.stuck:
        steps.append(Hold(verdict.stuck))
        report(_stage(summary, details, (), verdict.end, state, policy))
    elif state.reported:
        steps.append(Recovered(state.ended))
    for i, step in enumerate(steps):
        if isinstance(step, Report) and step.code is not None:
            return tuple(steps[: i + 1])  # it exits the process: nothing after it happens
    return tuple(steps)


def after_missing(
    missing: Sequence[int],
    *,
    rank: int,
    waited_s: float,
    last: Verdict | None,
    first_step_s: float,
    gave_up: GaveUp | None,
    state: State,
    policy: Policy,
    silent: tuple[float, float] = (math.inf, math.inf),
    heard: Collection[int] | None = None,
) -> Report | None:
    """What this rank reports when ranks did not answer the status exchange.

    Ranks silent longer than any running rank may go without progress are
    frozen or dead; so are ranks heard before and silent ``silent[0]`` seconds,
    whatever their phase, and ranks another check gave up waiting for that are
    silent here too. The incident ends once a check gave up on them, the
    ceilings' slack has passed, or ``silent[1]``.

    Args:
        missing: The ranks that did not answer.
        rank: This rank.
        waited_s: Time since the last successful exchange, the same on every rank.
        last: The last successful verdict, or ``None``.
        first_step_s: The first-step deadline (the slack before any verdict).
        gave_up: The exchange this rank gave up waiting in, or ``None``.
        state: The open incident.
        policy: The watchdog's settings.
        silent: The silences after which a rank heard before is named, then ended.
        heard: The ranks heard from before (``None``: every rank once there was a verdict).

    Returns:
        The report to make, or ``None``.
    """
    verdict = gone(
        missing,
        rank=rank,
        waited_s=waited_s,
        last=last,
        default_s=first_step_s,
        given_up=gave_up[1] if gave_up else (),
        silent=silent,
        heard=heard,
    )
    if verdict is None:
        return None
    frozen = [r for first, last_rank in verdict.stuck for r in range(first, last_rank + 1)]
    return _stage(verdict.summary, verdict.details, frozen, verdict.end, state, policy)


# -- the report's words ---------------------------------------------------------------


def writer(world_size: int, frozen: Collection[int]) -> int:
    """The rank that writes ``summary.txt``: the lowest that still answers."""
    frozen = set(frozen)
    return min(r for r in range(world_size) if r not in frozen)


def stage_sentence(final: bool, deadlock: bool) -> str:
    """The sentence that says which stage the report is, in ``summary.txt``."""
    if deadlock:
        if final:
            return f"Proven deadlock: the job ends now with exit code {DEADLOCK_EXIT_CODE}."
        return "Proven deadlock (deadlock_action='report'): the two stages go on."
    if final:
        return "Stage 2: the incident ends (ceiling, or a check gave up waiting)."
    return "Stage 1: reported at the calibrated deadline; training goes on."


def summary_text(report: Report, nccl_note: str) -> str:
    """``summary.txt``: the summary, a line per stuck rank, the stage and the NCCL note."""
    stage = stage_sentence(report.final, report.deadlock)
    return "\n".join([report.summary, "", *report.details, stage, "", nccl_note])


def header(rank: int, host: str, pid: int, phase: str) -> str:
    """``rank R, host H, pid P: phase``: this rank, as its report and log line name it."""
    return f"rank {rank}, host {host}, pid {pid}: {phase}"


def where(header: str, report_dir: str, rank: int, nccl_note: str) -> str:
    """The log line's last sentence: this rank, and where its report files are."""
    return (
        f"This is {header}. Stacks in {report_dir}/rank{rank}.txt; "
        f"summary in {report_dir}/summary.txt. {nccl_note}".rstrip()
    )


#: The classes a proven report's summary starts with (``"deadlock, ..."``): its heading.
PROVEN_KINDS = ("deadlock", "desync", "collective mismatch")


def heading_and_lead(report: Report) -> tuple[str, str]:
    """The message's heading and the summary after it, the class said once.

    A proven report's summary names its class first (``"deadlock, every rank waits..."``,
    ``"desync, ..."``): that is the heading (``"Deadlock"``), not ``"Deadlock: deadlock"``.
    """
    summary = report.summary
    if report.deadlock:
        for kind in PROVEN_KINDS:
            if summary.startswith(f"{kind}, "):
                return kind.capitalize(), summary[len(kind) + 2 :]
        return "Deadlock", summary
    return ("Hang" if report.final else "Hang suspected"), summary


def message(report: Report, where: str) -> str:
    """The incident's message (logged, and :attr:`HangWatchdog.last_incident`'s)."""
    heading, lead = heading_and_lead(report)
    return "\n".join([f"{heading}: {lead}.", *report.details, where])


def outcome(report: Report, action: str) -> str:
    """The log line's ending: what happens next."""
    if not report.final:
        then = "aborts" if action == "abort" else "reports again"
        return f"Training goes on; it {then} if there is still no progress at the ceiling."
    if report.code is None:
        return "Now waiting."
    return f"Now aborting with exit code {report.code}."


def recovered_text(ended: bool) -> str:
    """The INFO line when every rank makes progress again after a report."""
    slow = ": the phase reported was slow, not stuck; its deadline now allows for it"
    return f"every rank is making progress again{'' if ended else slow}."
