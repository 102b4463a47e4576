"""DataStallMonitor: a rank starved of data is named within `window` steps + one interval."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from rankguard.callbacks.core import background_exchange, step_log
from rankguard.callbacks.core.errors import DataStallError
from rankguard.callbacks.core.events import Event, EventFacts, LoaderFacts
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.data import data_fetch
from rankguard.callbacks.data.data_fetch import LoaderReturnClock
from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor
from rankguard.callbacks.data.data_worker import worker_failure
from rankguard.callbacks.data.stall import IntervalStats, describe_stall, stall_verdict
from tests.mp import run_ranks

WINDOW, INTERVAL, STEPS = 3, 5, 20
COMPUTE_S, SLOW_FETCH_S = 0.004, 0.03


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.batches: list[tuple[int, str]] = []
        self.batch = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.batches.append((self.batch, record.getMessage()))


def _train(rank, slow_rank, slow_from):
    """Drives the monitor like an adapter; rank `slow_rank` fetches slowly from `slow_from` on."""
    records = _Records()
    logging.getLogger("rankguard").addHandler(records)
    metrics: list[dict] = []
    monitor = DataStallMonitor(threshold=0.5, window=WINDOW, interval=INTERVAL)
    monitor.bind(SideChannel.from_environment(timeout_s=20), log_metrics=metrics.append)
    loader = DataLoader(list(range(8 * STEPS)), batch_size=8)
    monitor.on_fit_start(EventFacts.for_loaders([LoaderFacts("train", loader, is_train=True)]))
    for step in range(STEPS):
        records.batch = step
        facts = EventFacts(step=step)
        monitor.handle(Event.DATA_FETCH_START, facts)
        if rank == slow_rank and step >= slow_from:
            time.sleep(SLOW_FETCH_S)
        monitor.handle(Event.DATA_FETCH_END, facts)
        monitor.handle(Event.TRAIN_BATCH_START, facts)
        time.sleep(COMPUTE_S)
        monitor.handle(Event.TRAIN_BATCH_END, facts)
    monitor.handle(Event.FIT_END, EventFacts(step=STEPS))
    logging.getLogger("rankguard").removeHandler(records)
    return records.batches, metrics


def _runs(rank, world_size):
    return {"healthy": _train(rank, None, 0), "slow": _train(rank, 1, 2)}


@pytest.fixture(scope="module")
def runs():
    outcomes = run_ranks(_runs, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
    return [o.value for o in outcomes]


def test_slow_rank_is_named_within_window_plus_one_interval_on_every_rank(runs):
    slow_from = 2
    for rank_runs in runs:
        warnings, metrics = rank_runs["slow"]
        assert len(warnings) == 1, warnings  # once, not at every interval
        batch, message = warnings[0]
        # The first slow step closes at batch slow_from + 1; WINDOW of them, then <= INTERVAL.
        assert batch <= slow_from + WINDOW + INTERVAL + 1  # acted on at the next batch
        assert "Data loading cannot keep up on rank 1:" in message
        assert "samples/s" in message and "num_workers" in message
        assert "rank 0" not in message
        assert metrics[-1]["rankguard/data_wait_slowest_rank"] == 1.0
        assert metrics[-1]["rankguard/data_wait_fraction_max"] > 0.5
    _, slow_metrics = runs[1]["slow"]
    assert slow_metrics[-1]["rankguard/data_wait_fraction"] > 0.5
    assert slow_metrics[-1]["rankguard/data_wait_s"] >= SLOW_FETCH_S * 0.9


def test_healthy_run_logs_metrics_and_never_warns(runs):
    for rank_runs in runs:
        warnings, metrics = rank_runs["healthy"]
        assert warnings == []
        assert len(metrics) == 1 + STEPS // INTERVAL  # the early verdict at batch 3, then 5, 10..
        assert set(metrics[-1]) == {
            "rankguard/data_wait_s",
            "rankguard/data_wait_fraction",
            "rankguard/data_wait_fraction_max",
            "rankguard/data_wait_slowest_rank",
        }
        assert metrics[-1]["rankguard/data_wait_fraction_max"] < 0.5


#: The left interval's shortest time between exchanges, and the fit's 2 ms steps: 50 steps
#: take 0.1-0.15 s on a quiet machine, and under 1 s at up to six times its load.
LEFT_INTERVAL_S, LEFT_STEPS = 1.0, 1000


def _left_interval(rank, world_size):
    background_exchange.AUTO_INTERVAL_S = LEFT_INTERVAL_S
    metrics: list[dict] = []
    monitor = DataStallMonitor()
    channel = SideChannel.from_environment(timeout_s=20)
    monitor.bind(channel, log_metrics=metrics.append)
    monitor.handle(Event.FIT_START, EventFacts())
    batches = []
    for step in range(LEFT_STEPS):
        facts = EventFacts(step=step)
        monitor.handle(Event.DATA_FETCH_START, facts)
        monitor.handle(Event.DATA_FETCH_END, facts)
        monitor.handle(Event.TRAIN_BATCH_START, facts)
        if monitor._pending is not None and monitor._posted_at == step + 1:
            batches.append(step + 1)
        time.sleep(0.002)
        monitor.handle(Event.TRAIN_BATCH_END, facts)
    monitor.handle(Event.FIT_END, EventFacts(step=LEFT_STEPS))
    return batches, len(metrics), channel.exchanges


def test_a_left_interval_exchanges_less_often_at_fast_steps_at_the_same_batches_everywhere():
    outcomes = run_ranks(_left_interval, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
    posted, logged, exchanges = outcomes[0].value
    assert outcomes[1].value == outcomes[0].value  # the same batches on every rank
    # The early verdicts, then the intervals: every 50 batches would take under the 1 s
    # between exchanges, so each interval is a multiple of 50 batches greater than 50 (how
    # many depends on the machine's pace: 500 on a quiet one).
    assert posted[:5] == [3, 6, 12, 24, 50] and all(b % 50 == 0 for b in posted[4:])
    gaps = [b - a for a, b in pairwise(posted[4:])]
    assert gaps and all(gap > 50 for gap in gaps), posted
    assert logged == exchanges == len(posted)


def test_stall_raises_when_asked():
    monitor = DataStallMonitor(on_violation="raise", window=1, interval=2)
    monitor.handle(Event.DATA_FETCH_START, EventFacts())
    monitor.handle(Event.TRAIN_BATCH_START, EventFacts())
    monitor.handle(Event.DATA_FETCH_START, EventFacts())
    time.sleep(0.01)
    monitor.handle(Event.DATA_FETCH_END, EventFacts())
    monitor.handle(Event.TRAIN_BATCH_START, EventFacts())  # closes the slow step, posts
    with pytest.raises(DataStallError, match="cannot keep up on rank 0"):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts())  # every rank acts on the verdict here


def test_eval_and_epoch_boundaries_are_not_counted_as_data_wait():
    metrics: list[dict] = []
    monitor = DataStallMonitor(window=1, interval=2)
    monitor.bind(SideChannel(None), log_metrics=metrics.append)
    monitor.handle(Event.TRAIN_BATCH_START, EventFacts())
    monitor.handle(Event.DATA_FETCH_START, EventFacts())  # Lightning: at train batch end
    monitor.on_eval_start(EventFacts())
    time.sleep(0.02)  # evaluation
    monitor.handle(Event.DATA_FETCH_END, EventFacts())
    monitor.handle(Event.TRAIN_BATCH_START, EventFacts())
    assert metrics == []  # the only step spanned evaluation: nothing measured


@pytest.mark.parametrize("in_a_save", [True, False])
def test_a_checkpoint_save_after_the_batch_end_is_not_counted_as_data_wait(in_a_save, monkeypatch):
    """Lightning's ModelCheckpoint saves after rankguard's batch-end hook opened the window.

    On a fake clock: 5 ms of compute, then 100 ms inside the fetch window, either a save
    (not a wait for data) or the loader itself (a wait), then 1 ms to fetch.
    """
    clock = [0.0]
    monkeypatch.setattr(step_log, "perf_counter", lambda: clock[0])
    metrics: list[dict] = []
    monitor = DataStallMonitor(window=1, interval=4)
    monitor.bind(SideChannel(None), log_metrics=metrics.append)
    monitor.handle(Event.FIT_START, EventFacts())
    for _ in range(5):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts())
        clock[0] += 0.005  # forward, backward, optimizer step
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts())
        monitor.handle(Event.DATA_FETCH_START, EventFacts())  # Lightning: at train batch end
        if in_a_save:
            monitor.handle(Event.CHECKPOINT_SAVE_START, EventFacts())
        clock[0] += 0.1
        if in_a_save:
            monitor.handle(Event.CHECKPOINT_SAVE_END, EventFacts())
        clock[0] += 0.001  # the loader's next()
        monitor.handle(Event.DATA_FETCH_END, EventFacts())
    monitor.handle(Event.TRAIN_BATCH_START, EventFacts())
    monitor.on_fit_end(EventFacts())
    fractions = [m["rankguard/data_wait_fraction"] for m in metrics]
    assert fractions, metrics
    if in_a_save:  # 1 ms of each 106 ms step waited for data
        assert max(fractions) < 0.05, fractions
    else:
        assert min(fractions) > 0.9, fractions


def test_stall_verdict_names_ranks_with_a_long_enough_run():
    fast = IntervalStats(wait_s=0.1, step_s=10.0, steps=50, longest_run=0)
    slow = IntervalStats(wait_s=8.0, step_s=10.0, steps=50, longest_run=7, batch_size=32)
    verdict = stall_verdict({0: fast, 1: slow, 2: fast}, window=5, threshold=0.5)
    assert (verdict.slowest_rank, verdict.fraction_max) == (1, 0.8)
    assert list(verdict.stalled) == [1] and slow.throughput() == "160.0 samples/s"
    assert verdict.recovered == {0, 2}
    # Rank 1's run is too short for a stall, but it still waits 80%: it has not kept up.
    short = stall_verdict({0: fast, 1: slow}, window=8, threshold=0.5)
    assert short.stalled == set() and short.recovered == {0}


def test_a_stall_that_goes_on_is_reported_once_and_again_only_after_a_recovery():
    """A fast step now and then breaks the run but not the stall; an interval kept up ends it."""
    records = _Records()
    logging.getLogger("rankguard").addHandler(records)
    monitor = DataStallMonitor(threshold=0.5, window=3, interval=4)
    monitor.bind(SideChannel(None), log_metrics=lambda metrics: None)
    # Per step, whether its fetch is slow: a stall; runs of 2 slow steps (waiting ~80% of
    # the time); a stall again; keeping up for two intervals; a new stall.
    sections = [[True] * 8, [False, True, True] * 3, [True] * 8, [False] * 8, [True] * 8]
    pattern = [slow for section in sections for slow in section]
    recovered_at = len(pattern) - 8
    try:
        for step, slow in enumerate(pattern):
            records.batch = step
            monitor.handle(Event.DATA_FETCH_START, EventFacts(step=step))
            time.sleep(SLOW_FETCH_S if slow else 0.0)
            monitor.handle(Event.DATA_FETCH_END, EventFacts(step=step))
            monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
            time.sleep(COMPUTE_S)
    finally:
        logging.getLogger("rankguard").removeHandler(records)
    batches = [batch for batch, _ in records.batches]
    assert len(batches) == 2, records.batches
    assert batches[0] < 8 and recovered_at < batches[1], batches
    assert all("cannot keep up on rank 0" in message for _, message in records.batches)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"threshold": 0}, "threshold"),
        ({"threshold": 1.5}, "threshold"),
        ({"threshold": True}, "threshold"),
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
        ({"interval": 0}, "interval"),
        ({"on_violation": "crash"}, "on_violation"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        DataStallMonitor(**kwargs)
    DataStallMonitor(threshold=1, window=1, interval=1)  # the bounds themselves are valid


class _DiesInWorker(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(1)


def test_dead_loader_worker_is_logged_with_rank_and_step(caplog):
    loader = DataLoader(_DiesInWorker(), num_workers=1)
    with pytest.raises(RuntimeError) as info:
        next(iter(loader))
    monitor = DataStallMonitor()
    with caplog.at_level(logging.ERROR, logger="rankguard"):
        assert monitor.on_error(info.value, EventFacts(step=17)) is True
        assert monitor.on_error(ValueError("loss is nan"), EventFacts(step=18)) is False
    # Only rankguard's records count: torch's SIGCHLD handler can raise inside torch's own code
    # while the worker dies (torch 2.13 caught it in a lazy profiler import and logged a warning).
    [record] = [r for r in caplog.records if r.name.startswith("rankguard")]
    message = record.getMessage()
    assert "rank 0, step 17" in message and "DataLoader worker process died" in message
    # torch says "is killed by signal: Killed." or "exited unexpectedly", depending on timing.
    assert "DataLoader worker (pid" in message


class _SigchldOnce(logging.Handler):
    """Raises once in the first record's emit, as torch's SIGCHLD handler raises anywhere."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.raised = False
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not self.raised:
            self.raised = True
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
        self.messages.append(record.getMessage())


