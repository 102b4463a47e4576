"""A rank that raises or dies: the exit-code table, the words, then 2 real ranks (gloo)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.hang.faults import (
    FAMILIES,
    Fault,
    family_of,
    from_exception,
    is_alive,
    message,
    root,
)
from rankguard.callbacks.hang.stacks import library_paths
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, EXIT_CODES, HANG_EXIT_CODE
from tests.e2e.common import destroy_process_group_waits, wait_at_host_sync
from tests.mp import run_ranks

# -- the exit-code table (README and docs/hang.md: each row) -------------------------------


@pytest.mark.parametrize(
    ("exc", "family", "code"),
    [
        (ValueError("sample 4711 has no tokens"), "code", DEADLOCK_EXIT_CODE),
        (AssertionError("loss is NaN"), "code", DEADLOCK_EXIT_CODE),
        (KeyError("input_ids"), "code", DEADLOCK_EXIT_CODE),
        (RuntimeError("shape mismatch"), "code", DEADLOCK_EXIT_CODE),
        (torch.OutOfMemoryError("CUDA out of memory"), "transient", HANG_EXIT_CODE),
        (RuntimeError("CUDA error: an illegal memory access"), "transient", HANG_EXIT_CODE),
        (OSError(122, "Disk quota exceeded"), "transient", HANG_EXIT_CODE),
        (FileExistsError("checkpoint-8"), "code", DEADLOCK_EXIT_CODE),
        (RuntimeError("DataLoader worker (pid 42) is killed by signal: Killed."), "transient", 75),
        (RuntimeError("[gloo/pair.cc:534] Connection closed by peer"), "communication", 75),
        (ConnectionResetError("store"), "communication", HANG_EXIT_CODE),
        (KeyboardInterrupt(), "interrupted", HANG_EXIT_CODE),
        (SystemExit(143), "interrupted", HANG_EXIT_CODE),
    ],
)
def test_each_fault_family_has_its_exit_code(exc, family, code):
    assert family_of(exc) == family
    assert EXIT_CODES[family] == code and family in FAMILIES


def check_batch(batch: dict) -> None:
    if not batch["tokens"]:
        raise ValueError("sample 4711 has no tokens after filtering\n(the second line is dropped)")


def _raised() -> BaseException:
    try:
        check_batch({"tokens": []})
    except ValueError as exc:
        return exc
    raise AssertionError("check_batch did not raise")


def test_a_fault_names_the_rank_its_error_and_the_users_line():
    fault = from_exception(
        _raised(), rank=1, step=6, phase="train batch 7", host="h", pid=9, libraries=library_paths()
    )
    sentence = "Rank 1 raised ValueError: sample 4711 has no tokens after filtering."
    assert fault.sentence() == sentence
    detail = fault.detail()
    assert detail.startswith("At test_faults.py:") and "(check_batch): raise ValueError(" in detail
    assert detail.endswith("; train batch 7, host h, pid 9.")
    assert fault.code == DEADLOCK_EXIT_CODE


def _fault(rank: int, family: str, error: str = "ValueError: x") -> Fault:
    return Fault(rank, family, error, None, 6, "train batch 7", "h", 100 + rank)


def test_the_root_is_the_first_fault_not_a_peers_consequence():
    consequence = _fault(0, "communication", "RuntimeError: Connection closed by peer")
    gone = _fault(1, "gone", "its process ended")
    assert root([consequence, gone]) is gone
    assert root([consequence]) is consequence
    text = message([consequence, gone], waited="rank 2 was in its own code", where="W.")
    assert text.startswith("Rank 1 is gone: its process ended. Last seen: train batch 7")
    assert "Rank 2 was in its own code; it ends with exit code 75" in text
    assert "Then: Rank 0 raised RuntimeError: Connection closed by peer." in text


@pytest.mark.parametrize("look", ["pidfd", "proc"])
def test_a_zombie_or_missing_pid_is_not_alive(look, monkeypatch):
    if look == "proc":  # a kernel or sandbox without pidfd_open

        def no_pidfd(pid: int) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    assert is_alive(os.getpid())
    assert not is_alive(2**22 + 12345)  # above the kernel's pid_max default
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert is_alive(child.pid)
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
        assert not is_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not is_alive(child.pid)


# -- two real ranks --------------------------------------------------------------------------


def _watchdog(report_dir: str, teardown_s: float = 3.0, period_s: float = 2.0):
    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    watchdog = HangWatchdog(
        report_dir=report_dir,
        timeout_s=60,
        exchange_period_s=period_s,
        teardown_timeout_s=teardown_s,
    )
    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    watchdog.on_fit_start(EventFacts())
    for step in range(3):
        watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step + 1))
    deadline = time.monotonic() + 30  # a first exchange: the ranks know each other's process
    while not watchdog._watch.faults.local and time.monotonic() < deadline:
        time.sleep(0.05)
    return watchdog


def _rank1_raises(rank, world_size, report_dir):
    import torch.distributed as dist

    watchdog = _watchdog(report_dir)
    if rank == 1:
        try:
            check_batch({"tokens": []})
        except ValueError as exc:  # what every adapter does where the fit's error escapes
            watchdog.on_error(exc, EventFacts(step=3))
            watchdog.close()
        destroy_process_group_waits()
    dist.barrier()  # rank 0's next collective: rank 1 never comes


@pytest.mark.slow
def test_a_rank_that_raised_ends_every_rank_in_seconds_naming_it(tmp_path):
    started = time.monotonic()
    outcomes = run_ranks(_rank1_raises, 2, str(tmp_path), timeout_s=90)
    took = time.monotonic() - started
    # rank 0 ends on the fault; rank 1's teardown is ended at teardown_timeout_s (3 s)
    assert [o.exitcode for o in outcomes] == [DEADLOCK_EXIT_CODE] * 2, outcomes
    assert took < 40, took  # not the harness's 90 s, nor gloo's 30 min
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("Rank 1 raised ValueError: sample 4711 has no tokens after filt")
    assert "(check_batch): raise ValueError(" in summary and "after train batch 3" in summary
    assert "Rank 0 waited in barrier at test_faults.py:" in summary
    assert "it ends with exit code 70" in summary and "Next: fix the error on rank 1" in summary
    assert "destroy_process_group_waits" in (tmp_path / "rank1.txt").read_text()
    assert "check_batch" not in (tmp_path / "rank0.txt").read_text().split("\n")[0]


#: How late rank 1's watchdog thread comes to its second exchange (seconds).
THREAD_LATE_S = 6.0


def _late_once(sleep):
    """A watchdog thread's wait for its next exchange that, once, ends ``THREAD_LATE_S`` late."""
    calls = []

    def late(thread):
        sleep(thread)
        calls.append(1)
        if len(calls) == 1:
            time.sleep(THREAD_LATE_S)  # a loaded machine did not schedule it

    return late


