"""HangWatchdog: names the stuck rank, its phase and its stack within seconds of a deadline."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from rankguard.callbacks.core.errors import RanksMissingError
from rankguard.callbacks.core.events import Event, EventFacts, LoaderFacts
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.hang.hang_watchdog import HANG_EXIT_CODE, HangWatchdog
from rankguard.callbacks.hang.report import write_heartbeats, write_stacks
from rankguard.callbacks.hang.stacks import blocked_in
from rankguard.callbacks.hang.status import RankStatus
from rankguard.callbacks.hang.verdict import diagnose, gone
from rankguard.callbacks.hang.verdict_text import flight_recorder_note, nccl_timeout_advice
from rankguard.callbacks.hang.watchdog_settings import fit_defaults_under
from rankguard.report import main as report_main
from tests.mp import run_ranks

EVAL = LoaderFacts("eval", None, is_train=False)
FAST = {"exchange_period_s": 0.5, "first_step_timeout_s": 30, "post_eval_timeout_s": 30}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _capture() -> _Records:
    handler = _Records()
    log = logging.getLogger("rankguard")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    return handler


def _bound(**kwargs) -> HangWatchdog:
    from rankguard.callbacks.core.side_channel import SideChannel

    watchdog = HangWatchdog(**kwargs)
    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    return watchdog


def _train(watchdog: HangWatchdog, steps: range, step_s: float = 0.0) -> None:
    for step in steps:
        watchdog.handle(Event.DATA_FETCH_START, EventFacts(step=step))
        watchdog.handle(Event.DATA_FETCH_END, EventFacts(step=step))
        watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        time.sleep(step_s)
        watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))


def _wait_for_incident(watchdog: HangWatchdog, limit_s: float, action: str = "report") -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if watchdog.incidents and action == "report":
            break
        time.sleep(0.05)
    return time.monotonic() - start


def stall_in_eval(watchdog: HangWatchdog, limit_s: float, action: str) -> float:
    return _wait_for_incident(watchdog, limit_s, action)  # sleeps: no progress


def _rank1_stalls_in_eval(rank, world_size, report_dir, action):
    records = _capture()
    watchdog = _bound(eval_timeout_s=2, timeout_s=30, action=action, report_dir=report_dir, **FAST)
    watchdog.on_fit_start(EventFacts())
    _train(watchdog, range(2))
    watchdog.on_eval_start(EventFacts(step=2, loader=EVAL))
    for index in range(3):
        watchdog.on_eval_batch_start(EventFacts(step=2, loader=EVAL, batch_index=index))
        watchdog.on_eval_batch_end(EventFacts(step=2, loader=EVAL, batch_index=index))
    limit_s = 15 if action == "report" else 30  # "abort" ends the process from the watchdog
    if rank == 1:
        watchdog.on_eval_batch_start(EventFacts(step=2, loader=EVAL, batch_index=3))
        waited = stall_in_eval(watchdog, limit_s, action)
    else:
        watchdog.on_eval_end(EventFacts(step=2, loader=EVAL))
        waited = _wait_for_incident(watchdog, limit_s, action)
    watchdog.close()
    watchdog.close()
    return waited, watchdog.incidents, records.lines, watchdog._watch.thread


@pytest.mark.slow
def test_rank_stuck_in_eval_is_named_with_phase_step_and_stack(tmp_path):
    outcomes = run_ranks(_rank1_stalls_in_eval, 2, str(tmp_path), "report", timeout_s=40)
    for o in outcomes:
        assert o.error is None, o.error
        waited, incidents, lines, thread = o.value
        assert incidents == 1 and thread is None
        assert waited < 2 + 3, waited  # within deadline + 3 s
        errors = [msg for level, msg in lines if level == "ERROR"]
        assert len(errors) == 1 and "rank 1 stuck" in errors[0], lines
        assert "eval batch 3 of 'eval'" in errors[0] and "(step 2)" in errors[0]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("rank 1 stuck")
    assert "in eval batch 3 of 'eval' (deadline 2 s)" in summary
    assert "rank 0 waiting" in summary and "in after eval of 'eval'" in summary
    assert "rank 1: host" in summary and "(step 2)" in summary
    assert "Next: read rank1.txt (the rank that stopped first)" in summary
    assert "stall_in_eval" in (tmp_path / "rank1.txt").read_text()
    assert "_wait_for_incident" in (tmp_path / "rank0.txt").read_text()
    assert "eval_batch_start" in (tmp_path / "rank1.jsonl").read_text()


@pytest.mark.slow
def test_abort_exits_every_rank_with_the_hang_exit_code(tmp_path):
    start = time.monotonic()
    outcomes = run_ranks(_rank1_stalls_in_eval, 2, str(tmp_path), "abort", timeout_s=50)
    assert [o.exitcode for o in outcomes] == [HANG_EXIT_CODE, HANG_EXIT_CODE], outcomes
    assert time.monotonic() - start < 40  # not the harness's kill at 50 s
    assert "rank 1 stuck" in (tmp_path / "summary.txt").read_text()
    assert "stall_in_eval" in (tmp_path / "rank1.txt").read_text()


def _one_rank_freezes(rank, world_size, report_dir, frozen, port, ahead):
    from datetime import timedelta

    import torch.distributed as dist

    from rankguard.callbacks.core.side_channel import SideChannel

    records = _capture()
    # A process stopped inside a FileStore operation keeps its file lock; a TCPStore hosted
    # outside the ranks (as torchrun's agent does) keeps answering the others.
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=30))
    # The next periodic exchange is 3 s away when the rank freezes: the exchanges the first
    # step and the calibration trigger are what tell the others it is past its first step.
    settings = {**FAST, "exchange_period_s": 3.0, "floor_s": 1.0, "warmup_steps": 1}
    watchdog = HangWatchdog(timeout_s=2, action="report", report_dir=report_dir, **settings)
    watchdog.bind(SideChannel(store, rank=rank, world_size=world_size, timeout_s=10))
    pids = watchdog.channel.all_gather("pids", os.getpid())
    watchdog.on_fit_start(EventFacts())
    _train(watchdog, range(6), step_s=0.01)
    # The ranks meet before batch 6 (a collective would): a loaded machine's lag between
    # them is waited out at a rendezvous, not in the other rank's own code.
    watchdog.channel.all_gather("batch 6", rank)
    watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=6))
    if rank == frozen:
        time.sleep(0.2)  # the exchange the calibration triggered
        if ahead:
            # Its thread exchanges once more than the other's (as one does whose wake
            # points were read apart): its status waits in the store for the other's.
            # Not waited for: a loaded machine that delays the thread past the rank's
            # deadline would show this rank stuck in its own code, which it then is; a
            # status not sent by the freeze leaves the rank silent, named the same.
            watchdog._watch.exchange_soon()
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops, watchdog thread too
    # The other rank makes no progress in its own code from here, as a rank on NCCL
    # blocked at its next host sync behind the frozen rank's collective does.
    waited = _wait_for_incident(watchdog, 25)
    os.kill(pids[frozen], signal.SIGKILL)
    # No close(): it could wait out an exchange in flight; the worker exits hard.
    return waited, records.lines, (Path(report_dir) / "summary.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [False, True], ids=["in_step", "its_status_sent_ahead"])
def test_frozen_rank_is_named_frozen_or_dead(tmp_path, ahead):
    # A frozen rank 0 is found the same way, 5 s later (the side channel's grace for the
    # deciding rank); test_side_channel covers that path, test_frozen_ranks_* the decision.
    # ``ahead``: the frozen rank's last status went to an exchange the other rank joined
    # only at its next period, past its own deadline: that status cannot clear it.
    frozen = 1
    from datetime import timedelta

    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    args = (str(tmp_path), frozen, host.port, ahead)
    outcomes = run_ranks(_one_rank_freezes, 2, *args, timeout_s=40)
    assert outcomes[frozen].exitcode == -signal.SIGKILL
    waiting = outcomes[1 - frozen]
    assert waiting.error is None, waiting.error
    waited, lines, summary = waiting.value
    # The next exchange (3 s) and its timeout (3 s) pass the slack of the calibrated
    # deadlines (1 s); judged by the first-step deadline (30 s) it would still be silent.
    assert waited < 3 + 3 + 4, waited
    expected = f"rank {frozen} frozen or dead (no answer on the side channel"
    assert summary.startswith(expected)
    assert "last seen: " in summary and "train batch" in summary
    assert any(level == "ERROR" and expected in msg for level, msg in lines)


def _healthy_run(rank, world_size, report_dir):
    from rankguard.callbacks.hang.hang_watchdog import process_group_timeout

    records = _capture()
    watchdog = _bound(
        timeout_s=1,
        eval_timeout_s=1,
        post_eval_timeout_s=1,
        first_step_timeout_s=5,
        exchange_period_s=0.3,
        auto_calibrate=True,
        warmup_steps=2,
        floor_s=0.8,
        report_dir=report_dir,
    )
    watchdog.on_fit_start(EventFacts())
    _train(watchdog, range(1), step_s=1.2)  # compile / warm-up: longer than `timeout_s`
    for epoch in range(2):
        _train(watchdog, range(1 + 6 * epoch, 7 + 6 * epoch), step_s=0.03)
        watchdog.on_eval_start(EventFacts(step=7, loader=EVAL))
        for index in range(4):  # 5x slower than a train step
            watchdog.on_eval_batch_start(EventFacts(step=7, loader=EVAL, batch_index=index))
            time.sleep(0.15)
            watchdog.on_eval_batch_end(EventFacts(step=7, loader=EVAL, batch_index=index))
        watchdog.on_eval_end(EventFacts(step=7, loader=EVAL))
    watchdog.on_fit_end(EventFacts(step=13))
    time.sleep(0.5 if rank else 0.0)  # ranks close at their own pace
    watchdog.close()
    watchdog.close()
    return watchdog.incidents, records.lines, dict(watchdog.history.peaks), process_group_timeout()


@pytest.mark.slow
def test_healthy_run_with_slow_eval_and_long_first_step_reports_nothing(tmp_path):
    outcomes = run_ranks(_healthy_run, 2, str(tmp_path / "reports"), timeout_s=40)
    for o in outcomes:
        assert o.error is None, o.error
        incidents, lines, slowest, pg = o.value
        assert incidents == 0
        assert [m for level, m in lines if level in ("WARNING", "ERROR")] == []
        assert slowest["eval"] >= 0.15 and "startup" not in slowest
        # The one private torch.distributed attribute the watchdog reads still exists.
        assert pg == ("gloo", 1800.0)
    assert not (tmp_path / "reports").exists()


def stall_in_train(watchdog: HangWatchdog) -> float:
    return _wait_for_incident(watchdog, 5)


def test_single_process_stall_is_reported_without_a_process_group(tmp_path, caplog):
    watchdog = HangWatchdog(
        timeout_s=0.3, exchange_period_s=0.1, action="report", report_dir=str(tmp_path)
    )
    watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=0))  # fit start missed: starts lazily
    watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=1))
    with caplog.at_level(logging.ERROR, logger="rankguard"):
        waited = stall_in_train(watchdog)
    thread = watchdog._watch.thread
    watchdog.close()
    assert waited < 1.5 and not thread.is_alive()
    assert "rank 0 stuck" in caplog.text and "in train batch 1 (deadline 0.3 s)" in caplog.text
    assert "stall_in_train" in (tmp_path / "rank0.txt").read_text()
    assert watchdog.last_incident is not None


def test_post_eval_deadline_runs_from_eval_end_until_the_next_data_fetch(tmp_path):
    watchdog = HangWatchdog(
        timeout_s=100,
        eval_timeout_s=200,
        post_eval_timeout_s=300,
        checkpoint_timeout_s=400,
        first_step_timeout_s=500,
        report_dir=str(tmp_path),
    )
    seen, threads = [], set()

    def beat(handler: str, **facts) -> None:
        watchdog.handle(Event(handler), EventFacts(**facts))
        status = watchdog._watch.status()
        seen.append((status.phase, status.deadline_s))
        threads.add(status.loop_thread)  # the name the record gives its collectives

    beat("fit_start")
    beat("train_batch_start", step=0)
    beat("train_batch_end", step=0)
    beat("eval_batch_start", step=1, loader=EVAL, batch_index=0)
    beat("eval_end", step=1, loader=EVAL)
    beat("data_fetch_start", step=1)
    beat("train_batch_start", step=1)
    beat("checkpoint_save_start", step=1)
    beat("checkpoint_save_end", step=1)
    beat("fit_end", step=2)
    thread, start = watchdog._watch.thread, time.monotonic()
    watchdog.close()  # fit end woke the thread: no wait for the 10 s exchange period
    assert time.monotonic() - start < 2 and not thread.is_alive()
    assert threads == {threading.current_thread().name}
    assert seen == [
        ("fit start", 500),
        ("train batch 0", 500),
        ("after train batch 0", 100),
        ("eval batch 0 of 'eval'", 200),
        ("after eval of 'eval'", 300),
        ("data fetch for train batch 1", 100),  # back in the train loop
        ("train batch 1", 100),
        ("checkpoint save at step 1", 400),
        ("after checkpoint save at step 1", 100),
        ("left the training loop at step 2", None),  # what the others read while they go on
    ]
    assert watchdog.incidents == 0 and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"eval_timeout_s": -1}, "eval_timeout_s"),
        ({"post_eval_timeout_s": "10"}, "post_eval_timeout_s"),
        ({"checkpoint_timeout_s": True}, "checkpoint_timeout_s"),
        ({"first_step_timeout_s": None}, "first_step_timeout_s"),
        ({"action": "raise"}, "action"),
        ({"abort_at": "deadline"}, "abort_at"),
        ({"exchange_period_s": 0}, "exchange_period_s"),
        ({"auto_calibrate": "yes"}, "auto_calibrate"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"calibration_factor": 1}, "calibration_factor"),
        ({"floor_s": 0}, "floor_s"),
        ({"report_dir": ""}, "report_dir"),
        ({"report_dir": __file__ + "/reports"}, "report_dir"),  # under a file
    ],
)
def test_invalid_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        HangWatchdog(**kwargs)


def test_a_report_dir_another_rank_makes_and_removes_meanwhile_is_writable(tmp_path):
    # Every rank on a node checks ``./rankguard_reports`` as it is built, while another
    # rank's fit that just ended removes the empty folder it made (and a next fit makes
    # it again). A stage as fast as it goes: the folder comes and goes for 1 s.
    folder = tmp_path / "rankguard_reports"
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            folder.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    refused, until = [], time.monotonic() + 1.0
    try:
        while time.monotonic() < until:
            try:
                HangWatchdog(report_dir=str(folder))
            except ValueError as exc:
                refused.append(str(exc))
    finally:
        stop.set()
        thread.join(5)
    assert not refused, refused[:3]


def test_close_is_safe_before_start_and_twice():
    watchdog = HangWatchdog()
    watchdog.close()
    watchdog.close()


def _status(phase, idle, deadline=60.0, step=2001):
    return RankStatus(phase, step, idle, deadline, "node", 1)


def test_verdict_names_the_stuck_rank_first_and_stays_short_at_1000_ranks():
    statuses = {r: _status("train batch 2001", 58.0) for r in range(1000)}
    statuses[1] = _status("eval batch 3 of 'eval'", 61.0)
    verdict = diagnose(statuses)
    assert verdict.summary == (
        "rank 1 stuck 61 s in eval batch 3 of 'eval' (deadline 60 s); "
        "ranks 0,2-999 waiting 58 s in train batch 2001"
    )
    assert verdict.stuck == ((1, 1),) and verdict.first == 1 and verdict.kind == "stall"
    assert len(verdict.details) == 2 and verdict.details[1].startswith("Next: read rank1.txt")
    assert diagnose({0: _status("fit end", 99.0, None)}).summary == ""


def test_frozen_ranks_wait_for_the_slack_and_skip_finished_ranks():
    verdict = diagnose({0: _status("train batch 5", 1.0, 10.0), 1: _status("fit end", 0, None)})
    assert verdict.slack_s == 9.0

    def frozen(missing, rank=0, waited_s=12, **kw):
        found = gone(missing, rank=rank, waited_s=waited_s, last=verdict, default_s=99, **kw)
        return None if found is None else (found.stuck, found.kind, found.end)

    assert frozen([2], waited_s=5) is None
    assert frozen([0, 2]) == (((2, 2),), "gone", True)  # past every ceiling (none given)
    assert frozen([1]) is None  # its fit ended
    assert frozen([3], rank=1) is None  # this rank's fit ended: it closes at its own pace
    assert frozen([2], waited_s=5, given_up=[2]) == (((2, 2),), "gone", True)  # a check gave up


def test_nccl_timeout_shorter_than_detection_is_a_warning_with_the_fix():
    advice = nccl_timeout_advice(300.0, {"timeout_s": 600.0, "eval_timeout_s": 120.0}, 20.0)
    assert "NCCL process-group timeout (300 s)" in advice
    assert "`timeout_s`=600 s" in advice and "above 620 s" in advice
    assert nccl_timeout_advice(1800.0, {"timeout_s": 600.0}, 20.0) is None
    assert nccl_timeout_advice(None, {"timeout_s": 600.0}, 20.0) is None


def test_flight_recorder_is_named_when_set_and_recommended_when_not():
    on = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert "/tmp/nccl_trace_rank_3 on NCCL timeout" in flight_recorder_note(on, 3)
    assert "set TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in flight_recorder_note({}, 3)


def test_report_cli_groups_identical_stacks_and_draws_a_timeline(tmp_path, capsys):
    loop = threading.get_ident()
    for rank in range(3):
        write_stacks(tmp_path, rank, f"rank {rank}, host h, pid {rank}: train batch 5", loop)
        beats = [{"t": 100.0, "event": "train_batch_start", "phase": "train batch 5", "step": 5}]
        write_heartbeats(tmp_path, rank, beats)
    assert f"thread 0x{loop:016x} [training loop]" in (tmp_path / "rank2.txt").read_text()
    assert report_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(
        "Training loop stacks, ranks grouped where identical:\n== ranks 0-2 =="
    )
    assert "in test_report_cli_groups_identical_stacks_and_draws_a_timeline" in printed
    merged = (tmp_path / "merged.txt").read_text()
    assert merged.startswith("== ranks 0-2 (3 ranks) ==")
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert report_main([str(tmp_path / "missing")]) == 2


def test_default_deadlines_fit_under_the_nccl_timeout_and_set_ones_are_kept(tmp_path):

    watchdog = HangWatchdog(eval_timeout_s=900, report_dir=str(tmp_path))
    # 300 s: Composer's default dist_timeout
    watchdog._adopt(fit_defaults_under(watchdog.current_settings(), 300.0, watchdog.name))
    detect = watchdog.exchange_period_s + watchdog.exchange_timeout_s
    assert watchdog.timeout_s == watchdog.post_eval_timeout_s == 0.8 * 300 - detect
    assert watchdog.checkpoint_timeout_s == 0.8 * 300 - detect
    assert watchdog.eval_timeout_s == 900  # the user's own setting stays
    ceilings = {k: v for k, v in watchdog.ceilings.items() if k not in ("startup", "data")}
    advice = nccl_timeout_advice(300.0, {f"{k}_timeout_s": v for k, v in ceilings.items()}, detect)
    assert advice is not None and "`eval_timeout_s`=900" in advice


def test_rank_past_its_deadline_but_blocked_in_a_collective_is_waiting_not_stuck():
    collective = "broadcast, called from training_epoch_loop.py:265 (_broadcast_sigterm_tensor)"
    after_eval = "after eval of 'val'"
    blocked = RankStatus(after_eval, 2, 4.5, 4.0, "node", 1, blocked_in=collective)
    verdict = diagnose({0: blocked, 1: _status(after_eval, 4.5, 4.0)})
    assert verdict.summary == (
        "rank 1 stuck 4 s in after eval of 'val' (deadline 4 s); "
        f"rank 0 waiting 4 s in after eval of 'val' (blocked in {collective})"
    )
    assert verdict.stuck == ((1, 1),) and verdict.first == 1
    # Every rank past its deadline is blocked in a collective: none can be told apart.
    verdict = diagnose({0: blocked, 1: blocked})
    assert verdict.stuck == ((0, 1),)
    assert verdict.summary.startswith(
        f"ranks 0,1 stuck 4 s in after eval of 'val' (deadline 4 s; blocked in {collective})"
    )


def test_blocked_in_names_the_collective_and_its_caller_past_same_name_wrappers():
    c10d = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    stack = [
        (c10d, 2815, "all_reduce"),
        ("/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81, "wrapper"),
        ("/venv/lib/python3.11/site-packages/composer/utils/dist.py", 338, "all_reduce"),
        (
            "/venv/lib/python3.11/site-packages/composer/trainer/trainer.py",
            3634,
            "_iter_dataloader",
        ),
    ]
    assert blocked_in(stack) == "all_reduce, called from trainer.py:3634 (_iter_dataloader)"
    # DDP reduces gradients from C++ hooks inside backward: the loop shows autograd's engine.
    autograd = "/venv/lib/python3.11/site-packages/torch/autograd/"
    backward = [
        (autograd + "graph.py", 824, "_engine_run_backward"),
        (autograd + "__init__.py", 353, "backward"),
        ("/venv/lib/python3.11/site-packages/torch/_tensor.py", 648, "backward"),
        ("/job/train.py", 52, "train_step"),
    ]
    assert blocked_in(backward) == "backward, called from train.py:52 (train_step)"
    assert blocked_in(stack[:2]) == "all_reduce"
    assert blocked_in(stack[2:]) is None  # not inside torch.distributed
    assert blocked_in([]) is None


def sleep_after_eval(watchdog: HangWatchdog) -> float:
    return _wait_for_incident(watchdog, 15)


def _rank0_waits_in_a_collective_for_rank1(rank, world_size, report_dir):
    import torch
    import torch.distributed as dist

    watchdog = _bound(
        timeout_s=30,
        post_eval_timeout_s=2,
        report_dir=report_dir,
        action="report",
        exchange_period_s=0.5,
    )
    watchdog.on_fit_start(EventFacts())
    _train(watchdog, range(2))
    watchdog.on_eval_end(EventFacts(step=2, loader=EVAL))
    if rank == 1:
        sleep_after_eval(watchdog)  # stuck in a hook; then it joins the collective
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, in the same phase
    waited = _wait_for_incident(watchdog, 15)
    watchdog.close()
    return waited, watchdog.incidents


@pytest.mark.slow
def test_rank_waiting_in_a_collective_is_told_apart_from_the_stuck_rank_in_the_same_phase(
    tmp_path,
):
    outcomes = run_ranks(_rank0_waits_in_a_collective_for_rank1, 2, str(tmp_path), timeout_s=40)
    for o in outcomes:
        assert o.error is None, o.error
        assert o.value[1] == 1
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith(
        "rank 1 stuck 2 s in after eval of 'eval' (deadline 2 s); rank 0 waiting 2 s in after "
        "eval of 'eval' (blocked in all_reduce, called from test_hang_watchdog.py:"
    ), summary
    assert "in sleep_after_eval" in (tmp_path / "rank1.txt").read_text()


def check_that_waits_for_rank_1(channel: SideChannel) -> None:
    try:
        channel.barrier("rank 1 never comes")
    except RanksMissingError:
        pass


@pytest.mark.slow
def test_a_rank_waiting_in_a_rankguard_check_is_blocked_on_its_peers():
    # Rank 0 waits in another guard's exchange (e.g. the epoch-start batch check)
    # for a rank that hangs: it is waiting, not stuck, and the caller is named.
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    channel = SideChannel(server, rank=0, world_size=2, timeout_s=3)
    thread = threading.Thread(target=check_that_waits_for_rank_1, args=(channel,))
    thread.start()
    time.sleep(1.0)
    frame = sys._current_frames()[thread.ident]
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    where = blocked_in(stack)
    thread.join()
    assert where is not None
    assert where.startswith("rankguard exchange, called from test_hang_watchdog.py:")
    assert where.endswith("(check_that_waits_for_rank_1)")


class _Timed(logging.Handler):
    """Records (Unix time, level, message) of rankguard's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.created, record.levelname, record.getMessage()))


