"""Calibrated hang deadlines and the two-stage verdict, from recorded histories (pure, fast)."""

from __future__ import annotations

import pickle
import random

import pytest

from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.guard import GuardRunner
from rankguard.callbacks.hang.calibration import (
    WINDOW,
    IntervalHistory,
    calibrate,
    quantile,
    save_estimate_s,
)
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog, attempt_dir
from rankguard.callbacks.hang.status import RankStatus
from rankguard.callbacks.hang.verdict import diagnose

CEILINGS = {"train": 600.0, "data": 600.0, "eval": 600.0, "post_eval": 600.0, "checkpoint": 1800.0}


def _history(**intervals: list[float]) -> IntervalHistory:
    history = IntervalHistory()
    for kind, values in intervals.items():
        for seconds in values:
            history.record(kind, seconds)
    return history


def _seconds(history: IntervalHistory, **kwargs) -> dict[str, tuple[float, str]]:
    settings = {"factor": 10.0, "floor_s": 30.0, **kwargs}
    return {k: (d.seconds, d.source) for k, d in calibrate(history, CEILINGS, **settings).items()}


def test_quantile_is_the_nearest_rank_upper_value():
    values = [float(i) for i in range(1, 101)]
    assert quantile(values, 0.99) == 99.0
    assert quantile([*values, 1000.0], 0.99) == 100.0  # one outlier in 101 is not the p99
    assert quantile([3.0], 0.99) == 3.0


def test_defaults_on_50ms_steps_report_every_phase_within_the_floor():
    # The run: 50 ms steps with jitter, a GC pause, 60 steps, nothing else seen yet.
    rng = random.Random(0)
    train = [rng.uniform(0.04, 0.06) for _ in range(180)] + [0.4]
    data = [rng.uniform(0.001, 0.003) for _ in range(60)]
    deadlines = _seconds(_history(train=train, data=data), save_estimate=save_estimate_s(10, 30))
    # Every phase, seen or not, gets the 30 s floor: a stall is reported within 30 s + one
    # exchange period (10 s), inside the 60 s target, instead of at the 600 s ceiling.
    assert deadlines == {
        "train": (30.0, "floor"),
        "data": (30.0, "floor"),
        "eval": (30.0, "floor"),
        "post_eval": (30.0, "floor"),
        "checkpoint": (31.0, "derived"),  # 10 parameters: 30 s + 8 us, rounded up
    }


def test_calibration_is_a_multiple_of_the_p99_and_twice_the_longest_interval():
    train = [0.1] * 100 + [0.5]  # a rare pause: 2 x 0.5 s, above 10 x the p99
    eval_batches = [0.2] * 40
    deadlines = _seconds(_history(train=train, eval=eval_batches), floor_s=0.5)
    assert deadlines["train"] == (1.0, "calibrated")  # max(10 x 0.1, 2 x 0.5)
    assert deadlines["eval"] == (2.0, "calibrated")  # 10 x 0.2
    # Unseen phases are derived from seen ones with 3x the factor: a data fetch like a train
    # step, the first post-eval transition one train step plus the eval-end work.
    assert deadlines["data"] == (pytest.approx(3.0), "derived")  # 30 x 0.1
    assert deadlines["post_eval"] == (pytest.approx(9.0), "derived")  # 30 x (0.1 + 0.2)
    assert deadlines["checkpoint"] == (1800.0, "ceiling")  # model unknown


def test_few_samples_keep_at_least_the_derived_deadline_and_never_pass_the_ceiling():
    train = [0.1] * 20
    # One post-eval transition seen, shorter than derived: the derived deadline stays.
    few = _seconds(_history(train=train, post_eval=[0.05]), floor_s=0.5)
    assert few["post_eval"] == (pytest.approx(3.0), "derived")
    # A long first eval batch (loader start-up): with 2 samples the p99 is that one.
    slow = _seconds(_history(train=train, eval=[4.0, 0.1]), floor_s=0.5)
    assert slow["eval"] == (40.0, "calibrated")
    # Too few train intervals after the warm-up: nothing to calibrate or derive from.
    early = _seconds(_history(train=[0.1] * 7), floor_s=0.5)
    assert early["train"] == (600.0, "ceiling") and early["eval"] == (600.0, "ceiling")
    # Slow phases are capped at their ceiling.
    capped = _seconds(_history(train=[100.0] * 20), floor_s=0.5)
    assert capped["train"] == (600.0, "ceiling") and capped["data"] == (600.0, "ceiling")