def test_a_dead_worker_signal_while_logging_still_logs_it_once():
    # The worker died mid-batch (a broken connection), and torch's SIGCHLD handler raised
    # its own RuntimeError while rankguard was logging: the line still comes, once.
    monitor = DataStallMonitor()
    handler = _SigchldOnce()
    log = logging.getLogger("rankguard.callbacks.data_stall")
    log.addHandler(handler)
    try:
        lost = RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        assert monitor.on_error(lost, EventFacts(step=6)) is True
    finally:
        log.removeHandler(handler)
    assert handler.raised
    [message] = handler.messages
    assert "rank 0, step 6: data loading failed" in message


def test_worker_failures_are_recognised_through_the_cause_chain():
    try:
        try:
            raise RuntimeError("generator thread data thread 3 failed")
        except RuntimeError as inner:
            raise ValueError("training failed") from inner
    except ValueError as outer:
        assert "same-region storage" in worker_failure(outer)
    assert "num_workers=0" in worker_failure(
        ValueError("Caught KeyError in DataLoader worker process 0.\nOriginal Traceback ...")
    )
    exited = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
    assert "(RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly)" in worker_failure(
        exited
    )
    assert worker_failure(RuntimeError("CUDA out of memory")) is None


class _SlowItems(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.02)
        return torch.zeros(1)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_return_clock_stops_when_the_loader_returns_and_removes_itself(num_workers):
    loader = DataLoader(_SlowItems(), batch_size=2, num_workers=num_workers)
    iterator = iter(loader)
    clock = LoaderReturnClock()
    start = time.perf_counter()
    assert clock.arm(loader)
    next(iterator)
    returned = time.perf_counter()
    assert sys.getprofile() is None  # removed itself at the return
    time.sleep(0.05)  # what a framework does after next(): Composer's all_reduce
    returned_at = clock.disarm()
    assert start + 0.04 <= returned_at <= returned
    next(iterator)
    assert clock.arm(loader)
    with pytest.raises(StopIteration):
        next(iterator)
    assert clock.disarm() is not None and sys.getprofile() is None


