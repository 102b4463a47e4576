"""Proven deadlocks: the pure rules (wait points, user frame, split, verdict), then 2 real ranks."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from rankguard.callbacks.core import side_channel
from rankguard.callbacks.core.events import Event, EventFacts, SplitDecision
from rankguard.callbacks.hang import collective_sources
from rankguard.callbacks.hang.stacks import (
    blocked_in,
    called_from_user,
    library_paths,
    rendezvous,
    user_frame,
)
from rankguard.callbacks.hang.status import LEFT_LOOP, RankStatus
from rankguard.callbacks.hang.verdict import deadlock_key, odd_rank_of
from rankguard.callbacks.hang.verdict import diagnose as _diagnose
from rankguard.callbacks.hang.verdict_text import split_sentence as _split_sentence
from tests.mp import run_ranks

TORCH = os.path.dirname(torch.__file__)
C10D = os.path.join(TORCH, "distributed", "distributed_c10d.py")
BACKWARD = os.path.join(TORCH, "autograd", "graph.py")
DCP = os.path.join(TORCH, "distributed", "checkpoint", "filesystem.py")
TRAIN = "/home/me/project/train.py"
#: An adapter's words for its decisions (as Lightning's and the HF Trainer's hand them in).
WORDS = {
    "should_stop": SplitDecision(fix="reduce it across ranks (Lightning's words)"),
    "should_training_stop": SplitDecision(fix="gather the metric first (the HF Trainer's words)"),
    "sync_dist_keys": SplitDecision(
        told="logged with sync_dist=True{at}: {value}", now=True, context="sync_dist_loop"
    ),
}


def diagnose(statuses, **kw):
    return _diagnose(statuses, split_decisions=WORDS, **kw)


def odd_rank(statuses):
    return odd_rank_of(statuses, WORDS)


def split_sentence(statuses):
    return _split_sentence(statuses, WORDS)


def _status(
    waits_at=None, frame="train.py:107 (epoch_end)", settled=True, progress=5, **kw
) -> RankStatus:
    return RankStatus(
        phase=kw.pop("phase", "epoch end"),
        step=80,
        idle_s=kw.pop("idle_s", 4.0),
        deadline_s=30.0,
        host="h",
        pid=1,
        user_frame=frame,
        waits_at=waits_at,
        wait_s=4.0,
        settled=settled,
        progress=progress,
        **kw,
    )


def test_rendezvous_is_a_collective_backward_or_rankguard_exchange_not_other_distributed_code():
    assert rendezvous([(C10D, 10, "all_reduce"), (TRAIN, 107, "epoch_end")]) == "all_reduce"
    assert rendezvous([(BACKWARD, 5, "_engine_run_backward"), (TRAIN, 1, "f")]) == "backward"
    assert rendezvous([(side_channel.__file__, 5, "_decide")]) == "rankguard exchange"
    ddp = os.path.join(TORCH, "nn", "parallel", "distributed.py")
    sync = [(ddp, 2107, "_distributed_broadcast_coalesced"), (ddp, 2170, "_sync_module_buffers")]
    assert rendezvous(sync) == "broadcast"  # DDP's buffer broadcast before each forward
    # the record of collectives wraps the C++ broadcast DDP calls: still DDP's broadcast
    told = [(collective_sources.__file__, 215, "broadcast_coalesced"), *sync]
    assert rendezvous(told) == "broadcast"
    forward = (collective_sources.__file__, 230, "forward")  # its wrapper of DDP's forward
    called = blocked_in([*told, forward, (TRAIN, 87, "main")])
    assert called == "_distributed_broadcast_coalesced, called from train.py:87 (main)"
    assert rendezvous([(DCP, 5, "write_data"), (TRAIN, 1, "save")]) is None  # writing: busy
    assert rendezvous([(TRAIN, 107, "epoch_end")]) is None  # the user's own code: busy


def test_user_frame_is_the_innermost_frame_outside_libraries_with_its_source_line():
    here = os.path.abspath(__file__)
    stack = [(C10D, 10, "all_reduce"), (here, 1, "caller"), (TRAIN, 9, "main")]
    assert user_frame(stack, library_paths()).startswith("test_verdict_deadlock.py:1 (caller): ")
    assert user_frame([(C10D, 10, "all_reduce")], library_paths()) is None


def test_every_rank_at_a_different_rendezvous_is_a_deadlock_a_slow_rank_never_is():
    split = {0: _status("all_reduce"), 1: _status("backward", frame="train.py:150 (step)")}
    assert deadlock_key(split) is not None
    # Rank 0 busy in its own code (writing a file, logging) while rank 1 waits: slow, not stuck.
    slow = {0: _status(None), 1: _status("barrier", frame="train.py:90 (save)")}
    assert deadlock_key(slow) is None
    same = {0: _status("all_reduce"), 1: _status("all_reduce")}  # one slow collective
    assert deadlock_key(same) is None
    fresh = {0: _status("all_reduce"), 1: _status("backward", frame="x.py:1 (f)", settled=False)}
    assert deadlock_key(fresh) is None  # a collective on its way


def test_a_deadlock_is_proven_by_two_exchanges_without_progress():
    statuses = {0: _status("all_reduce"), 1: _status("backward", frame="train.py:150 (step)")}
    first = diagnose(statuses)
    assert not first.deadlock and first.suspect is not None and not first.stuck
    second = diagnose(statuses, suspect=first.suspect)
    assert second.deadlock and second.stuck == ((0, 1),)
    assert second.summary.startswith("deadlock, every rank waits at a rendezvous")
    moved = {**statuses, 1: _status("backward", frame="train.py:150 (step)", progress=6)}
    assert not diagnose(moved, suspect=first.suspect).deadlock  # rank 1 made progress


def test_next_points_at_the_rank_whose_wait_point_is_not_the_usual_one():
    usual = _status("backward", frame="model.py:150 (training_step)", usual=True)
    odd = _status("barrier", frame="model.py:152 (training_step): self.log(...)")
    assert odd_rank({0: usual, 1: odd}) == 1
    assert odd_rank({0: odd, 1: usual}) == 0
    # Two ranks, two collectives: the one the user's own code calls, not the framework's.
    fetch = _status("all_reduce", frame="train.py:146 (fit): trainer.fit()")
    side = _status("all_reduce", frame="cb.py:84 (epoch_end): dist.all_reduce(t)", direct=True)
    assert odd_rank({0: fetch, 1: side}) == 1
    many = {r: _status("backward", frame="a.py:1 (f)") for r in range(4)}
    assert odd_rank({**many, 2: odd}) == 2


def test_the_decision_that_split_the_ranks_is_said_in_one_sentence():
    stop = _status(decisions=(("should_stop", True, 83),))
    go = _status(decisions=(("should_stop", False, 0),))
    assert split_sentence({0: stop, 1: go}) == "rank 0 set should_stop at step 83; rank 1 did not."
    keys = _status(decisions=(("sync_dist_keys", ("extra", "loss"), 12),))
    base = _status(decisions=(("sync_dist_keys", ("loss",), 12),))
    assert split_sentence({0: base, 1: keys}) == (
        "rank 0 logged with sync_dist=True at step 80: loss; "
        "rank 1 logged with sync_dist=True at step 80: extra, loss."
    )
    save = _status(decisions=(("save", True, 40),))
    assert split_sentence({0: save, 1: _status()}) == (
        "rank 0 entered a checkpoint save at step 40; rank 1 did not."
    )
    assert split_sentence({0: go, 1: go}) is None
    # The names a rank reduces, as a reduction check saw them change (Composer's loss keys).
    loss = _status(decisions=(("names:composer_loss", ("loss/train/total",), 1),))
    aux = (("names:composer_loss", ("loss/train/aux", "loss/train/total"), 5),)
    assert split_sentence({0: loss, 1: _status(decisions=aux)}) == (
        "rank 0 reduced loss/train/total at step 1; "
        "rank 1 reduced loss/train/aux, loss/train/total at step 5."
    )


def _left(step=83, stop=True) -> RankStatus:
    """A rank whose fit ended, as its watchdog sends it (no deadline, settled at once)."""
    return RankStatus(
        phase=f"{LEFT_LOOP} at step {step}" + (" (should_stop set)" if stop else ""),
        step=step,
        idle_s=4.0,
        deadline_s=None,
        host="h",
        pid=1,
        user_frame="train.py:160 (main): trainer.fit(model)",
        waits_at=LEFT_LOOP,
        wait_s=4.0,
        settled=True,
        progress=9,
        decisions=(("should_stop", stop, step),),
    )


def test_a_rank_that_left_the_loop_while_another_waits_in_it_is_a_proven_deadlock():
    waits = _status("backward", frame="model.py:150 (training_step)", usual=True)
    waits = RankStatus(**{**vars(waits), "decisions": (("should_stop", False, 0),)})
    statuses = {0: _left(), 1: waits}
    first = diagnose(statuses)
    assert not first.deadlock and first.suspect is not None  # seen once: a suspicion
    verdict = diagnose(statuses, suspect=first.suspect)
    assert verdict.deadlock and verdict.stuck == ((0, 1),) and verdict.first == 0
    assert verdict.summary.startswith(
        "deadlock, rank 0 left the training loop while the others wait at a rendezvous in it: "
        "rank 0 left the training loop at step 83 (should_stop set) 4 s ago; "
        "rank 1 waiting 4 s in backward at model.py:150 (training_step)"
    ), verdict.summary
    text = "\n".join(verdict.details)
    assert "What split them: rank 0 set should_stop at step 83; rank 1 did not." in text, text
    assert "Next: fix the stop decision of rank 0: it left the training loop at step 83" in text
    assert "exit code 70, do not restart" in text
    # Its code moved on since (another frame): still the same wait point, still proven.
    moved = {**statuses, 0: RankStatus(**{**vars(_left()), "user_frame": "train.py:170 (main)"})}
    assert diagnose(moved, suspect=first.suspect).deadlock


def test_ranks_leaving_the_loop_together_or_one_still_working_are_never_a_deadlock():
    assert deadlock_key({0: _left(), 1: _left(step=84, stop=False)}) is None  # a normal end
    assert deadlock_key({0: _left(), 1: _status(None)}) is None  # rank 1 computes: slow
    young = _status("backward", frame="model.py:150 (training_step)", settled=False)
    assert deadlock_key({0: _left(), 1: young}) is None  # its collective may be on its way
    assert odd_rank({0: _status("all_reduce"), 1: _left()}) == 1


def test_a_rank_that_set_should_stop_alone_is_named_first_with_its_stop_decision():
    stop = _status("rankguard exchange", decisions=(("should_stop", True, 3),))
    go = _status("broadcast", frame="t.py:9 (main)", decisions=(("should_stop", False, 0),))
    statuses = {0: stop, 1: go}
    assert odd_rank(statuses) == 0
    verdict = diagnose(statuses, suspect=diagnose(statuses).suspect)
    assert verdict.deadlock and verdict.first == 0
    assert "Next: fix the stop decision of rank 0: it set should_stop at step 3" in "\n".join(
        verdict.details
    )


def test_metric_keys_read_in_different_loops_are_no_split():
    def logged(keys, loop, waits_at):
        decisions = (("sync_dist_keys", keys, 8), ("sync_dist_loop", loop, 8))
        return _status(waits_at, decisions=decisions)

    # Rank 0 still in validation (val_loss synced), rank 1 back in training: nothing split them.
    train = logged((), "train", "broadcast")
    assert split_sentence({0: logged(("val_loss",), "validate", "all_gather"), 1: train}) is None
    assert split_sentence({0: train, 1: logged(("extra",), "train", "barrier")}) == (
        "rank 1 logged with sync_dist=True at step 80: extra; rank 0 did not."
    )


def test_the_stop_advice_is_the_adapters_own_for_the_decision_that_split_the_ranks():
    from rankguard.integrations.lightning.words import SPLIT_DECISIONS as LIGHTNING
    from rankguard.integrations.transformers.facts import SPLIT_DECISIONS as HF

    def advice(name, words):
        stop = _status("rankguard exchange", decisions=((name, True, 3),))
        go = _status("broadcast", frame="t.py:9 (main)", decisions=((name, False, 0),))
        statuses = {0: stop, 1: go}
        verdict = _diagnose(statuses, suspect=_diagnose(statuses).suspect, split_decisions=words)
        assert verdict.deadlock and verdict.first == 0
        return "\n".join(verdict.details)

    hf = advice("should_training_stop", HF)  # the HF Trainer's control.should_training_stop
    assert "What split them: rank 0 set should_training_stop at step 3; rank 1 did not." in hf
    assert "Next: fix the stop decision of rank 0: it set should_training_stop at step 3" in hf
    assert "`EarlyStoppingCallback`" in hf and "`control.should_training_stop` on every" in hf
    assert "Lightning" not in hf
    assert "`trainer.strategy.reduce_boolean_decision`" in advice("should_stop", LIGHTNING)
    # A rank that left with no stop decision told (Composer's stop_training): general advice.
    composer = RankStatus(**{**vars(_left(stop=False)), "decisions": ()})
    gone = {0: composer, 1: _status("backward", frame="model.py:150 (training_step)")}
    verdict = _diagnose(gone, suspect=_diagnose(gone).suspect)
    text = "\n".join(verdict.details)
    assert verdict.deadlock and "Next: fix the stop decision of rank 0: it left" in text, text
    assert "(reduce the decision across ranks, or base it on a metric synced" in text
    assert "Lightning" not in text and "EarlyStopping" not in text
    assert "What split them" not in text  # not set and not reported: no split told


def test_no_framework_is_named_in_the_hang_verdicts_code():
    import rankguard.callbacks.hang as hang

    folder = os.path.dirname(hang.__file__)
    verdict = ("status.py", "verdict.py", "verdict_text.py", "stacks.py", "collective_compare.py")
    for name in verdict:
        if name:
            text = open(os.path.join(folder, name), encoding="utf-8").read()
            for word in ("should_stop", "should_training_stop", "sync_dist", "EarlyStopping"):
                assert word not in text, (name, word)


def test_a_rendezvous_reached_through_a_framework_is_not_called_from_the_users_code():
    site = os.path.dirname(TORCH)
    lightning = os.path.join(site, "lightning", "pytorch", "core", "module.py")
    stack = [
        (BACKWARD, 824, "_engine_run_backward"),
        (lightning, 1137, "backward"),
        (TRAIN, 9, "f"),
    ]
    assert not called_from_user(stack, library_paths())
    assert called_from_user([(C10D, 10, "all_reduce"), (TRAIN, 107, "epoch_end")], library_paths())


# -- the watchdog on two real ranks (gloo, spawned processes) ------------------------------


def _watchdog(report_dir: str):
    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    watchdog = HangWatchdog(
        report_dir=report_dir, timeout_s=60, deadlock_after_s=1.5, exchange_period_s=5
    )
    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    watchdog.on_fit_start(EventFacts())
    for step in range(3):
        watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step + 1))
    return watchdog


def write_samples_on_rank0(seconds: float) -> None:
    """Rank-0-only work in the user's code (writing a file), as a healthy job does."""
    time.sleep(seconds)


