"""StragglerMonitor: scores, hooks and a real 2-rank DDP loop on gloo (no framework).

The framework runs (Composer, Lightning, simulated nodes) are in
``tests/frameworks/test_straggler_e2e.py``.
"""

from __future__ import annotations

import itertools
import logging
import re
import statistics
import time
import warnings

import pytest
import torch

from rankguard.callbacks import GUARDS, StragglerMonitor
from rankguard.callbacks.core import background_exchange
from rankguard.callbacks.core.background_exchange import BackgroundExchange
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor
from rankguard.callbacks.straggler.forward_clock import (
    EventTimer,
    ForwardClock,
    cuda_events,
    hook_targets,
)
from rankguard.callbacks.straggler.score import (
    MAX_LISTED,
    RankTimes,
    advance_streaks,
    describe_straggler,
    straggler_verdict,
)
from tests.e2e.straggler_loop import Sleeps, ddp, fsdp2, train
from tests.mp import run_ranks

MS = 0.001


def times(forward_ms: float, node: str = "host", **kwargs) -> RankTimes:
    defaults = {"steps": 10, "rest_s": 0.02, "between_s": 0.001}
    return RankTimes(node=node, forward_s=forward_ms * MS, **{**defaults, **kwargs})


def verdict(per_rank: dict[int, RankTimes], **kwargs):
    return straggler_verdict(per_rank, **{"threshold": 0.7, "min_excess_s": 0.001, **kwargs})


# --- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("threshold", 0),
        ("threshold", 1),
        ("threshold", 1.5),
        ("threshold", -0.2),
        ("threshold", "0.7"),
        ("threshold", True),
        ("window", 0),
        ("window", 2.5),
        ("interval", 0),
        ("interval", -3),
        ("warmup_steps", -1),
        ("timed_batches", 0),
        ("min_forward_s", -0.1),
        ("min_excess_s", -0.001),
        ("min_excess_s", "1ms"),
        ("on_violation", "ignore"),
    ],
)
def test_bad_settings_raise_a_value_error_naming_the_setting(setting, value):
    with pytest.raises(ValueError, match=f"`{setting}`"):
        StragglerMonitor(**{setting: value})


def test_defaults_and_place_in_the_run_order():
    monitor = StragglerMonitor()
    assert (monitor.on_violation, monitor.threshold, monitor.window, monitor.interval) == (
        "warn",
        0.7,
        3,
        50,
    )
    order = list(GUARDS)
    assert order.index("data_stall_monitor") < order.index("straggler_monitor")
    assert order.index("hang_watchdog") == 0  # its heartbeat comes before any check waits


# --- scores ---------------------------------------------------------------------------------------


def test_two_ranks_the_slower_one_scores_against_the_faster():
    v = verdict({0: times(10), 1: times(15)})
    assert v.scored and v.slowest_rank == 1
    assert v.score_min == pytest.approx(10 / 15)
    [slow] = v.slow
    assert (slow.kind, slow.ranks) == ("rank", (1,))
    assert v.node_score_min is None  # one node


def test_half_the_ranks_slow_are_all_named_against_the_healthy_half():
    v = verdict({r: times(15 if r % 2 else 10) for r in range(8)})
    assert [s.ranks for s in v.slow] == [(1,), (3,), (5,), (7,)]
    assert all(s.score == pytest.approx(2 / 3) for s in v.slow)


def test_jitter_below_the_threshold_names_nobody():
    v = verdict({0: times(10), 1: times(13), 2: times(11), 3: times(9)})
    assert v.scored and v.slow == ()
    assert v.score_min == pytest.approx(10 / 13)


def test_a_slow_node_is_named_once_with_its_ranks():
    per_rank = {r: times(15 if r >= 4 else 10, node=f"n{r // 4}") for r in range(8)}
    v = verdict(per_rank)
    [slow] = v.slow
    assert (slow.kind, slow.key, slow.ranks) == ("node", "n1", (4, 5, 6, 7))
    assert slow.label == "node n1 (ranks 4-7)"
    assert v.node_score_min == pytest.approx(2 / 3) and v.slowest_node == 1


def test_one_slow_rank_does_not_make_its_node_slow():
    per_rank = {r: times(30 if r == 5 else 10, node=f"n{r // 4}") for r in range(8)}
    v = verdict(per_rank)
    [slow] = v.slow
    assert (slow.kind, slow.ranks, slow.label) == ("rank", (5,), "rank 5 (node n1)")
    assert v.node_score_min == pytest.approx(1.0)