def _rank1_raises_while_rank0_waits_in_an_exchange(rank, world_size, report_dir):
    """Rank 0 waits in its next collective; the default period and timeout (10 s).

    Rank 0's second exchange waits for rank 1's status; rank 1's thread is late for it,
    and rank 1 raises and closes meanwhile, as every adapter does: the status never
    comes. Rank 1's process stays, as under NCCL (no closed socket tells rank 0).
    """
    import torch.distributed as dist

    from rankguard.callbacks.hang.watchdog_thread import WatchdogThread

    if rank == 1:
        WatchdogThread._sleep = _late_once(WatchdogThread._sleep)
    watchdog = _watchdog(report_dir, teardown_s=15.0, period_s=10.0)
    if rank == 1:
        time.sleep(THREAD_LATE_S / 3)  # its own code: rank 0's second exchange waits
        try:
            check_batch({"tokens": []})
        except ValueError as exc:
            Path(report_dir, "raised_at").write_text(repr(time.time()))
            watchdog.on_error(exc, EventFacts(step=3))
            watchdog.close()
        destroy_process_group_waits()
    dist.barrier()


@pytest.mark.slow
def test_a_rank_that_raises_while_a_peer_waits_in_a_status_exchange_ends_it_in_seconds(
    tmp_path,
):
    outcomes = run_ranks(
        _rank1_raises_while_rank0_waits_in_an_exchange, 2, str(tmp_path), timeout_s=90, until=[0]
    )
    assert outcomes[0].exitcode == DEADLOCK_EXIT_CODE, outcomes
    summary = tmp_path / "summary.txt"
    assert summary.read_text().startswith("Rank 1 raised ValueError: sample 4711 has no tok")
    # Rank 0's exchange would wait out its 10 s timeout for a status that never comes: it
    # reads the board meanwhile, as at its wakes (every 0.5 s while its loop waits).
    after_s = summary.stat().st_mtime - float((tmp_path / "raised_at").read_text())
    assert after_s < 4.0, after_s