def slow_eval_batch(watchdog: HangWatchdog) -> None:
    """Rank 1's eval batch outlasts the ceiling, then ends (the next collective goes on)."""
    start = time.monotonic()
    while not watchdog.ceilings_reached and time.monotonic() - start < 20:
        time.sleep(0.05)


def _one_incident_two_stages(rank, world_size, report_dir):
    import torch
    import torch.distributed as dist

    timed = _Timed()
    log = logging.getLogger("rankguard")
    log.addHandler(timed)
    log.setLevel(logging.INFO)
    watchdog = _bound(
        timeout_s=30,
        eval_timeout_s=5,
        post_eval_timeout_s=30,
        floor_s=1,
        warmup_steps=1,
        action="report",
        report_dir=report_dir,
        exchange_period_s=0.3,
    )
    watchdog.on_fit_start(EventFacts())
    # Train in 10 ms steps until an exchange calibrates: train 1 s (floor), eval 1 s (derived
    # from train). A pause here would be a train interval, and raise both.
    step, start = 0, time.monotonic()
    while step < 12 or (watchdog.deadlines["eval"] == 5 and time.monotonic() - start < 20):
        _train(watchdog, range(step, step + 1), step_s=0.01)
        step += 1
    watchdog.on_eval_start(EventFacts(step=12, loader=EVAL))
    # Read before the beat the watchdog's clock starts from: rank 1's is the stall's start.
    stalled = time.time()
    watchdog.on_eval_batch_start(EventFacts(step=12, loader=EVAL, batch_index=0))
    if rank == 1:
        slow_eval_batch(watchdog)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1 (the eval's metric sync)
    watchdog.on_eval_batch_end(EventFacts(step=12, loader=EVAL, batch_index=0))
    watchdog.on_eval_end(EventFacts(step=12, loader=EVAL))
    _train(watchdog, range(12, 14), step_s=0.01)
    time.sleep(1.0)  # exchanges see every rank moving again
    watchdog.close()
    deadlines = watchdog.deadlines
    return stalled, timed.lines, watchdog.incidents, watchdog.ceilings_reached, deadlines


@pytest.mark.slow
def test_one_incident_reports_at_the_calibrated_deadline_then_once_at_the_ceiling(tmp_path):
    outcomes = run_ranks(_one_incident_two_stages, 2, str(tmp_path), timeout_s=60)
    assert [o.error for o in outcomes] == [None, None], outcomes
    stalled = outcomes[1].value[0]  # rank 1's eval batch start: the stuck rank's idle starts there
    for o in outcomes:
        _, lines, incidents, ceilings_reached, deadlines = o.value
        assert (incidents, ceilings_reached) == (1, 1)
        stage1 = [(t, m) for t, level, m in lines if level == "WARNING"]
        stage2 = [(t, m) for t, level, m in lines if level == "ERROR"]
        assert len(stage1) == 1 and len(stage2) == 1, lines  # one report per stage
        (t1, first), (t2, final) = stage1[0], stage2[0]
        assert first.startswith(
            "rankguard hang_watchdog: Hang suspected: rank 1 stuck 1 s in eval batch 0 of "
            "'eval' (deadline 1 s, calibrated; ceiling 5 s); rank 0 waiting 1 s in eval batch 0 "
            "of 'eval' (blocked in all_reduce"
        ), first
        assert "Training goes on; it reports again if there is still no progress" in first
        assert 1.0 <= t1 - stalled < 4.0  # the calibrated deadline, well before the ceiling
        assert final.startswith("rankguard hang_watchdog: Hang: rank 1 stuck 5 s in eval batch 0")
        assert final.endswith("Now waiting.")
        assert 5.0 <= t2 - stalled < 8.0  # the ceiling
        assert any("every rank is making progress again" in m for _, _, m in lines)
        assert deadlines["eval"] == 5.0  # the 5 s batch seen: 2 x it, capped at the ceiling
    summary = (tmp_path / "summary.txt").read_text()
    assert (
        "Stage 2: the incident ends" in summary
        and "in slow_eval_batch" in (tmp_path / "rank1.txt").read_text()
    )


def stall_after_eval(watchdog: HangWatchdog) -> None:
    """Rank 1 never comes back from eval (until the watchdog has ended the incident)."""
    start = time.monotonic()
    while not watchdog.ceilings_reached and time.monotonic() - start < 20:
        time.sleep(0.05)


def _rank0_waits_in_a_check_for_stuck_rank1(rank, world_size, report_dir, action):
    from rankguard.callbacks.batches.batch_parity_guard import BatchParityGuard
    from rankguard.callbacks.core.events import Event
    from rankguard.callbacks.core.guard import GuardRunner

    watchdog = HangWatchdog(
        timeout_s=60,
        eval_timeout_s=60,
        post_eval_timeout_s=60,
        action=action,
        report_dir=report_dir,
        exchange_period_s=0.5,
    )
    # The check's exchange gives up after 2 s, long before any watchdog deadline.
    runner = GuardRunner([watchdog, BatchParityGuard()], exchange_timeout_s=2)
    train = LoaderFacts("train", list(range(4)), is_train=True)
    eval_loader = LoaderFacts("eval", list(range(2)), is_train=False)
    runner.fire(Event.FIT_START, EventFacts(loaders=[train, eval_loader]))
    for step in range(4):
        for event in (Event.DATA_FETCH_START, Event.TRAIN_BATCH_START, Event.TRAIN_BATCH_END):
            runner.fire(event, EventFacts(step=step))
    runner.fire(Event.EVAL_START, EventFacts(step=4, loader=eval_loader))
    for index in range(2):
        runner.fire(Event.EVAL_BATCH_END, EventFacts(step=4, loader=eval_loader, batch_index=index))
    runner.fire(Event.EVAL_END, EventFacts(step=4, loader=eval_loader))
    stalled = time.monotonic()
    try:
        if rank == 1:
            stall_after_eval(watchdog)
        else:  # the next epoch's batch-count check waits for rank 1
            runner.fire(Event.EPOCH_START, EventFacts(step=4, epoch=1, loader=train))
    finally:
        runner.close()
    return time.monotonic() - stalled, str(watchdog.last_incident)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["abort", "report"])