def test_a_rank_slower_than_it_was_is_named_while_the_others_kept_their_speed():
    per_rank = {r: times(10, baseline_s=10 * MS) for r in range(4)}
    per_rank[2] = times(12, baseline_s=7 * MS)  # faster than the others at first, now 0.58
    [slow] = verdict(per_rank).slow
    assert slow.ranks == (2,) and slow.own_score == pytest.approx(7 / 12)
    assert slow.score > 0.7  # not slower than the median rank
    message = describe_straggler(
        slow, verdict(per_rank).reference, threshold=0.7, window=3, interval=50
    )
    assert "It is slower than it was: its forward pass takes 12.0 ms per batch, 7.0 ms" in message


def test_every_rank_slowing_down_together_names_nobody():
    v = verdict({r: times(20, baseline_s=10 * MS) for r in range(4)})
    assert v.scored and v.slow == ()


def test_a_rank_200x_slower_than_a_sub_millisecond_reference_is_slow():
    v = verdict({0: times(0.1), 1: times(20), 2: times(0.12)})
    assert v.scored and [s.ranks for s in v.slow] == [(1,)]
    assert v.slow[0].score == pytest.approx(0.12 / 20)  # the median rank: 0.12 ms


def test_ranks_within_noise_of_each_other_are_not_slow_however_large_the_ratio():
    v = verdict({0: times(0.1), 1: times(0.6)})  # 0.17, but 0.5 ms apart
    assert v.scored and v.slow == () and v.score_min == pytest.approx(1 / 6)
    assert verdict({0: times(0.1), 1: times(1.2)}).slow  # 1.1 ms apart: not noise
    nodes = {r: times(0.6 if r >= 2 else 0.1, node=f"n{r // 2}") for r in range(4)}
    assert verdict(nodes).slow == ()
    own = {r: times(0.1, baseline_s=0.1 * MS) for r in range(4)}
    own[2] = times(0.12, baseline_s=0.02 * MS)  # own score 0.17, 0.1 ms slower than it was
    assert verdict(own).slow == ()
    assert not verdict({0: times(0, steps=0), 1: times(0, steps=0)}).scored


def test_deprecated_min_forward_s_keeps_its_old_meaning_and_warns():
    v = verdict({0: times(0.2), 1: times(20)}, min_forward_s=0.001)
    assert not v.scored and v.slow == () and v.reference is not None
    with pytest.warns(FutureWarning, match="`min_forward_s` is deprecated"):
        assert StragglerMonitor(min_forward_s=0.001).min_forward_s == 0.001
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert StragglerMonitor(min_forward_s=0).min_excess_s == 0.001
        assert StragglerMonitor().min_forward_s is None


def test_ranks_that_measured_nothing_are_left_out():
    v = verdict({0: times(10), 1: times(0, steps=0), 2: times(15)})
    assert [s.ranks for s in v.slow] == [(2,)]


def test_the_verdict_lists_a_bounded_number_of_ranks_slowest_first():
    per_rank = {r: times(10 if r < 600 else 20 + r / 100) for r in range(1000)}
    v = verdict(per_rank)
    assert len(v.slow) == MAX_LISTED
    assert v.slow[0].ranks == (999,) and v.slowest_rank == 999


def test_message_says_what_it_was_slow_at_the_waits_and_what_to_check():
    per_rank = {0: times(10, rest_s=0.025), 1: times(15, rest_s=0.02, between_s=0.012)}
    v = verdict(per_rank)
    message = describe_straggler(v.slow[0], v.reference, threshold=0.7, window=3, interval=50)
    assert message.startswith(
        "Straggler: rank 1 (node host) has been slow for 3 intervals of 50 train batches"
    )
    assert "slow at compute: its forward pass takes 15.0 ms per batch, the median rank's " in (
        message
    )
    assert "10.0 ms (score 0.67 < threshold 0.7)" in message
    assert "The others wait for it at the collectives" in message
    assert "DataStallMonitor" in message  # it also takes longer between batches
    assert "nvidia-smi -q -d PERFORMANCE,CLOCK" in message