def test_loader_return_clock_leaves_other_profilers_and_other_iterables_alone():
    clock = LoaderReturnClock()
    assert not clock.arm(iter([1, 2]))  # not a DataLoader: the event's time is used
    assert sys.getprofile() is None and clock.disarm() is None

    def other(frame, event, arg):
        return None

    sys.setprofile(other)
    try:
        assert not clock.arm(DataLoader([1, 2]))
        assert sys.getprofile() is other
        assert clock.disarm() is None and sys.getprofile() is other
    finally:
        sys.setprofile(None)


class _Profiled(Dataset):
    """Items read after ``delay_s``; records whether a profile hook was live while reading.

    ``clock``: a fake clock (a one-item list) the read advances instead of sleeping.
    """

    def __init__(self, delay_s: float, clock: list[float] | None = None) -> None:
        self.delay_s = delay_s
        self.clock = clock
        self.hooked: list[bool] = []

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        self.hooked.append(sys.getprofile() is not None)
        if self.clock is None:
            time.sleep(self.delay_s)
        else:
            self.clock[0] += self.delay_s
        return i


def _composer_like_steps(monitor, dataset, collective_s, steps, clock=None):
    """Fetch windows as Composer's: next(), then an all_reduce waiting ``collective_s``.

    The step log is read after each batch start, as the hang watchdog's thread reads it
    (every 0.5 s) in a fit. ``clock``: the step log's clock (a one-item list), advanced
    by the test instead of sleeping (0.1 ms a ``next()``), where a test's outcome must not
    depend on how the machine schedules it.
    """
    loader = DataLoader(dataset, batch_size=1)
    facts = EventFacts(loader=LoaderFacts("train", loader, is_train=True))
    monitor.handle(Event.FIT_START, EventFacts.for_loaders([facts.loader]))
    iterator = iter(loader)

    def wait(seconds: float) -> None:
        if clock is None:
            time.sleep(seconds)
        else:
            clock[0] += seconds

    for _ in range(steps):
        monitor.handle(Event.DATA_FETCH_START, facts)
        next(iterator)
        wait(collective_s if clock is None else collective_s + 0.0001)
        monitor.handle(Event.DATA_FETCH_END, facts)
        monitor.handle(Event.TRAIN_BATCH_START, facts)
        monitor.steps.drain()
        wait(0.005)  # compute
    monitor.on_fit_end(facts)  # acts on the last exchange