def test_a_rank_missing_from_another_checks_exchange_gets_the_watchdogs_diagnosis(tmp_path, action):
    outcomes = run_ranks(
        _rank0_waits_in_a_check_for_stuck_rank1, 2, str(tmp_path), action, timeout_s=60
    )
    if action == "abort":  # the watchdog's exit behaviour on every rank, not the check's error
        assert [o.exitcode for o in outcomes] == [HANG_EXIT_CODE, HANG_EXIT_CODE], outcomes
    else:  # rank 0 raises the hang error, not BatchCountMismatchError; rank 1 logged the same
        rank0, rank1 = outcomes
        assert rank0.error_type == "HangDetectedError", rank0.error
        assert rank1.error is None, rank1.error
        waited, incident = rank1.value
        verdict = incident.split("\nThis is rank 1")[0]  # the rest names the rank's own files
        assert rank0.error.startswith(verdict + "\nThis is rank 0")  # the same diagnosis
        assert waited < 2 + 5  # the check's 2 s timeout, then the next status exchanges
    summary = (tmp_path / "summary.txt").read_text()
    assert re.match(
        r"rank 1 stuck \d s in after eval of 'eval' \(deadline 60 s\); rank 0 waiting \d s in "
        r"epoch start at step 4 \(blocked in rankguard exchange, "
        r"called from batch_parity_guard\.py:",
        summary,
    ), summary
    assert (
        "rank 1 did not reach rankguard exchange 'batch_parity_guard/epoch_start' within 2 s"
        in summary
    )
    assert "in stall_after_eval" in (tmp_path / "rank1.txt").read_text()
    assert "BatchCountMismatchError" not in summary


def test_the_phase_a_collective_is_issued_in_is_the_training_threads_newest_event():
    from rankguard.callbacks.core.events import EventFacts

    watchdog = HangWatchdog()
    heartbeats = watchdog.heartbeats
    assert heartbeats.issuing_phase() is None  # nothing heard yet
    watchdog.steps.append("train_batch_start", EventFacts(step=5))
    assert heartbeats.issuing_phase() == ("train_batch_start", 5, None)
    watchdog.steps.append("eval_batch_start", EventFacts(step=5, batch_index=2))
    assert heartbeats.issuing_phase() == ("eval_batch_start", 5, 2)
    heartbeats.read_step_log()  # read by the watchdog's thread: its last beat is the newest
    assert watchdog.steps.entries == []
    assert heartbeats.issuing_phase() == ("eval_batch_start", 5, 2)
    watchdog.close()