def test_a_rank_is_named_after_window_slow_intervals_in_a_row_and_again_after_recovering():
    slow = verdict({0: times(10), 1: times(15)}).slow
    streaks: dict = {}
    named_at = []
    for interval, now in enumerate([slow, slow, (), slow, slow, slow, slow, (), slow, slow, slow]):
        streaks, named = advance_streaks(streaks, now, window=3)
        named_at += [(interval, s.label) for s in named]
    assert named_at == [(5, "rank 1 (node host)"), (10, "rank 1 (node host)")]


# --- hooks ----------------------------------------------------------------------------------------


def test_clock_counts_nested_calls_once_and_calls_outside_the_root():
    model = torch.nn.Sequential(Sleeps(0.01), Sleeps(0.01))
    assert hook_targets(model) == [model, model[0], model[1]]
    clock = ForwardClock()
    assert clock.attach(model) == 3
    model(torch.zeros(1, 4))
    assert (clock.calls, 0.018 < clock.total_s < 2) == (1, True)
    model[1](torch.zeros(1, 4))  # a loop calling a submodule, as Lightning's training_step does
    assert clock.calls == 2
    clock.detach()
    clock.detach()
    model(torch.zeros(1, 4))
    assert clock.calls == 2


def test_clock_keeps_only_the_hooks_of_modules_the_loop_calls_from_outside():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    clock = ForwardClock()
    assert clock.attach(model) == 3
    assert clock.keep_entered() == 3  # nothing ran yet: nothing is removed
    model(torch.zeros(1, 4))
    assert clock.keep_entered() == 1  # the children only ever ran inside the model
    model(torch.zeros(1, 4))
    assert clock.calls == 2

    class Lit(torch.nn.Module):  # a Lightning module: training_step calls `net`, not forward
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 4))

    lit = Lit()
    assert clock.attach(lit) == 2
    lit.net(torch.zeros(1, 4))
    assert clock.keep_entered() == 1
    lit.net(torch.zeros(1, 4))
    assert clock.calls == 2
    clock.detach()


def test_a_disarmed_clock_leaves_the_modules_unhooked_and_times_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    clock = ForwardClock()
    clock.attach(model)
    model(torch.zeros(1, 4))
    assert clock.keep_entered() == 1
    clock.arm(False)
    assert (clock.armed, clock.modules) == (False, 1)
    assert not model._forward_pre_hooks and not model._forward_hooks  # PyTorch's fast path
    model(torch.zeros(1, 4))
    assert clock.calls == 1
    clock.arm(True)
    clock.arm(True)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    model(torch.zeros(1, 4))
    assert clock.calls == 2
    clock.detach()
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize(
    ("interval", "timed_batches", "positions"),
    [
        (50, 8, [42, 43, 44, 45, 46, 47, 48, 49]),
        (10, 8, [2, 3, 4, 5, 6, 7, 8, 9]),
        (4, 8, [0, 1, 2, 3]),
        (7, 1, [6]),
    ],
)
def test_monitor_hooks_the_model_for_the_timed_batches_of_each_interval_only(
    interval, timed_batches, positions
):
    model = torch.nn.Linear(4, 4)
    samples: list[int] = []
    monitor = StragglerMonitor(interval=interval, warmup_steps=3, timed_batches=timed_batches)
    monitor.bind(SideChannel(None), lambda metrics: None)
    monitor.handle(Event.FIT_START, EventFacts(model=model))
    close = monitor._samples

    def counted_samples() -> tuple[list[float], list[float], list[float]]:
        closed = close()
        samples.append(len(closed[0]))
        return closed

    monitor._samples = counted_samples  # type: ignore[method-assign]
    hooked = []
    for step in range(3 * interval):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        hooked.append(bool(model._forward_pre_hooks))
        model(torch.zeros(1, 4))
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    monitor.close()
    # Batch b (from 1) is hooked through the warm-up, then where
    # its place in the interval (b % interval) is a timed one.
    expected = [b <= 3 or b % interval in positions for b in range(1, 3 * interval + 1)]
    assert hooked == expected
    # Each full interval after the warm-up closes with the forwards of its timed batches.
    assert samples[-1] == len(positions)


