"""Deadline policy, the loop's waits and the status built from them (pure, no processes)."""

from __future__ import annotations

from rankguard.callbacks.core import side_channel
from rankguard.callbacks.hang.calibration import MIN_SAMPLES, IntervalHistory
from rankguard.callbacks.hang.deadlines import (
    DEFAULT_DEADLINES,
    RECORD_SETTLE_S,
    Settings,
    Settle,
    ceiling_arguments,
    ceilings,
    fit_defaults_under,
    plan,
    recalibrate,
    settle_times,
)
from rankguard.callbacks.hang.waits import WaitTracker

SETTINGS = Settings(True, 10, 10.0, 0.5, 1800.0, 3.0, "abort", "ceiling")
CEILINGS = ceilings(
    first_step_timeout_s=1800.0,
    timeout_s=600.0,
    eval_timeout_s=600.0,
    post_eval_timeout_s=600.0,
    checkpoint_timeout_s=1800.0,
)


def test_ceilings_by_kind_and_by_argument():
    assert CEILINGS["data"] == CEILINGS["train"] == 600.0 and CEILINGS["startup"] == 1800.0
    assert ceiling_arguments(CEILINGS) == DEFAULT_DEADLINES


def test_only_defaulted_ceilings_are_lowered_under_the_nccl_timeout():
    values = {**DEFAULT_DEADLINES, "eval_timeout_s": 900.0}
    timing = {"exchange_period_s": 10.0, "exchange_timeout_s": 10.0}
    defaulted = ["timeout_s", "post_eval_timeout_s", "checkpoint_timeout_s"]
    fitted = fit_defaults_under(values, defaulted, 300.0, **timing)
    assert fitted == dict.fromkeys(defaulted, 0.8 * 300 - 20)
    assert fit_defaults_under(values, defaulted, None, **timing) == {}
    assert fit_defaults_under(values, defaulted, 3600.0, **timing) == {}  # all fit already
    assert fit_defaults_under(values, defaulted, 10.0, **timing) == dict.fromkeys(defaulted, 10.0)


def test_settle_times_are_deadlock_after_s_until_the_train_steps_are_known():
    assert settle_times(3.0, 10.0) == Settle(3.0, 3.0)
    assert settle_times(3.0, 10.0, (0.01,) * (MIN_SAMPLES - 1)) == Settle(3.0, 3.0)
    fast = settle_times(3.0, 10.0, (0.01,) * MIN_SAMPLES)
    assert fast == Settle(3.0, RECORD_SETTLE_S)  # a record is quiet sooner than a stack settles
    slow = settle_times(3.0, 10.0, (0.5,) * MIN_SAMPLES)
    assert slow == Settle(5.0, 5.0)


def test_recalibrate_keeps_the_first_step_deadline_and_the_settle_times_until_calibrated():
    history = IntervalHistory()
    early = recalibrate(history, CEILINGS, SETTINGS, None)
    assert early.settle is None and early.deadlines["startup"] == 1800.0
    history.record_many("train", [0.5] * MIN_SAMPLES)
    calibrated = recalibrate(history, CEILINGS, SETTINGS, None)
    assert calibrated.settle == Settle(5.0, 5.0)
    assert calibrated.deadlines["train"] == calibrated.calibrated["train"].seconds < 600.0


def test_the_plan_says_when_it_reports_and_when_it_ends():
    text = plan(CEILINGS, SETTINGS, None)
    assert text.startswith("reports at deadlines calibrated after 10 warm-up train steps")
    assert text.endswith("aborts at the ceilings: " + text.split("ceilings: ")[1])
    off = plan(CEILINGS, SETTINGS._replace(auto_calibrate=False, action="report"), None)
    assert off.startswith("deadlines (no calibration): ")
    assert off.endswith("; past one it reports again (action='report').")
    assert "at most" in plan(CEILINGS, SETTINGS._replace(abort_at="calibrated"), None)


def test_a_wait_settles_at_one_rendezvous_and_is_exchanged_early_once_per_settle_time():
    waits = WaitTracker(())
    stack = [(side_channel.__file__, 5, "_decide"), ("/home/user/train.py", 9, "main")]
    settle = Settle(2.0, 1.0)
    assert waits.sample(stack, 10.0, 7, ()) == ("rankguard exchange", 0.0)
    point, wait_s = waits.sample(stack, 13.0, 7, ())
    assert wait_s == 3.0 and waits.quiet_s(13.0) == 3.0
    assert waits.exchange_early(point, wait_s, None, settle, 13.0)
    assert not waits.exchange_early(point, wait_s, None, settle, 14.0)  # asked already
    assert waits.exchange_early(point, wait_s, None, settle, 15.5)
    assert waits.sample(stack, 16.0, 8, ()) == ("rankguard exchange", 0.0)  # progress: new wait
    assert not waits.is_usual(8)
    assert waits.sample([("/home/user/train.py", 9, "main")], 17.0, 9, ()) == (None, 0.0)
    assert not waits.is_usual(9) and len(waits.usual) == 1  # it came out of that wait
    waits.sample(stack, 18.0, 9, ())
    assert waits.is_usual(9)  # back at it: a usual wait, not the odd one
    assert waits.exchange_early(None, 0.0, 1.5, settle, 18.0)  # a quiet record
    assert not waits.exchange_early(None, 0.0, 0.5, settle, 18.0)


def test_a_status_says_settled_and_quiet_past_the_settle_times_and_done_is_left_the_loop():
    from rankguard.callbacks.hang.phases import Beat, Decision
    from rankguard.callbacks.hang.rank_status import rank_status
    from rankguard.callbacks.hang.status import LEFT_LOOP

    stack = [(side_channel.__file__, 5, "_decide"), ("/home/user/train.py", 9, "main")]
    facts = {"deadlines": {"train": 30.0}, "ceilings": CEILINGS, "settle": Settle(2.0, 1.0)}
    facts |= {"libraries": (), "host": "h", "pid": 1, "gave_up": None, "progress": 7}
    facts |= {"usual": True, "decisions": {"b": Decision(1, 2), "a": Decision(0, None)}}
    facts |= {"record": (), "quiet_s": 1.5}
    beat = Beat("train_batch_start", 3, None, None, 10.0, "train")
    status = rank_status(beat, stack, "rankguard exchange", 2.5, now=14.0, **facts)
    assert (status.phase, status.idle_s, status.deadline_s, status.ceiling_s) == (
        "train batch 3",
        4.0,
        30.0,
        600.0,
    )
    assert status.settled and status.quiet and status.usual and status.progress == 7
    assert status.decisions == (("a", 0, None), ("b", 1, 2))
    early = rank_status(beat, stack, "rankguard exchange", 1.0, now=14.0, **facts | {"quiet_s": 0})
    assert not early.settled and not early.quiet
    done = rank_status(beat._replace(kind="done"), stack, None, 0.0, now=14.0, **facts)
    assert done.waits_at == LEFT_LOOP and done.settled and done.wait_s == 4.0
    assert done.deadline_s is None and not done.usual and not done.direct
    assert done.phase.startswith("left the training loop")