def _rank0_works_alone_while_rank1_waits(rank, world_size, report_dir):
    import torch.distributed as dist

    watchdog = _watchdog(report_dir)
    if rank == 0:
        write_samples_on_rank0(5.0)  # more than 3 x deadlock_after_s
    dist.barrier()
    watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=3))
    watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=4))
    watchdog.on_fit_end(EventFacts(step=4))
    watchdog.close()
    return watchdog.incidents


@pytest.mark.slow
def test_rank0_only_work_while_the_others_wait_in_a_barrier_is_never_a_deadlock(tmp_path):
    outcomes = run_ranks(_rank0_works_alone_while_rank1_waits, 2, str(tmp_path), timeout_s=60)
    assert [(o.error, o.value) for o in outcomes] == [(None, 0), (None, 0)], outcomes
    assert not (tmp_path / "summary.txt").exists()


def reduce_under_if_rank_0(group) -> None:
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1), group=group)


def _split_collectives(rank, world_size, report_dir):
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    watchdog = _watchdog(report_dir)
    try:
        if rank == 0:
            reduce_under_if_rank_0(group)  # the bug: rank 1 never calls it
        dist.barrier()
    finally:  # error-then-close, as the adapters do: rank 1 exits 70 first and gloo may
        watchdog.close()  # raise "Connection closed by peer" in rank 0 before its own exit