def _worker_died(signum, frame):
    """What torch's DataLoader SIGCHLD handler raises in the main thread when a worker died."""
    raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")


def _publish_interrupted_between_number_and_fault(publish):
    """The board's publication, with that signal arriving after its number is taken."""

    def interrupted(board, fault):
        board.channel.store.add(board._count, 0)  # the store answers: the number is next
        os.kill(os.getpid(), signal.SIGUSR1)  # handled in the main thread, wherever it is
        time.sleep(0.5)
        publish(board, fault)

    return interrupted


def _rank1_raises_then_its_worker_dies(rank, world_size, report_dir):
    import torch.distributed as dist

    from rankguard.callbacks.hang.faults import FaultBoard

    watchdog = _watchdog(report_dir)
    if rank == 1:
        signal.signal(signal.SIGUSR1, _worker_died)
        FaultBoard.publish = _publish_interrupted_between_number_and_fault(FaultBoard.publish)
        try:
            check_batch({"tokens": []})
        except ValueError as exc:
            watchdog.on_error(exc, EventFacts(step=3))
            watchdog.close()
        destroy_process_group_waits()
    dist.barrier()


@pytest.mark.slow
def test_a_signal_handlers_error_during_the_publication_still_tells_every_rank(tmp_path):
    started = time.monotonic()
    outcomes = run_ranks(_rank1_raises_then_its_worker_dies, 2, str(tmp_path), timeout_s=90)
    took = time.monotonic() - started
    assert [o.exitcode for o in outcomes] == [DEADLOCK_EXIT_CODE] * 2, outcomes
    assert took < 40, took
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("Rank 1 raised ValueError: sample 4711 has no tokens after filt")


def _launcher_stops(signum, frame):
    """Composer's SIGTERM handler (``composer/core/engine.py``): ``sys.exit(128 + SIGTERM)``.

    Its launcher sends SIGTERM to every other rank once one crashed, and kills them 30 s on.
    """
    raise SystemExit(128 + signal.SIGTERM)


def _rank1_raises_then_its_launcher_stops_it(rank, world_size, report_dir):
    from rankguard.callbacks.hang.faults import FaultBoard

    watchdog = _watchdog(report_dir)
    if rank == 1:
        signal.signal(signal.SIGUSR1, _launcher_stops)
        FaultBoard.publish = _publish_interrupted_between_number_and_fault(FaultBoard.publish)
        try:
            check_batch({"tokens": []})
        except ValueError as exc:
            try:
                watchdog.on_error(exc, EventFacts(step=3))
            except SystemExit as stop:  # the launcher's request, once the others were told
                return {"exit": stop.code}
            watchdog.close()
        destroy_process_group_waits()
    wait_at_host_sync()  # rank 0, on NCCL: gloo would fail its collective once rank 1 exits


@pytest.mark.slow
def test_a_launchers_stop_during_the_publication_tells_every_rank_then_ends_the_rank(tmp_path):
    outcomes = run_ranks(_rank1_raises_then_its_launcher_stops_it, 2, str(tmp_path), timeout_s=90)
    assert outcomes[0].exitcode == DEADLOCK_EXIT_CODE, outcomes
    assert (outcomes[1].exitcode, outcomes[1].value) == (0, {"exit": 143}), outcomes
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("Rank 1 raised ValueError: sample 4711 has no tokens after filt")


