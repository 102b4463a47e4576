"""The incident state machine and its report's words: a table of cases (no processes)."""

from __future__ import annotations

import pytest

from rankguard.callbacks.hang.incident import (
    HANG_EXIT_CODE,
    Hold,
    Policy,
    Recovered,
    Report,
    State,
    WarnMismatch,
    after_missing,
    after_verdict,
    message,
    outcome,
    recovered_text,
    stage_sentence,
    summary_text,
    where,
    writer,
)
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, Verdict

ABORT = Policy("abort", "ceiling", "abort", "warn")
REPORT = Policy("report", "ceiling", "report", "warn")
FRESH, REPORTED, ENDED = State(False, False), State(True, False), State(True, True)
STUCK = ((1, 1),)


def _verdict(stuck=STUCK, end=False, deadlock=False, mismatch=None) -> Verdict:
    return Verdict(
        stuck, "s" if stuck else "", ("d",) if stuck else (), "p", (), 1.0,
        first=1 if stuck else None, end=end, mismatch=mismatch,
        kind="deadlock" if deadlock else ("stall" if end else "slow") if stuck else "healthy",
    )  # fmt: skip


def _kinds(steps) -> list:
    out = []
    for step in steps:
        if isinstance(step, Report):
            out.append(("report", step.final, step.deadlock, step.code))
        else:
            out.append(type(step).__name__)
    return out


@pytest.mark.parametrize(
    ("verdict", "state", "policy", "expected"),
    [
        (_verdict(stuck=()), FRESH, ABORT, []),  # healthy, nothing open
        (_verdict(stuck=()), REPORTED, ABORT, ["Recovered"]),
        (_verdict(), FRESH, ABORT, ["Hold", ("report", False, False, None)]),  # stage 1
        (_verdict(), REPORTED, ABORT, ["Hold"]),  # reported once per incident
        (_verdict(end=True), REPORTED, ABORT, ["Hold", ("report", True, False, HANG_EXIT_CODE)]),
        (_verdict(end=True), REPORTED, REPORT, ["Hold", ("report", True, False, None)]),
        (_verdict(end=True), ENDED, REPORT, ["Hold"]),  # stage 2 once (action="report")
        (
            _verdict(),
            FRESH,
            ABORT._replace(abort_at="calibrated"),
            ["Hold", ("report", True, False, HANG_EXIT_CODE)],
        ),
        (_verdict(deadlock=True), FRESH, ABORT, ["Hold", ("report", True, True, 70)]),
        (_verdict(deadlock=True), FRESH, REPORT, ["Hold", ("report", False, True, None)]),
        (_verdict(deadlock=True), REPORTED, REPORT, ["Hold"]),
        (
            _verdict(deadlock=True, end=True),
            REPORTED,
            REPORT._replace(action="abort"),
            ["Hold", ("report", True, False, HANG_EXIT_CODE)],
        ),
        (_verdict(stuck=(), mismatch=("k", "t.")), FRESH, ABORT, ["WarnMismatch"]),
        (_verdict(stuck=(), mismatch=("told", "t.")), FRESH, ABORT, []),
        (
            _verdict(stuck=(), mismatch=("k", "t.")),
            FRESH,
            ABORT._replace(collective_mismatch="abort"),
            [("report", True, True, DEADLOCK_EXIT_CODE)],
        ),
    ],
)
def test_what_a_verdict_makes_this_rank_do(verdict, state, policy, expected):
    steps = after_verdict(verdict, state, policy, leader=True, told={"told"})
    assert _kinds(steps) == expected


def test_stage_reports_carry_the_verdicts_lines_and_only_the_leader_warns_of_a_mismatch():
    (hold, report) = after_verdict(_verdict(), FRESH, ABORT, leader=False, told=())
    assert hold == Hold(STUCK) and report.details == ("d",) and report.frozen == ()
    mismatch = _verdict(stuck=(), mismatch=("k", "t."))
    assert after_verdict(mismatch, FRESH, ABORT, leader=False, told=()) == ()
    assert after_verdict(mismatch, FRESH, ABORT, leader=True, told=()) == (WarnMismatch("k", "t."),)
    ended = after_verdict(_verdict(stuck=()), ENDED, ABORT, leader=True, told=())
    assert ended == (Recovered(True),)
    aborts = ABORT._replace(collective_mismatch="abort")
    (report,) = after_verdict(mismatch, FRESH, aborts, leader=True, told=())
    assert report.summary == "collective mismatch, t"


def test_ranks_that_stop_answering_are_reported_once_silent_past_the_slack():
    last = Verdict((), "", (), "rank 0-1 in train batch 3", (), 5.0, ceiling_slack_s=50.0)
    kwargs = {"rank": 0, "last": last, "first_step_s": 100.0, "gave_up": None, "policy": ABORT}
    assert after_missing([1], waited_s=4.0, state=FRESH, **kwargs) is None
    report = after_missing([1], waited_s=12.0, state=FRESH, **kwargs)
    assert report.frozen == (1,) and not report.final
    assert report.summary.startswith(
        "rank 1 frozen or dead (no answer on the side channel for 12 s"
    )
    assert after_missing([1], waited_s=60.0, state=REPORTED, **kwargs).code == HANG_EXIT_CODE
    gave_up = {**kwargs, "gave_up": ("check", (1,), 5.0)}
    assert after_missing([1], waited_s=1.0, state=FRESH, **gave_up).final  # a check gave up
    assert after_missing([0], waited_s=60.0, state=FRESH, **kwargs) is None  # this rank itself


def test_report_words():
    report = Report("rank 1 stuck", ("line",), (0,), final=False)
    assert writer(4, report.frozen) == 1
    assert stage_sentence(False, False).startswith("Stage 1")
    assert stage_sentence(True, False).startswith("Stage 2")
    assert stage_sentence(True, True).endswith(f"exit code {DEADLOCK_EXIT_CODE}.")
    assert summary_text(report, "note") == "\n".join(
        ["rank 1 stuck", "", "line", stage_sentence(False, False), "", "note"]
    )
    here = where("rank 0, host h, pid 1: train batch 2", "/r", 0, "")
    assert here == (
        "This is rank 0, host h, pid 1: train batch 2. Stacks in /r/rank0.txt; "
        "summary in /r/summary.txt."
    )
    assert message(report, here).startswith("Hang suspected: rank 1 stuck.\nline\nThis is")
    final = report._replace(final=True, code=HANG_EXIT_CODE)
    assert message(final, here).startswith("Hang: ")
    assert message(final._replace(deadlock=True), here).startswith("Deadlock: ")
    # A proven report's summary names its class: the heading says it once, not "Deadlock: deadlock".
    proven = final._replace(summary="deadlock, every rank waits at a rendezvous", deadlock=True)
    assert message(proven, here).startswith("Deadlock: every rank waits at a rendezvous.\n")
    desync = proven._replace(summary="desync, every rank waits for a collective")
    assert message(desync, here).startswith("Desync: every rank waits for a collective.\n")
    mismatch = proven._replace(summary="collective mismatch, ranks paired unlike calls")
    assert message(mismatch, here).startswith("Collective mismatch: ranks paired unlike calls.")
    assert outcome(report, "report").startswith("Training goes on; it reports again if")
    assert outcome(final, "abort") == "Now aborting with exit code 75."
    assert outcome(final._replace(code=None), "report") == "Now waiting."
    assert recovered_text(True) == "every rank is making progress again."
    assert "slow, not stuck" in recovered_text(False)
