"""Each rank's history, read from the step log: its batches, backward passes, windows, passes.

The verdict compares these across ranks (``tests/hang/test_verdict_cases.py``); here what the
reader keeps from each adapter's announcements, and that they are no heartbeat.
"""

from __future__ import annotations

import math

from rankguard.callbacks.core.step_log import (
    BACKWARD,
    BACKWARD_END,
    BACKWARD_OPTIMIZER_STEP,
    BATCH_END_FETCH_START,
    FETCH_END_BATCH_START,
    MICROBATCH,
    OPTIMIZER_STEP,
    StepLog,
)
from rankguard.callbacks.hang.calibration import IntervalHistory
from rankguard.callbacks.hang.history import (
    EPOCH_END,
    FIT_END,
    MAX_BACKWARDS,
    MAX_BATCHES,
    Backward,
    BatchPhases,
    History,
)
from rankguard.callbacks.hang.phases import PhaseTracker

LOOP = (BACKWARD, BACKWARD_END, OPTIMIZER_STEP)


def read(events: list[tuple[str, int]], announces=LOOP, history: History | None = None) -> History:
    """A history that read ``(event, step)`` entries (after a fit's start and its first pass)."""
    history = history or History()
    history.announces = announces
    start = [("fit_start", 0), ("epoch_start", 0)]
    history.read([(0.0, e, s, None, "eval" if e == "eval_start" else None, None)
                  for e, s in start + events])  # fmt: skip
    return history


def batch(step: int, *parts: str, end: bool = True) -> list[tuple[str, int]]:
    """One train batch's entries: its start, its parts, its end (with the next fetch)."""
    return [(FETCH_END_BATCH_START, step), *((p, 0) for p in parts)] + (
        [(BATCH_END_FETCH_START, step)] if end else []
    )


def test_a_loops_batches_backward_passes_and_windows():
    # A window of 2 backward passes: the first's batch ends before any step, the second steps.
    no_step = (BACKWARD, BACKWARD_END)
    events = batch(0, *no_step) + batch(1, *no_step, OPTIMIZER_STEP) + batch(2, BACKWARD, end=False)
    phases = read(events).phases()
    assert phases.batches == (
        BatchPhases(1, 0, 0, 1, True),
        BatchPhases(2, 1, 0, 1, True),
        BatchPhases(3, 2, 0, 1, False),
    )
    assert phases.backwards == (
        Backward(1, 1, 1, False),
        Backward(2, 2, 2, True),
        Backward(3, 3, 1, None),  # running: its window's end is not known yet
    )
    assert phases.now == "backward"
    assert (phases.knows_backwards, phases.knows_steps, phases.knows_starts) == (True, True, True)


def test_the_hf_trainers_microbatches_end_or_go_on_at_once():
    events = batch(0, MICROBATCH, MICROBATCH, BACKWARD_OPTIMIZER_STEP) + batch(
        1, MICROBATCH, end=False
    )
    phases = read(events, announces=(MICROBATCH, BACKWARD_OPTIMIZER_STEP)).phases()
    assert [b.backwards for b in phases.batches] == [3, 1]
    assert phases.backwards == (
        Backward(1, 1, 1, False),
        Backward(2, 1, 2, False),
        Backward(3, 1, 3, True),
        Backward(4, 2, 1, False),
    )
    assert phases.now == "forward"  # its next microbatch
    assert not phases.knows_starts  # the backward running now is not listed


def test_what_ran_after_a_batch_and_the_pass_it_belongs_to():
    events = [*batch(0), ("eval_start", 1), ("checkpoint_save_start", 1), ("epoch_end", 1)]
    events += [("epoch_start", 1), *batch(1), ("epoch_end", 2), ("fit_end", 2)]
    phases = read(events).phases()
    assert phases.batches == (
        BatchPhases(1, 0, 0, 0, True, ("eval of 'eval'", "save", EPOCH_END)),
        BatchPhases(2, 1, 1, 0, True, (EPOCH_END, FIT_END)),
    )


def test_a_new_fit_starts_a_new_history_and_the_history_stays_small():
    history = read([e for step in range(40) for e in batch(step, *LOOP)])
    phases = history.phases()
    assert len(phases.batches) == MAX_BATCHES and phases.batches[-1].n == 40
    assert len(phases.backwards) == MAX_BACKWARDS and phases.backwards[-1].ordinal == 40
    assert read(batch(0), history=history).phases().batches == (BatchPhases(1, 0, 0, 0, True),)


def test_a_framework_that_announces_no_steps_leaves_windows_unknown():
    phases = read(batch(0, BACKWARD) + batch(1, BACKWARD), announces=(BACKWARD,)).phases()
    assert [b.ends_window for b in phases.backwards] == [None, None]
    assert not phases.knows_steps


def test_a_batchs_parts_are_no_heartbeat_for_the_deadlines():
    steps = StepLog()
    steps.due = math.inf  # no guard acts: the log is read here
    tracker = PhaseTracker(IntervalHistory(), measure=True, warmup=0)
    steps.fetch_end_batch_start(0)
    steps.batch_end_fetch_start(0, fetch_step=1)
    steps.fetch_end_batch_start(1)  # the second batch: train intervals from here
    tracker.read(steps.entries[:], {})
    steps.entries.clear()
    beat, progress = tracker.beat, tracker.progress
    steps.backward()
    steps.backward_end()
    steps.optimizer_step()
    tracker.read(steps.entries[:], {})
    assert (tracker.beat, tracker.progress) == (beat, progress)  # no progress, same phase
    steps.entries.clear()
    steps.batch_end_fetch_start(1, fetch_step=2)
    tracker.read(steps.entries[:], {})
    assert tracker.beat.event == "data_fetch_start" and tracker.progress == progress + 1
    # The batch's interval runs from its start to its end, not to its backward.
    assert list(tracker.history.snapshot()["train"][-2:]) == [tracker.beat.at - beat.at, 0.0]
