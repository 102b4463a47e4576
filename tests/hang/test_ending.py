"""The one exit path (``hang/ending.py``): its order, its meeting of the ranks, its bounds.

Each kind of end goes through it: a verdict (tests/hang/test_hang_watchdog.py), a
peer's fault and a teardown past its bound (tests/hang/test_faults.py), a rank on
another node (tests/hang/test_fault_nodes.py); their exit codes are asserted there.
"""

from __future__ import annotations

import time

import pytest

from rankguard.callbacks.core import torch_private
from rankguard.callbacks.hang import ending
from tests.mp import run_ranks


def _end(rank, world_size, delay_s, absent):
    import torch.distributed as dist

    from rankguard.callbacks.core.side_channel import SideChannel

    channel = SideChannel.from_environment(timeout_s=10)
    assert channel.store is not None  # this thread's connection, opened before the timing
    if rank in absent:  # a rank that never reaches the end (frozen, or on a lost node)
        time.sleep(12)
        return None
    steps = []
    time.sleep(delay_s if rank else 0.0)
    started = time.monotonic()
    try:
        ending.end_process(
            75,
            channel=channel,
            why="a test",
            evidence=lambda: steps.append(("evidence", dist.is_initialized())),
            leaving=lambda: steps.append(("leaving", dist.is_initialized())),
            window_s=1.0,
            exit_=lambda code: steps.append(("exit", code)),
        )
    except SystemExit as ended:  # the recorder returned: end_process still never returns
        steps.append(("SystemExit", ended.code))
    return steps, time.monotonic() - started


def test_the_evidence_comes_first_the_groups_are_aborted_before_the_ranks_meet():
    outcomes = run_ranks(_end, 2, 1.0, (), timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
        steps, _ = o.value
        # evidence while the process group is open; aborted before this rank says it leaves
        assert steps == [("evidence", True), ("leaving", False), ("exit", 75), ("SystemExit", 75)]
    took = [o.value[1] for o in outcomes]
    # rank 0, which may host the store, waited for rank 1 (1 s late); rank 1 did not wait
    assert took[0] >= 0.9 and took[1] < 0.9, took


@pytest.mark.slow
def test_a_rank_that_never_reaches_the_end_is_waited_for_one_window_only():
    outcomes = run_ranks(_end, 2, 0.0, (1,), timeout_s=60, until=[0])
    assert outcomes[0].error is None, outcomes[0].error
    steps, took = outcomes[0].value
    assert steps[-2:] == [("exit", 75), ("SystemExit", 75)]
    assert 0.9 <= took < 3.0, took  # the 1 s window, not its last request's wait as well


def test_an_abort_that_does_not_return_is_left_behind(monkeypatch):
    monkeypatch.setattr(torch_private, "abort_process_groups", lambda: time.sleep(30))
    started = time.monotonic()
    outcome = ending.abort_process_groups(wait_s=0.5)
    assert outcome == "abort still running after 0.5 s: left behind"
    assert time.monotonic() - started < 2.0


def test_without_a_process_group_there_is_nothing_to_abort():
    assert ending.abort_process_groups() == "none open"