def test_first_checkpoint_save_deadline_grows_with_the_model():
    history = _history(train=[0.1] * 20)
    small = _seconds(history, save_estimate=save_estimate_s(1_000_000, 30.0))
    assert small["checkpoint"] == (31.0, "derived")  # 16 MB at 20 MB/s + floor, rounded up
    large = _seconds(history, save_estimate=save_estimate_s(7_000_000_000, 30.0))
    assert large["checkpoint"] == (1800.0, "ceiling")
    seen = _seconds(_history(train=[0.1] * 20, checkpoint=[5.0] * 8), save_estimate=1e4)
    assert seen["checkpoint"] == (50.0, "calibrated")  # 8 saves seen: their own 10 x p99


def test_history_keeps_a_window_and_survives_a_checkpoint_round_trip():
    history = _history(train=[i / 64 for i in range(WINDOW + 100)], eval=[0.25, 0.5])
    assert history.count("train") == WINDOW
    state = pickle.loads(pickle.dumps(history.state_dict()))  # plain values only
    restored = IntervalHistory()
    assert restored.load_state_dict(state)
    assert restored.snapshot() == history.snapshot()
    assert restored.peaks == history.peaks
    assert _seconds(restored, floor_s=0.1) == _seconds(history, floor_s=0.1)
    assert not IntervalHistory().load_state_dict({})
    assert not IntervalHistory().load_state_dict({"version": 99, "recent": {"train": [1.0]}})


def test_watchdog_state_goes_through_the_runner_and_starts_a_resumed_fit_calibrated(tmp_path):
    trained = HangWatchdog(report_dir=str(tmp_path), warmup_steps=0, floor_s=0.5)
    for kind, seconds in [("train", 0.1)] * 20 + [("eval", 0.2)] * 10:
        trained.history.record(kind, seconds)
    state = GuardRunner([trained]).state_dict()
    assert list(state) == ["hang_watchdog"] and "calibration" in state["hang_watchdog"]
    assert GuardRunner([HangWatchdog(report_dir=str(tmp_path))]).state_dict() == {}

    resumed = HangWatchdog(report_dir=str(tmp_path), floor_s=0.5)
    GuardRunner([resumed]).load_state_dict(state)
    resumed.on_fit_start(EventFacts())  # starts the thread: calibrated before any step
    try:
        assert resumed.deadlines["train"] == 1.0 and resumed.deadlines["eval"] == 2.0
        assert "calibrated from the checkpoint: train 1 s (calibrated)" in resumed._watch.plan()
    finally:
        resumed.close()
    fresh = HangWatchdog(report_dir=str(tmp_path), floor_s=0.5)
    fresh.on_fit_start(EventFacts())
    fresh.close()
    assert fresh.deadlines["train"] == 600.0  # warming up: the ceiling


def _status(phase, idle, deadline, ceiling, blocked=None, gave_up=None):
    return RankStatus(phase, 5, idle, deadline, "node", 1, blocked, ceiling, gave_up)


def test_stage_1_past_the_calibrated_deadline_and_stage_2_past_the_ceiling():
    waiting = _status("train batch 5", 10.0, 30.0, 600.0)
    stage1 = diagnose({0: waiting, 1: _status("after eval of 'eval'", 31.0, 30.0, 600.0)})
    assert stage1.stuck == ((1, 1),) and not stage1.end
    assert stage1.summary == (
        "rank 1 stuck 31 s in after eval of 'eval' (deadline 30 s, calibrated; ceiling 600 s); "
        "rank 0 waiting 10 s in train batch 5"
    )
    assert stage1.slack_s == 20.0 and stage1.ceiling_slack_s == 590.0
    stage2 = diagnose({0: waiting, 1: _status("after eval of 'eval'", 601.0, 30.0, 600.0)})
    assert stage2.stuck == ((1, 1),) and stage2.end