@pytest.mark.slow
def test_collective_on_one_rank_is_a_proven_deadlock_ending_every_rank_with_70(tmp_path):
    from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE

    start = time.monotonic()
    outcomes = run_ranks(_split_collectives, 2, str(tmp_path), timeout_s=60)
    assert [o.exitcode for o in outcomes] == [DEADLOCK_EXIT_CODE] * 2, outcomes
    assert time.monotonic() - start < 30  # seconds after the split, not the harness's kill
    summary = (tmp_path / "summary.txt").read_text()
    assert "rank 0: your code at test_verdict_deadlock.py:" in summary
    assert "(reduce_under_if_rank_0): dist.all_reduce(torch.ones(1), group=group)" in summary
    assert "Next: fix the code path at rank 0's wait point" in summary, summary
    # The record of collectives sees it too, and names the same rank and line.
    assert "Collectives issued: group 1 (ranks 0,1): rank 0 issued 1; rank 1 issued 0; " in summary
    assert "rank 0: all_reduce float32[1] at test_verdict_deadlock.py:" in summary


def _rank0_leaves_the_loop(rank, world_size, report_dir, split):
    import torch.distributed as dist

    watchdog = _watchdog(report_dir)
    if rank == 0 and split:  # the bug: rank 0 alone decided to stop after step 3
        watchdog.on_fit_end(EventFacts(step=3))
        started = time.monotonic()
        watchdog.close()  # the watchdog ends the process from here
        return time.monotonic() - started
    dist.barrier()  # rank 1 goes on into its next collective (both ranks when healthy)
    watchdog.on_fit_end(EventFacts(step=3))
    started = time.monotonic()
    watchdog.close()
    return watchdog.incidents, time.monotonic() - started