# `timing`: interval lengths follow the measured pace of 2 ms batches, which another
# worker's load stretches (run alone, in today's world: the pace arithmetic is pure Python).
@pytest.mark.timing
def test_a_left_interval_stretches_at_fast_steps_and_times_only_its_last_fifty_batches(
    monkeypatch,
):
    # 5 s of 2 ms batches is 2,500 batches: at 0.3 s an interval is a few hundred.
    monkeypatch.setattr(background_exchange, "AUTO_INTERVAL_S", 0.3)
    model = torch.nn.Linear(4, 4)
    monitor = StragglerMonitor(warmup_steps=3)
    assert (monitor.interval, monitor.auto_interval) == (50, True)
    monitor.bind(SideChannel(None), lambda metrics: None)
    monitor.handle(Event.FIT_START, EventFacts(model=model))
    close = monitor._samples
    closes: list[tuple[int, int]] = []  # (batch, forwards timed in the interval)

    def counted_samples() -> tuple[list[float], list[float], list[float]]:
        closed = close()
        closes.append((monitor._batches, len(closed[0])))
        return closed

    monitor._samples = counted_samples  # type: ignore[method-assign]
    hooked = []
    for step in range(800):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        hooked.append(bool(model._forward_pre_hooks))
        model(torch.zeros(1, 4))
        time.sleep(0.002)
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    monitor.close()
    ends = [batch for batch, _ in closes]
    assert ends[0] == 50 and len(ends) >= 3 and all(b % 50 == 0 for b in ends)
    # Once an interval of steady 2 ms batches was measured, each lasts 0.3 s or more
    # (the first one's pace holds the fit's start-up: the next may be 50 batches).
    assert all(b - a >= 100 for a, b in itertools.pairwise(ends[1:]))
    # Hooked through the warm-up, then the last 8 batches before each interval's end.
    expected = [b <= 3 or (0 < -b % 50 <= 8 and -(-b // 50) * 50 in ends) for b in range(1, 801)]
    assert hooked[: ends[-1]] == expected[: ends[-1]]
    assert [timed for _, timed in closes[1:]] == [8] * (len(closes) - 1)


def test_a_forward_that_raises_leaves_the_clock_closed():
    class Fails(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    clock = ForwardClock()
    fails = Fails()
    clock.attach(fails)
    with pytest.raises(RuntimeError):
        fails(torch.zeros(1))
    assert clock.calls == 1  # the forward hook runs with always_call=True


def test_hooks_do_nothing_inside_a_compiled_region():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    clock = ForwardClock()
    clock.attach(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break would raise
    compiled(torch.zeros(2, 4))
    assert clock.calls == 0


# --- device time (CUDA events), shown with fake events on CPU ----------------------------------


class FakeDevice:
    """A device stream: the host queues work (``queued``), the device runs it later (``done``)."""

    def __init__(self) -> None:
        self.queued = 0.0
        self.done = 0.0
        self.reads = 0


class FakeEvent:
    """``torch.cuda.Event``'s timing API on a :class:`FakeDevice`; reading it unfinished fails."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.device.queued

    def query(self) -> bool:
        return self.at is not None and self.device.done >= self.at

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read an event the device has not completed"
        self.device.reads += 1
        return 1000 * (end.at - self.at)

    def synchronize(self) -> None:
        raise AssertionError("the training thread waited for the device")

    wait = synchronize


class Queues(torch.nn.Module):
    """A forward that queues ``device_s`` of work on the fake device and returns at once."""

    def __init__(self, device: FakeDevice, device_s: float) -> None:
        super().__init__()
        self.device, self.device_s = device, device_s
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.device.queued += self.device_s
        return self.lin(x)


@pytest.fixture
def no_device_sync(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the training thread synchronised the device")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_device_clock_reads_a_batch_only_once_its_events_completed(no_device_sync):
    device = FakeDevice()
    model = torch.nn.Sequential(Queues(device, 0.005), Queues(device, 0.002))
    clock = ForwardClock(new_event=lambda: FakeEvent(device))
    clock.attach(model)
    for _ in range(3):
        start = time.perf_counter()
        model(torch.zeros(1, 4))
        device.queued += 0.010  # backward and optimizer step: outside the forward
        clock.close_batch(start, time.perf_counter())
    assert clock.ready() == [] and device.reads == 0  # nothing has run on the device yet
    device.done = 0.017 + 0.003  # batch 1 done, batch 2's forward under way
    assert clock.ready() == [pytest.approx(0.007)] and clock.timer.pending == 2
    assert clock.ready() == []
    device.done = device.queued
    assert clock.ready() == [pytest.approx(0.007)] * 2 and clock.timer.pending == 0
    assert clock.total_s < 0.5  # the host's time: it never waited for the device


def test_device_clock_reuses_its_events_and_forgets_forwards_outside_a_batch(no_device_sync):
    device = FakeDevice()
    model = Queues(device, 0.004)
    clock = ForwardClock(new_event=lambda: FakeEvent(device))
    clock.attach(model)
    read = []
    for batch in range(200):
        start = time.perf_counter()
        model(torch.zeros(1, 4))
        clock.close_batch(start, time.perf_counter(), keep=batch % 2 == 0)  # odd: warm-up
        model(torch.zeros(1, 4))  # an evaluation forward between batches
        if batch % 10 == 9:
            device.done = device.queued
            read += clock.ready()
    assert read == [pytest.approx(0.004)] * 100
    assert clock.timer.created <= 24  # a pool: not 2 events per forward


def test_device_timer_drops_the_oldest_batch_when_the_device_stops_completing():
    device = FakeDevice()
    timer = EventTimer(lambda: FakeEvent(device), max_pending=4)
    for batch in range(10):
        timer.record(batch)
        device.queued += 1
        timer.record(batch + 0.5)
        timer.close_batch(batch, batch + 0.5)
    assert (timer.pending, timer.dropped, timer.created) == (4, 6, 10)


def test_a_cpu_model_is_timed_on_the_host():
    model = Sleeps(0.002)
    assert cuda_events(model) is None and cuda_events(torch.nn.ReLU()) is None
    clock = ForwardClock()
    clock.attach(model)
    assert clock.timer is None
    start = time.perf_counter()
    model(torch.zeros(1, 4))
    clock.close_batch(start, time.perf_counter())
    [forward] = clock.ready()
    assert forward == clock.total_s and 0.0015 < forward < 2


def test_monitor_scores_device_time_read_after_the_batches_ran(no_device_sync):
    device = FakeDevice()
    metrics: list[dict] = []
    model = Queues(device, 0.006)
    monitor = StragglerMonitor(interval=4, warmup_steps=0)
    monitor._clock.new_event = lambda: FakeEvent(device)
    monitor.bind(SideChannel(None), metrics.append)
    monitor.on_fit_start(EventFacts(model=model))
    for step in range(16):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        model(torch.zeros(1, 4))
        device.queued += 0.01
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
        device.done = device.queued - 0.05  # the device runs ~3 batches behind the host
    monitor.handle(Event.FIT_END, EventFacts(step=16))
    forward = [m["rankguard/straggler_forward_s"] for m in metrics]
    assert forward and all(f == pytest.approx(0.006) for f in forward)
    monitor.close()


def test_monitor_without_a_model_says_so_at_info_and_stays_off(caplog):
    caplog.set_level(logging.INFO, logger="rankguard")
    monitor = StragglerMonitor(interval=1, warmup_steps=0)
    monitor.on_fit_start(EventFacts(model=None))
    for step in range(3):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    [record] = [r for r in caplog.records if r.name.startswith("rankguard")]
    assert record.levelno == logging.INFO and "monitor is off" in record.getMessage()
    monitor.close()
    monitor.close()


def test_monitor_whose_hooked_modules_never_run_turns_off_at_the_first_verdict(caplog):
    caplog.set_level(logging.INFO, logger="rankguard")
    metrics: list[dict] = []
    monitor = StragglerMonitor(interval=2, warmup_steps=0)
    monitor.bind(SideChannel(None), metrics.append)
    monitor.on_fit_start(EventFacts(model=torch.nn.Linear(2, 2)))
    for step in range(6):  # the loop never calls the model
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    infos = [r.getMessage() for r in caplog.records if r.name.startswith("rankguard")]
    assert len(infos) == 1 and "no forward pass of the hooked modules ran" in infos[0]
    assert metrics == [] and monitor._clock.modules == 0


def test_warm_up_filling_the_first_interval_does_not_turn_the_monitor_off(caplog):
    caplog.set_level(logging.INFO, logger="rankguard")
    metrics: list[dict] = []
    model = Sleeps(0.002)
    monitor = StragglerMonitor(interval=2, warmup_steps=3)
    monitor.bind(SideChannel(None), metrics.append)
    monitor.on_fit_start(EventFacts(model=model))
    for step in range(8):
        monitor.handle(Event.TRAIN_BATCH_START, EventFacts(step=step))
        model(torch.zeros(1, 4))
        monitor.handle(Event.TRAIN_BATCH_END, EventFacts(step=step))
    monitor.handle(Event.FIT_END, EventFacts(step=8))
    assert [r for r in caplog.records if r.name.startswith("rankguard")] == []
    # Posts at batches 2 and 4 hold only warm-up batches (1-3): not scored; those at 6 and
    # 8 (collected at fit end) hold batches 4-5 and 6-7.
    assert [round(m["rankguard/straggler_score"], 2) for m in metrics] == [1.0, 1.0]
    monitor.close()


def test_background_exchange_runs_in_order_and_hands_back_errors():
    channel = SideChannel(None)

    def decide(values):
        if values[0] == "bad":
            raise ValueError("bad payload")
        return values[0] * 2

    exchange = BackgroundExchange(channel, "t", decide)
    first, second = exchange.post(lambda: 21), exchange.post(lambda: "bad")
    assert first.result(5) == 42 and first.payload == 21
    with pytest.raises(ValueError, match="bad payload"):
        second.result(5)
    exchange.close()
    exchange.close()
    with pytest.raises(RuntimeError, match="closed"):
        exchange.post(lambda: 1).result(1)


# --- a real 2-rank DDP loop on gloo ---------------------------------------------------------------

# A forward 1.5x the median rank's scores 0.67; on two shared cores every forward also
# takes a little extra time of its own, which lifts that to ~0.7: threshold 0.8 leaves room.
SETTINGS = {"threshold": 0.8, "window": 3, "interval": 4, "warmup_steps": 2}
STEPS = 18  # posts at batches 4, 8, 12, 16; the third slow verdict arrives at batch 14
FORWARD_S = 0.02


def _loop(rank, guards, *, wrap=ddp, slow_forward=1.0, slow_data_s=0.0):
    """Rank 1 computes ``slow_forward`` times as long, or reads ``slow_data_s`` longer."""
    torch.set_num_threads(1)  # two ranks on two shared cores: spinning thread pools add noise
    slow = rank == 1
    model = wrap(FORWARD_S * (slow_forward if slow else 1.0))
    return train(guards, model, steps=STEPS, slow_data_s=slow_data_s if slow else 0.0)


def _sub_ms(rank, slow_s):
    """Issue 22's run: rank 0's forward ~0.1 ms, rank 1's ``slow_s`` more; 48 batches."""
    torch.set_num_threads(1)
    model = ddp(slow_s if rank == 1 else 0.0)
    return train([StragglerMonitor(interval=8, window=2)], model, steps=48)


def _scenarios(rank, world_size):
    stall = {"threshold": 0.5, "window": 3, "interval": 4}
    return {
        "sub_ms_slow": _sub_ms(rank, 0.02),
        "sub_ms_healthy": _sub_ms(rank, 0.0),
        "healthy": _loop(rank, [StragglerMonitor(**SETTINGS)]),
        "slow_compute": _loop(rank, [StragglerMonitor(**SETTINGS)], slow_forward=1.5),
        "slow_compute_raise": _loop(
            rank, [StragglerMonitor(on_violation="raise", **SETTINGS)], slow_forward=1.5
        ),
        "fsdp2_slow_compute": _loop(
            rank, [StragglerMonitor(**SETTINGS)], wrap=fsdp2, slow_forward=1.5
        ),
        "slow_data": _loop(
            rank,
            [DataStallMonitor(**stall), StragglerMonitor(**SETTINGS)],
            slow_data_s=3 * FORWARD_S,
        ),
    }


@pytest.fixture(scope="module")
def ddp_runs():
    outcomes = run_ranks(_scenarios, 2, timeout_s=120)
    for o in outcomes:
        assert o.exitcode == 0 and o.error is None, o.error
    return [o.value for o in outcomes]


def _straggler_warnings(run):
    return [(b, m) for b, m in run["records"] if m.startswith("rankguard straggler_monitor")]


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_healthy_ranks_log_scores_and_no_warning(ddp_runs):
    for run in (r["healthy"] for r in ddp_runs):
        assert run["outcome"] == "ok" and run["records"] == []
        scores = [m["rankguard/straggler_score_min"] for m in run["metrics"]]
        assert len(scores) == STEPS // SETTINGS["interval"] and min(scores) > 0.8


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_rank_1_with_1_5x_the_forward_is_named_on_every_rank_with_its_score(ddp_runs):
    messages = []
    for run in (r["slow_compute"] for r in ddp_runs):
        warnings = _straggler_warnings(run)
        assert len(warnings) == 1, (warnings, run["metrics"])
        [(batch, message)] = warnings
        # The third slow interval's verdict (batch 12), collected in the background 2 batches
        # after on an idle machine, later (by the fit's end at the latest) on a loaded one.
        assert 14 <= batch <= STEPS, batch
        assert message.startswith("rankguard straggler_monitor: Straggler: rank 1 (node ")
        score = float(re.search(r"\(score (\d\.\d\d) < threshold 0.8\)", message).group(1))
        assert 0.55 <= score <= 0.75  # 20 ms against 30 ms: 0.67
        assert {m["rankguard/straggler_rank"] for m in run["metrics"]} == {1.0}
        messages.append(message)
    assert len(set(messages)) == 1  # every rank logs the same verdict
    rank1 = ddp_runs[1]["slow_compute"]["metrics"]
    assert statistics.median(m["rankguard/straggler_score"] for m in rank1) < 0.75


def _forward_s(run):
    """This rank's median forward time over the intervals (each a median of 4 batches)."""
    key = "rankguard/straggler_forward_s"
    return statistics.median(m[key] for m in run["metrics"] if key in m)


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_forward_time_is_the_rank_s_own_compute(ddp_runs):
    fast, slow = (_forward_s(r["slow_compute"]) for r in ddp_runs)
    assert fast < 0.8 * slow  # rank 0 waits for rank 1 in backward, not forward
    # Rank 1 reads data 60 ms longer; rank 0 waits for it in DDP's buffer broadcast at
    # the start of forward, below which the clock's hooks sit.
    assert _forward_s(ddp_runs[0]["slow_data"]) < 1.5 * FORWARD_S


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_raise_stops_every_rank_at_the_same_batch(ddp_runs):
    outcomes = [r["slow_compute_raise"]["outcome"] for r in ddp_runs]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith("StragglerError at batch 14: Straggler: rank 1 (node ")


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_rank_slow_at_data_is_named_by_data_stall_monitor_alone(ddp_runs):
    for run in (r["slow_data"] for r in ddp_runs):
        assert run["outcome"] == "ok"
        messages = [m for _, m in run["records"]]
        assert messages and all("Data loading cannot keep up on rank 1" in m for m in messages)
        assert not any("Straggler" in m for m in messages)
        key = "rankguard/straggler_score_min"
        scores = [m[key] for m in run["metrics"] if key in m]
        assert scores and min(scores) > 0.8


@pytest.mark.slow
@pytest.mark.timing
def test_fsdp2_fast_rank_waiting_in_all_gathers_is_not_counted_as_its_compute(ddp_runs):
    runs = [r["fsdp2_slow_compute"] for r in ddp_runs]
    for run in runs:
        [(_, message)] = _straggler_warnings(run)
        assert message.startswith("rankguard straggler_monitor: Straggler: rank 1 (node ")
    fast, slow = (_forward_s(run) for run in runs)
    assert fast < 0.8 * slow  # 20 ms against 30 ms: 0.67
    # Timed around the whole model, rank 0 also waits for rank 1 at the 2nd and 3rd
    # block's all-gather: 6.7 + 2 x 10 ms against 30 ms, 0.89.
    assert runs[0]["root_s"] > 0.8 * runs[1]["root_s"]


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_rank_200x_slower_than_a_sub_millisecond_reference_is_named(ddp_runs):
    for run in (r["sub_ms_slow"] for r in ddp_runs):
        [(batch, message)] = _straggler_warnings(run)
        # 20 batches of warm-up, posts at 24 and 32: the second slow verdict collected at 36.
        assert batch == 36, message
        assert message.startswith("rankguard straggler_monitor: Straggler: rank 1 (node ")
        assert "slow at compute" in message
    assert _forward_s(ddp_runs[0]["sub_ms_slow"]) < 0.002  # the reference: under a millisecond
    assert _forward_s(ddp_runs[1]["sub_ms_slow"]) > 0.018


@pytest.mark.slow
@pytest.mark.timing
def test_ddp_sub_millisecond_ranks_within_noise_of_each_other_stay_silent(ddp_runs):
    for run in (r["sub_ms_healthy"] for r in ddp_runs):
        assert run["outcome"] == "ok" and run["records"] == []
        assert len(run["metrics"]) == 4  # scored at every verdict (posts at 24, 32, 40, 48)
        assert _forward_s(run) < 0.002