def test_an_open_incident_keeps_its_culprit_when_the_waiting_rank_passes_its_deadline():
    # Rank 0 waits for rank 1 in a gradient all-reduce (no Python frame shows it): past its
    # own deadline later, it is still the one waiting, and rank 1's ceiling ends the incident.
    statuses = {
        0: _status("train batch 6", 590.0, 30.0, 600.0),
        1: _status("after eval of 'eval'", 601.0, 30.0, 600.0),
    }
    assert diagnose(statuses).stuck == ((0, 1),)  # without the incident: both look stuck
    verdict = diagnose(statuses, incident=((1, 1),))
    assert verdict.stuck == ((1, 1),) and verdict.end
    assert "rank 0 waiting 590 s in train batch 6" in verdict.summary


def test_a_rank_another_check_gave_up_on_is_stuck_and_ends_the_incident_at_once():
    gave_up = ("batch_parity_guard/epoch_start", (1,), 300.0)
    blocked = "rankguard exchange, called from batch_parity_guard.py:331 (_compare_planned)"
    verdict = diagnose(
        {
            0: _status("epoch start at step 64", 300.5, 30.0, 600.0, blocked, gave_up),
            1: _status("after eval of 'eval'", 301.0, 400.0, 600.0),  # not even past its deadline
        }
    )
    assert verdict.stuck == ((1, 1),) and verdict.end and verdict.first == 1
    assert verdict.summary.startswith(
        "rank 1 stuck 301 s in after eval of 'eval' (deadline 400 s, calibrated; ceiling 600 s); "
        f"rank 0 waiting 300 s in epoch start at step 64 (blocked in {blocked})"
    )
    assert verdict.details[0].startswith(
        "rank 1 did not reach rankguard exchange 'batch_parity_guard/epoch_start' within 300 s; "
        "the ranks waiting there gave up, so the incident ends now, before the ceiling (if it "
        "is only slow there, raise that check's timeout: `exchange_timeout_s`"
    )


def test_each_torchrun_restart_attempt_reports_into_its_own_folder(tmp_path):
    assert attempt_dir(tmp_path, {}) == tmp_path
    # torchrun without restarts: the report goes where the docs say, report_dir itself.
    once = {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    assert attempt_dir(tmp_path, once) == tmp_path
    restarts = {"TORCHELASTIC_MAX_RESTARTS": "1"}
    first = {**restarts, "TORCHELASTIC_RESTART_COUNT": "0"}
    assert attempt_dir(tmp_path, first) == tmp_path / "attempt0"
    second = {**restarts, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert attempt_dir(tmp_path, second) == tmp_path / "attempt1"


def test_a_waiting_rank_past_its_shorter_deadline_names_the_rank_it_waits_for():
    # Found in a real Composer run: rank 0 waits in the data fetch's all_reduce (derived
    # deadline 4.6 s) for rank 1, stuck after eval (derived deadline 7.6 s).
    blocked = "all_reduce, called from trainer.py:3634 (_iter_dataloader)"
    verdict = diagnose(
        {
            0: _status("data fetch for train batch 4", 5.0, 4.6, 20.0, blocked),
            1: _status("after eval of 'eval'", 4.9, 7.6, 8.0),  # sampled a little earlier
        }
    )
    assert verdict.stuck == ((1, 1),) and not verdict.end
    assert verdict.summary == (
        "rank 1 stuck 5 s in after eval of 'eval' (deadline 7.6 s, calibrated; ceiling 8 s); "
        f"rank 0 waiting 5 s in data fetch for train batch 4 (blocked in {blocked})"
    )
    # A rank that moved on since (less idle than the waiting one) is not what it waits for.
    moved_on = diagnose(
        {
            0: _status("after eval of 'eval'", 5.0, 4.6, 8.0, blocked),
            1: _status("train batch 9", 1.0, 30.0, 600.0),
        }
    )
    assert moved_on.stuck == ((0, 0),)