@pytest.mark.slow
def test_a_rank_leaving_the_loop_alone_ends_every_rank_with_70_together_is_silent(tmp_path):
    from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE

    start = time.monotonic()
    outcomes = run_ranks(_rank0_leaves_the_loop, 2, str(tmp_path), True, timeout_s=60)
    assert [o.exitcode for o in outcomes] == [DEADLOCK_EXIT_CODE] * 2, outcomes
    assert time.monotonic() - start < 30  # seconds after the split, not the harness's kill
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("deadlock, rank 0 left the training loop while the others"), summary
    assert "rank 0 left the training loop at step 3" in summary
    assert "rank 1 waiting" in summary and "in barrier at test_verdict_deadlock.py:" in summary
    assert "Next: fix the stop decision of rank 0" in summary, summary
    healthy = tmp_path / "healthy"
    healthy.mkdir()
    outcomes = run_ranks(_rank0_leaves_the_loop, 2, str(healthy), False, timeout_s=60)
    assert [o.error for o in outcomes] == [None, None], outcomes
    assert [o.value[0] for o in outcomes] == [0, 0] and not any(healthy.iterdir())
    assert max(o.value[1] for o in outcomes) < 1.0, outcomes  # close() does not hold the exit


def test_with_deadlock_action_report_the_deadlock_still_ends_at_the_ceiling():
    past = {r: _status("all_reduce" if r else "barrier", idle_s=700.0) for r in (0, 1)}
    first = diagnose(past)
    verdict = diagnose(past, suspect=first.suspect)
    assert verdict.deadlock and verdict.end  # past the 30 s deadline (no ceiling given)
    young = {r: _status("all_reduce" if r else "barrier", idle_s=4.0) for r in (0, 1)}
    assert not diagnose(young, suspect=diagnose(young).suspect).end


def _comprehension_code():
    def reduce_metrics(names):
        return [sys._getframe().f_code for _ in names]  # Python 3.11: the <listcomp>'s code

    return reduce_metrics(["loss"])[0]


def test_a_collective_issued_in_a_comprehension_names_the_function_it_is_written_in():
    from rankguard.callbacks.hang.stacks import code_name

    assert code_name(_comprehension_code()) == "reduce_metrics"
    assert code_name(_comprehension_code.__code__) == "_comprehension_code"