def test_a_collective_in_the_fetch_window_is_not_counted_as_data_wait(monkeypatch):
    """Composer's window also holds an all_reduce: waiting there for a slower rank is not ours."""
    # On a fake clock, the step log's and the loader-return hook's: a loaded machine that
    # descheduled a real fetch read 27% of a step as data wait (a fresh clone's CI).
    clock = [0.0]
    monkeypatch.setattr(step_log, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(data_fetch, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    metrics: list[dict] = []
    monitor = DataStallMonitor(window=1, interval=6, on_violation="raise")
    monitor.bind(SideChannel(None), log_metrics=metrics.append)
    data = _Profiled(delay_s=0.0, clock=clock)
    _composer_like_steps(monitor, data, collective_s=0.03, steps=6, clock=clock)
    early, logged = metrics  # no DataStallError although every window was 85% waiting
    assert early["rankguard/data_wait_fraction"] < 0.2  # the early verdict at batch 3
    assert logged["rankguard/data_wait_fraction"] < 0.2
    assert logged["rankguard/data_wait_s"] < 0.01
    # A window that looks slow is not measured; the next fetch is timed to the loader's return.
    assert data.hooked == [False, False, True, False, True, False]


def test_a_slow_loader_is_timed_to_its_return_and_reported(monkeypatch):
    # 30 ms reads against 5 ms steps, on a fake clock: the step log's and the loader-return
    # hook's (a loaded machine stretches a real 5 ms sleep past the read's 30 ms).
    clock = [0.0]
    monkeypatch.setattr(step_log, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(data_fetch, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monitor = DataStallMonitor(window=2, interval=5, on_violation="raise")
    monitor.bind(SideChannel(None))
    data = _Profiled(delay_s=0.03, clock=clock)
    with pytest.raises(DataStallError, match=r"on rank 0: .* 3 slow steps in a row"):
        _composer_like_steps(monitor, data, collective_s=0.0, steps=5, clock=clock)
    assert data.hooked == [False, False, True, True, True]


def test_a_healthy_fetch_window_never_arms_the_profile_hook(monkeypatch):
    # On the step log's clock, 0.1 ms fetches and 5 ms steps: a fetch the machine happened
    # to deschedule would look slow and rightly be watched next time, which is not this test.
    clock = [0.0]
    monkeypatch.setattr(step_log, "perf_counter", lambda: clock[0])
    monitor = DataStallMonitor(window=1, interval=50)
    data = _Profiled(delay_s=0.0)
    _composer_like_steps(monitor, data, collective_s=0.0, steps=20, clock=clock)
    assert not any(data.hooked)


class _BrokenQueue:
    """A worker result queue whose sender died mid-batch (the fd transfer fails)."""

    def get(self, timeout=None):
        raise ConnectionResetError(104, "Connection reset by peer")


class _RemoteReads(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_connection_lost_while_receiving_a_batch_is_a_dead_worker():
    iterator = iter(DataLoader(list(range(8)), batch_size=2, num_workers=1))
    iterator._data_queue = _BrokenQueue()  # torch re-raises it while the worker looks alive
    with pytest.raises(ConnectionResetError) as info:
        next(iterator)
    del iterator
    reason = worker_failure(info.value)
    assert "connection to a DataLoader worker broke" in reason
    assert "(ConnectionResetError: [Errno 104] Connection reset by peer)" in reason
    # The same error from the dataset's own code in the main process is not a worker's death.
    with pytest.raises(ConnectionResetError) as info:
        next(iter(DataLoader(_RemoteReads())))
    assert worker_failure(info.value) is None


#: A starved loader's wait per batch, 30 times the step's compute: a step stays slow (over half
#: its time waiting) unless the machine's load delays the compute by a tenth of a second.
STARVED_FETCH_S = 0.12


def _starved_from_the_first_batch(rank, world_size):
    """Default settings; rank 1's loader waits 120 ms a batch from its first, raises at its 8th.

    Returns the batches at which rankguard warned, and what it logged at the error.
    """
    records = _Records()
    logging.getLogger("rankguard").addHandler(records)
    monitor = DataStallMonitor()
    monitor.bind(SideChannel.from_environment(timeout_s=20), log_metrics=lambda metrics: None)
    loader = DataLoader(list(range(80)), batch_size=8)
    monitor.on_fit_start(EventFacts.for_loaders([LoaderFacts("train", loader, is_train=True)]))
    try:
        for step in range(10):
            records.batch = step + 1
            monitor.handle(Event.DATA_FETCH_START, EventFacts(step=step))
            if rank == 1:
                time.sleep(STARVED_FETCH_S)
                if step == 7:
                    error = RuntimeError("generator thread data thread 3 failed")
                    monitor.on_error(error, EventFacts(step=step))
                    break
            monitor.handle(Event.DATA_FETCH_END, EventFacts(step=step))
            monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
            # Rank 0 waits for rank 1 in the step's collective (DDP's gradient all_reduce).
            time.sleep(COMPUTE_S + (STARVED_FETCH_S if rank == 0 else 0.0))
            monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    finally:
        logging.getLogger("rankguard").removeHandler(records)
        monitor.close()
    return records.batches


def test_a_loader_starved_from_its_first_batch_is_named_before_it_dies_at_its_eighth():
    outcomes = run_ranks(_starved_from_the_first_batch, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
    for outcome in outcomes:
        warnings = [(b, m) for b, m in outcome.value if "cannot keep up" in m]
        # The first verdict goes at batch 3's start, every rank acts on it at batch 4's.
        assert [b for b, _ in warnings] == [4], outcome.value
        message = warnings[0][1]
        assert (
            "cannot keep up on rank 1:" in message
            and "2 slow steps in a row (2 of the fit's first 2)" in message
        )
        assert "other ranks 0.00 s per batch" in message, message
    errors = [m for _, m in outcomes[1].value if "loader raised" in m]
    assert len(errors) == 1, outcomes[1].value
    assert re.search(
        r"rank 1's loader raised at batch 8 after waiting (8\d|9\d)% of its step time in 6 "
        r"measured steps \(0\.1\d s per batch, 6 steps slow; other ranks 0\.00 s at the "
        r"exchange of batch 6\)",
        errors[0],
    ), errors[0]


def test_early_verdicts_name_a_rank_slow_on_most_of_its_first_steps_only():
    def stats(slow, steps, run):
        return IntervalStats(slow * 0.1, steps * 0.12, steps, run, None, steps, slow)

    fast = stats(0, 2, 0)
    verdict = stall_verdict({0: fast, 1: stats(2, 2, 2)}, window=10, threshold=0.5)
    assert list(verdict.stalled) == [1] and verdict.others_wait_s == 0.0
    # One slow step of two is not most; one measured step is too few to judge.
    assert stall_verdict({0: fast, 1: stats(1, 2, 1)}, window=10, threshold=0.5).stalled == set()
    assert stall_verdict({0: fast, 1: stats(1, 1, 1)}, window=10, threshold=0.5).stalled == set()
    # From `window` measured steps on, only a run of `window` slow steps is a stall.
    assert stall_verdict({0: fast, 1: stats(8, 12, 4)}, window=10, threshold=0.5).stalled == set()


def test_early_verdicts_leave_a_rank_whose_first_steps_waited_milliseconds_alone():
    # A healthy run's first steps: 3 of 5 steps of 1.2 ms waited 0.84 ms (70%), 0.5 ms a batch.
    quick = IntervalStats(0.0025, 0.006, 5, 3, None, 5, 3)
    assert stall_verdict({0: quick, 1: quick}, window=10, threshold=0.5).stalled == set()
    # The same share of steps a hundred times longer is a starved loader.
    starved = IntervalStats(0.25, 0.6, 5, 3, None, 5, 3)
    assert list(stall_verdict({0: quick, 1: starved}, window=10, threshold=0.5).stalled) == [1]
    # A healthy rank on a busy host: its loader's return held 30 ms in both of its first two
    # steps of 48 ms (62%), by the scheduler; two steps do not tell that from a starved loader.
    held = IntervalStats(0.06, 0.096, 2, 2, None, 2, 2)
    assert stall_verdict({0: quick, 1: held}, window=10, threshold=0.5).stalled == set()
    # Ten such steps in a row are a stall, whatever their wait.
    held_long = IntervalStats(0.3, 0.48, 10, 10, None, 10, 10)
    assert list(stall_verdict({0: quick, 1: held_long}, window=10, threshold=0.5).stalled) == [1]


def test_a_stall_of_more_ranks_than_a_message_details_counts_the_rest_and_names_the_others():
    def stats(wait_s: float, run: int) -> IntervalStats:
        return IntervalStats(wait_s, 10.0, 50, run, None, 200, 100 if run else 0)

    per_rank = {r: stats(6.0 + r * 0.1, 20) if r < 8 else stats(0.5, 0) for r in range(16)}
    verdict = stall_verdict(per_rank, window=10, threshold=0.5)
    assert verdict.stalled == set(range(8)) and verdict.world == 16
    assert list(verdict.detailed) == [5, 6, 7]  # the 3 longest waits, by rank
    text = describe_stall(verdict, threshold=0.5, window=10)
    assert text.startswith("Data loading cannot keep up on ranks 0-7: "), text
    assert "; 5 more stalled ranks (all stalled ranks: a median 0.13 s per batch)" in text, text
    assert "; other ranks 0.01 s per batch);" in text, text
    assert "every other rank waits for them at each collective" in text, text
