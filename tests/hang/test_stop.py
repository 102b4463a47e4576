"""A preemption agreed at one step: the decision, the settings, then real ranks (gloo)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.callbacks.hang.stop import (
    StopAgreement,
    StopRequest,
    check_signals,
    decide,
    own_handlers,
)
from tests.mp import run_ranks

# -- the decision and the settings ----------------------------------------------------------


@pytest.mark.parametrize(
    ("claims", "world_size", "step"),
    [
        ({0: 7, 1: 7}, 2, 7),  # every rank parked at one boundary
        ({0: 7, 1: 8}, 2, 8),  # rank 1 was inside batch 7: every rank runs on to 8
        ({0: 9, 1: 8, 2: 8}, 3, 9),
        ({0: 7}, 2, None),  # rank 1 has not named its boundary yet
        ({}, 2, None),
    ],
)
def test_the_agreed_step_is_the_last_boundary_any_rank_named(claims, world_size, step):
    assert decide(claims, world_size) == step


@pytest.mark.parametrize("bad", [["SIGKILL"], ["SIGTERM", "NOPE"], 15, None, [15]])
def test_stop_signals_are_signal_names_a_scheduler_sends(bad):
    with pytest.raises(ValueError, match="`stop_signals` must be a list of signal names"):
        HangWatchdog(stop_signals=bad)
    assert check_signals("SIGUSR1") == ("SIGUSR1",)
    assert check_signals(["SIGTERM", "SIGUSR1", "SIGTERM"]) == ("SIGTERM", "SIGUSR1")
    assert HangWatchdog(stop_signals=[]).stop_signals == ()


@pytest.mark.parametrize("bad", [0, -1, "20", None])
def test_stop_grace_s_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match="`stop_grace_s`"):
        HangWatchdog(stop_grace_s=bad)
    assert HangWatchdog().stop_grace_s == 20.0
    assert HangWatchdog().stop_signals == ("SIGTERM",)


def test_a_request_reads_back_as_written():
    request = StopRequest(1, "SIGUSR1", 1764367200.25)
    assert StopRequest.decode(request.encode()) == request


def _agreement(signals=("SIGUSR1",)) -> StopAgreement:
    agreement = StopAgreement(signals, 5.0, lambda: None)
    agreement.reset(SideChannel(None))
    return agreement


def test_one_process_stops_at_its_next_boundary_and_restores_the_handler(caplog):
    before = signal.getsignal(signal.SIGUSR1)
    agreement = _agreement()
    with caplog.at_level(logging.INFO):
        agreement.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not agreement.requested  # the handler only notes it
        agreement.poll()  # the watchdog thread's wake
        assert agreement.requested
        assert agreement.at_boundary(5)
        agreement.restore()
    assert agreement.stopped.reason == "preempted by SIGUSR1 on rank 0 at step 5"
    assert signal.getsignal(signal.SIGUSR1) == before
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == [logging.WARNING]
    assert "every rank stops after train step 5" in caplog.text


def test_a_users_handler_is_called_once_at_the_agreed_step_not_in_the_signal(caplog):
    calls = []

    def save_on_preemption(signum, frame):  # the user's own, set before the fit
        calls.append((signum, frame, threading.current_thread().name))
        sys.exit(0)  # as many do after their save: the stop's exit code stands

    previous = signal.signal(signal.SIGUSR1, save_on_preemption)
    try:
        agreement = _agreement()
        with caplog.at_level(logging.INFO):
            agreement.install()
            os.kill(os.getpid(), signal.SIGUSR1)
            agreement.poll()
            assert calls == []  # not in the signal's context
            assert agreement.at_boundary(5) and agreement.at_boundary(6)
            agreement.restore()
        assert calls == [(signal.SIGUSR1, None, threading.current_thread().name)]
        assert signal.getsignal(signal.SIGUSR1) is save_on_preemption
        (said,) = [r for r in caplog.records if "already had a handler" in r.message]
        assert said.levelno == logging.INFO
        assert "calls test_a_users_handler_is_called_once" in said.message
        assert "on every rank at the agreed stop step" in said.message
        (exited,) = [r for r in caplog.records if "asked to exit (SystemExit)" in r.message]
        assert exited.levelno == logging.INFO and "exits with 75 after the save" in exited.message
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_frameworks_own_handler_is_not_called_and_a_users_inside_it_is_found():
    lightning = pytest.importorskip("lightning.pytorch.trainer.connectors.signal_connector")

    def users(signum, frame):
        pass

    connector = lightning._SignalConnector(trainer=None)
    composed = lightning._HandlersCompose([connector._sigterm_notifier_fn, users])
    assert own_handlers(composed) == [users]  # Lightning's own notifier (a collective) left out
    assert own_handlers(connector._sigterm_notifier_fn) == []
    assert own_handlers(signal.default_int_handler) == []
    assert own_handlers(signal.SIG_DFL) == own_handlers(None) == []


# -- real ranks: a HangWatchdog bound to a side channel, a real all_reduce each step ----------

STEP_S = 0.02
MAX_STEPS = 3000  # ~60 s of steps: a stop comes long before


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank, world_size, report_dir, signal_at, ahead, steps=MAX_STEPS):
    """Steps with an all_reduce each; rank 1 is sent SIGTERM mid-step ``signal_at``.

    ``ahead``: rank 0 is sent it instead, after its all_reduce of that step, once rank 1
    started the next batch: rank 1 is a batch ahead, and waits in its all_reduce for rank
    0, which parks. Returns where it stopped (or ``None``), when, the signal's time, the
    reason, and the warnings it logged.
    """
    import torch
    import torch.distributed as dist

    warnings = _Warnings()
    logging.getLogger("rankguard").addHandler(warnings)
    watchdog = HangWatchdog(report_dir=report_dir, timeout_s=60, exchange_period_s=2)
    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    watchdog.on_fit_start(EventFacts())
    agreement, store = watchdog.stop_agreement, watchdog.channel.store
    called: list[int] = []  # the user's own SIGTERM handler: each rank's calls, by step
    signal.signal(signal.SIGTERM, lambda signum, frame: called.append(step))
    agreement.install()  # as the adapter of a loop that stops on it does
    t = torch.ones(1)
    signalled_at = stopped = None
    for step in range(steps):
        if agreement.requested and agreement.at_boundary(step):
            stopped = step
            break
        watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        if rank == 1 and step == signal_at + 1 and ahead:
            store.set("test/rank1_in_next_batch", b"1")
        if (rank == 1 or ahead is None) and step == signal_at and not ahead:
            signalled_at = time.time()
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STEP_S)
        dist.all_reduce(t)
        if rank == 0 and step == signal_at and ahead:
            store.wait(["test/rank1_in_next_batch"])
            signalled_at = time.time()
            os.kill(os.getpid(), signal.SIGTERM)
            while not agreement.requested:  # its watchdog thread publishes it
                time.sleep(0.01)
        watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    stopped_at = time.time()
    watchdog.handle(Event.FIT_END, EventFacts(step=step))
    watchdog.close()
    reason = agreement.stopped.reason if agreement.stopped else None
    return stopped, stopped_at, signalled_at, reason, warnings.lines, called


def _check_stopped_together(outcomes, signal_at, signalled):
    assert [o.exitcode for o in outcomes] == [0] * len(outcomes), outcomes
    steps = {o.value[0] for o in outcomes}
    assert len(steps) == 1, [o.value for o in outcomes]
    (step,) = steps
    assert step is not None and step > signal_at, step
    signalled_at = outcomes[signalled].value[2]
    took = max(o.value[1] for o in outcomes) - signalled_at
    assert took < 20, took  # within the default grace
    for o in outcomes:
        words = f"SIGTERM on rank {signalled}"
        assert o.value[3] == f"preempted by {words} at step {step}", o.value
        (warning,) = o.value[4]  # the one WARNING: "Preempted: ..."
        assert warning.startswith(f"rankguard hang_watchdog: Preempted: {words}"), warning
        assert f"every rank stops after train step {step}" in warning
        assert o.value[5] == [step], o.value  # the user's handler: once, at the agreed step
    print(f"stopped after step {step}, {took:.1f} s after the signal")
    return step, took


@pytest.mark.slow
def test_sigterm_on_one_rank_mid_step_stops_every_rank_after_the_same_step(tmp_path):
    outcomes = run_ranks(_train, 3, str(tmp_path), 20, False, timeout_s=120)
    _check_stopped_together(outcomes, 20, signalled=1)


@pytest.mark.slow
def test_a_rank_stuck_inside_the_next_batch_stops_with_the_others_one_step_later(tmp_path):
    outcomes = run_ranks(_train, 2, str(tmp_path), 20, True, timeout_s=120)
    step, _ = _check_stopped_together(outcomes, 20, signalled=0)
    # rank 0 parked after step 21 while rank 1 waited inside batch 21 for it: its watchdog
    # named step 22, and both stop there
    assert step == 22, step


@pytest.mark.slow
def test_a_signal_every_rank_gets_at_once_stops_them_at_one_step_with_one_warning(tmp_path):
    outcomes = run_ranks(_train, 2, str(tmp_path), 20, None, timeout_s=120)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes
    assert len({o.value[0] for o in outcomes}) == 1 and outcomes[0].value[0] > 20, outcomes
    for o in outcomes:
        (warning,) = o.value[4]
        assert warning.startswith("rankguard hang_watchdog: Preempted: SIGTERM on rank "), warning
        assert o.value[5] == [o.value[0]], o.value  # the user's handler once, not twice


def test_a_run_without_a_signal_is_unaffected(tmp_path):
    outcomes = run_ranks(_train, 2, str(tmp_path), -1, False, 30, timeout_s=120)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes
    for o in outcomes:
        stopped, _, _, reason, warnings, called = o.value
        assert (stopped, reason, warnings, called) == (None, None, [], []), o.value


# -- the hand-written loop: run.train ends on every rank, run.stopped says why ----------------


def _loop(rank, world_size, report_dir):
    import torch
    import torch.distributed as dist

    from rankguard.integrations.torch import HangWatchdog as LoopWatchdog

    guard = LoopWatchdog(report_dir=report_dir, exchange_period_s=2)
    t = torch.ones(1)
    with guard.fit() as run:
        for epoch in range(3):
            for _ in run.train(range(MAX_STEPS // 3)):
                if rank == 1 and run.step == 10 and epoch == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # mid-step 10 (the 10th batch)
                time.sleep(STEP_S)
                dist.all_reduce(t)
            if run.stopped:
                break
        after = sum(1 for _ in run.train(range(5)))  # a later pass yields nothing
        dist.all_reduce(t)  # the user's collective after the loop (a save): every rank is here
    return run.step, run.stopped, run.exit_code, after, epoch


@pytest.mark.slow
def test_the_loops_train_pass_ends_after_one_step_on_every_rank(tmp_path):
    outcomes = run_ranks(_loop, 2, str(tmp_path), timeout_s=120)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes
    (result,) = {o.value for o in outcomes}  # the same on every rank
    step, stopped, code, after, epoch = result
    assert stopped == f"preempted by SIGTERM on rank 1 at step {step}" and step > 10
    assert (code, after, epoch) == (75, 0, 0)


def test_after_a_stop_the_process_exits_75_once_the_code_after_the_fit_ran(tmp_path):
    script = tmp_path / "after.py"
    script.write_text(
        "import sys\n"
        "from rankguard.callbacks.hang.stop import exit_at_interpreter_exit\n"
        "exit_at_interpreter_exit(75)\n"
        "print('saved after the block', flush=True)\n"
        "sys.exit(0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (75, "saved after the block\n"), done.stderr