def _store_in_rank0(port, rank, world_size, init_file):
    """The process group's store hosted by rank 0 (Composer's and Lightning's launchers)."""
    from datetime import timedelta

    import torch.distributed as dist

    del init_file
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _rank0_hosting_the_store_dies_then_rank1_raises(rank, world_size, report_dir, port):
    import torch.distributed as dist

    watchdog = _watchdog(report_dir, teardown_s=30.0)
    # Rank 1 knows rank 0's process before it dies: without the barrier rank 0 could abort
    # as soon as it knew rank 1's, before rank 1's thread read rank 0's (a fresh clone did).
    dist.barrier()
    if rank == 0:
        os.abort()  # gloo's abort after a mismatched collective: the store goes with it
    address = ("127.0.0.1", port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # rank 1's collective with it fails: it raises at once
        try:
            socket.create_connection(address, timeout=0.2).close()
        except OSError:
            break
        time.sleep(0.001)
    try:
        check_batch({"tokens": []})
    except ValueError as exc:
        started = time.monotonic()
        watchdog.on_error(exc, EventFacts(step=3))
        Path(report_dir, "told_s").write_text(str(time.monotonic() - started))
    destroy_process_group_waits()


@pytest.mark.slow
def test_a_rank_whose_store_died_with_rank_0_knows_it_at_once_and_names_rank_0(tmp_path):
    """Composer's and Lightning's launchers: rank 0 hosts the store; it aborts, rank 1 raises.

    A TCPStore client retries a refused connection for its whole timeout (a minute): rank 1
    waited 15 s to tell nobody, then its close 20 s more, and Composer's launcher killed it
    at 30 s. Now its store look is refused at once, and its node's look finds rank 0 gone.
    """
    import functools

    from benchmarks.launch import free_port

    port = free_port()
    setup = functools.partial(_store_in_rank0, port)
    started = time.monotonic()
    outcomes = run_ranks(
        _rank0_hosting_the_store_dies_then_rank1_raises,
        2,
        str(tmp_path),
        port,
        timeout_s=90,
        until=[1],
        setup=setup,
    )
    took = time.monotonic() - started
    assert outcomes[1].exitcode == HANG_EXIT_CODE, outcomes
    assert took < 45, took
    # Rank 1 raises within milliseconds of the store's end. Its watchdog thread may still
    # find rank 0's pid gone first (a wake in between) and end it with the same 75 before
    # it raised: then there is no publication to time.
    told = tmp_path / "told_s"
    if told.exists():
        told_s = float(told.read_text())
        assert told_s < 5.0, told_s  # the publication gave up at once, not after 15 s
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("Rank 0 is gone: its process ended without an exception"), summary


def _board(store):
    from types import SimpleNamespace

    from rankguard.callbacks.hang.faults import FaultBoard

    return FaultBoard(SimpleNamespace(prefix="rankguard/test", store=store, rank=0))


def test_a_fault_numbered_but_never_written_does_not_hide_the_next():
    import torch.distributed as dist

    store = dist.HashStore()
    board = _board(store)
    store.add(board._count, 1)  # a publisher that died between its number and its fault
    assert board.poll() == []  # not yet written, nothing after it: it may still come
    board.publish(_fault(1, "transient"))
    assert [(f.rank, f.family) for f in board.poll()] == [(1, "transient")]
    board.publish(_fault(2, "code"))
    assert [f.rank for f in _board(store).poll()] == [1, 2]  # a new reader passes it too


def _rank1_killed(rank, world_size, report_dir):
    _watchdog(report_dir)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: nothing runs after it
    wait_at_host_sync()


@pytest.mark.slow
def test_a_killed_rank_is_named_gone_by_its_node_within_seconds(tmp_path):
    started = time.monotonic()
    outcomes = run_ranks(_rank1_killed, 2, str(tmp_path), timeout_s=90)
    took = time.monotonic() - started
    assert outcomes[1].exitcode == -signal.SIGKILL, outcomes
    assert outcomes[0].exitcode == HANG_EXIT_CODE, outcomes
    assert took < 30, took
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("Rank 1 is gone: its process ended without an exception"), summary
    assert "ended without an exception in Python" in summary
    assert "Rank 0 was in its own code (after train batch 3)" in summary, summary
    assert "it ends with exit code 75" in summary


def _every_rank_raises_and_catches(rank, world_size, report_dir):
    """The user's code catches the fit's error on every rank and trains again: nothing ends."""
    import torch.distributed as dist

    watchdog = _watchdog(report_dir, teardown_s=2.0)
    dist.barrier()  # at once: every rank raises at the same batch, none past the settle time
    try:
        check_batch({"tokens": []})
    except ValueError as exc:
        watchdog.on_error(exc, EventFacts(step=3))
        watchdog.close()
    dist.barrier()  # the user's retry: a second fit, healthy
    from rankguard.callbacks.core.side_channel import SideChannel

    watchdog.bind(SideChannel.from_environment(timeout_s=10))
    watchdog.on_fit_start(EventFacts())
    for step in range(3):
        watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        dist.barrier()
        watchdog.handle(Event.TRAIN_BATCH_END, EventFacts(step=step + 1))
    time.sleep(3)  # past the first fit's teardown bound: the second fit lifted it
    watchdog.on_fit_end(EventFacts(step=3))
    watchdog.close()
    return watchdog.incidents


@pytest.mark.slow
def test_a_fault_every_rank_catches_before_a_new_fit_ends_nothing(tmp_path):
    outcomes = run_ranks(_every_rank_raises_and_catches, 2, str(tmp_path), timeout_s=90)
    assert [(o.error, o.value) for o in outcomes] == [(None, 0), (None, 0)], outcomes
    assert not (tmp_path / "summary.txt").exists()


def _every_rank_raises_a_checks_verdict(rank, world_size, report_dir):
    """A check's verdict every rank raises at fit start (the loop example's unseeded split).

    Rank 1 gets it first and closes while its watchdog thread sleeps between exchanges;
    rank 0 closes once its own thread waits in its next status exchange, for a status
    rank 1 will never send. Returns how long rank 0's close took.
    """
    import threading

    import torch.distributed as dist

    from rankguard.callbacks.core.errors import DataInconsistencyError
    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.watchdog_thread import STATUS_EXCHANGE

    waiting = threading.Event()
    exchange = SideChannel.exchange

    def noted(self, name, *args, **kwargs):
        if name == STATUS_EXCHANGE and peer_closed.is_set():
            waiting.set()
        return exchange(self, name, *args, **kwargs)

    peer_closed = threading.Event()
    SideChannel.exchange = noted
    watchdog = _watchdog(report_dir, period_s=10.0)  # the defaults: a 10 s exchange timeout
    error = DataInconsistencyError("Ranks see different data (at fit start): ...")
    if rank == 1:
        watchdog.on_error(error, EventFacts(step=0))
        watchdog.close()
    dist.barrier()  # rank 1 closed
    if rank == 1:
        return None
    peer_closed.set()
    watchdog._watch.wake.set()  # its next exchange now, not at the end of its period
    assert waiting.wait(15), "rank 0's watchdog thread started no status exchange"
    time.sleep(0.5)  # in it, waiting for rank 1's status
    started = time.monotonic()
    watchdog.on_error(error, EventFacts(step=0))
    watchdog.close()
    return time.monotonic() - started


@pytest.mark.slow
def test_a_rank_closing_after_a_verdict_every_rank_raised_leaves_its_status_exchange(tmp_path):
    # Its close does not wait out the exchange's 10 s for a peer that already closed: a
    # launcher that stops every rank once one exits would end it before its error shows.
    outcomes = run_ranks(_every_rank_raises_a_checks_verdict, 2, str(tmp_path), timeout_s=90)
    assert [o.error for o in outcomes] == [None, None], outcomes
    assert outcomes[0].value < 3.0, outcomes[0].value


def _rank1_killed_rank0_raises(rank, world_size, report_dir):
    """Gloo: the killed peer's closed socket raises in rank 0's next collective at once."""
    import torch.distributed as dist

    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    watchdog = _watchdog(report_dir)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while is_alive(pids[1]):
        time.sleep(0.01)
    watchdog.handle(Event.TRAIN_BATCH_START, EventFacts(step=3))  # rank 0 steps on at once
    try:
        dist.barrier()
    except RuntimeError as exc:  # rank 0's error leaves its fit
        watchdog.on_error(exc, EventFacts(step=3))
        watchdog.close()
        return [(f.rank, f.family) for f in watchdog._watch.faults.board.seen]
    return "barrier returned"


def test_a_collective_that_fails_because_a_peer_died_names_the_peer_first(tmp_path):
    outcomes = run_ranks(_rank1_killed_rank0_raises, 2, str(tmp_path), timeout_s=90, until=[0])
    assert outcomes[0].value == [(1, "gone"), (0, "communication")], outcomes
