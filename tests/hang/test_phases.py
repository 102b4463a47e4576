"""PhaseTracker: heartbeats to phase kinds, intervals, closest call and decisions (no threads)."""

from __future__ import annotations

from rankguard.callbacks.core.step_log import BATCH_END_FETCH_START, FETCH_END_BATCH_START
from rankguard.callbacks.hang.calibration import IntervalHistory
from rankguard.callbacks.hang.phases import ClosestCall, Decision, PhaseTracker

DEADLINES = {"startup": 50.0, "train": 10.0, "data": 10.0, "eval": 20.0, "post_eval": 30.0}
#: A fit's heartbeats and the phase kind that applies after each.
WALK = [
    ("fit_start", "startup"),
    ("train_batch_start", "startup"),
    ("train_batch_end", "train"),
    ("eval_batch_start", "eval"),
    ("eval_end", "post_eval"),
    ("epoch_end", "post_eval"),
    ("data_fetch_start", "data"),
    ("train_batch_start", "train"),
    ("checkpoint_save_start", "checkpoint"),
    ("checkpoint_save_end", "train"),
    ("fit_end", "done"),
]


def _tracker(warmup: int = 0, measure: bool = True) -> PhaseTracker:
    return PhaseTracker(IntervalHistory(), measure=measure, warmup=warmup)


def _entry(at: float, event: str, step: int = 0, decisions: dict | None = None) -> tuple:
    return (at, event, step, None, None, decisions)


def test_each_heartbeat_starts_the_phase_whose_deadline_applies():
    one_by_one, at_once = _tracker(), _tracker()
    for i, (event, kind) in enumerate(WALK):
        one_by_one.read([_entry(float(i), event)], DEADLINES)
        assert (event, one_by_one.beat.kind) == (event, kind)
    at_once.read([_entry(float(i), event) for i, (event, _) in enumerate(WALK)], DEADLINES)
    assert at_once.beat == one_by_one.beat and at_once.progress == len(WALK)
    assert at_once.history.snapshot() == one_by_one.history.snapshot()
    assert at_once.steps_done == one_by_one.steps_done == 1


def test_intervals_are_recorded_by_the_kind_of_their_first_heartbeat_after_warmup():
    tracker = _tracker(warmup=1)
    tracker.read([_entry(0.0, "fit_start"), _entry(1.0, "train_batch_start")], DEADLINES)
    tracker.read([_entry(3.0, "train_batch_end")], DEADLINES)  # still warming up
    assert not any(tracker.history.snapshot().values())
    tracker.read([_entry(3.5, "data_fetch_start"), _entry(4.0, FETCH_END_BATCH_START)], DEADLINES)
    tracker.read(
        [_entry(6.0, BATCH_END_FETCH_START), _entry(9.0, FETCH_END_BATCH_START)], DEADLINES
    )
    recent = tracker.history.snapshot()
    # train: batch end -> fetch 0.5 s, batch 2 s, and a zero within each paired entry
    assert sorted(recent["train"]) == [0.0, 0.0, 0.0, 0.5, 2.0]
    assert sorted(recent["data"]) == [0.5, 3.0]
    assert tracker.steps_done == 2 and tracker.beat.kind == "train"
    assert tracker.closest_call == ClosestCall(0.3, "data", 3.0, 10.0)


def test_no_interval_is_measured_without_calibration_and_a_new_fit_starts_over():
    tracker = _tracker(measure=False)
    tracker.read([_entry(float(i), e) for i, (e, _) in enumerate(WALK)], DEADLINES)
    assert not any(tracker.history.snapshot().values()) and tracker.closest_call is None
    measured = _tracker()
    measured.read([_entry(0.0, "train_batch_end"), _entry(4.0, "fit_start")], DEADLINES)
    assert measured.steps_done == 0 and measured.closest_call is None
    assert measured.beat.kind == "startup"


def test_decisions_keep_the_step_at_which_each_last_changed():
    tracker = _tracker()
    tracker.read([_entry(0.0, "fit_start", 0, {"should_stop": False})], DEADLINES)
    tracker.read([_entry(1.0, "train_batch_end", 3, {"should_stop": False})], DEADLINES)
    tracker.update_decisions({"should_stop": True}, 5)
    assert tracker.decisions == {"should_stop": Decision(True, 5)}
    tracker.reset()
    assert tracker.decisions == {} and tracker.steps_done == 0 and tracker.beat is not None
