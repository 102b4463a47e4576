"""The side channel: bounded exchanges that name the ranks that did not arrive."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch.distributed as dist

from rankguard.callbacks.core.errors import RanksMissingError
from rankguard.callbacks.core.side_channel import (
    PER_RANK_WAIT_S,
    STORE_TRIPS,
    SideChannel,
    default_store,
    in_transit_s,
    scaled_timeout,
)
from rankguard.callbacks.core.store_health import store_health
from tests.mp import run_ranks


def test_world_size_one_is_local_and_applies_decide():
    channel = SideChannel.from_environment(timeout_s=1)
    assert not channel.is_distributed
    assert channel.exchange("x", 5, lambda v: sorted(v.items())) == [(0, 5)]
    assert channel.all_gather("y", "a") == {0: "a"}
    channel.barrier("z")  # returns at once


def test_invalid_arguments_name_the_argument():
    with pytest.raises(ValueError, match="`timeout_s`"):
        SideChannel(None, timeout_s=0)
    with pytest.raises(ValueError, match="`rank`"):
        SideChannel(None, rank=3, world_size=2)


def _gather_and_decide(rank, world_size):
    channel = SideChannel.from_environment(timeout_s=10)
    gathered = channel.all_gather("counts", rank * 10)
    verdict = channel.exchange("max", rank, lambda v: max(v.values()))
    told = channel.broadcast("who", f"from {rank}")
    return gathered, verdict, told, channel.bytes_sent


def test_every_rank_gets_the_same_verdict():
    outcomes = run_ranks(_gather_and_decide, 3, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
        gathered, verdict, told, sent = o.value
        assert gathered == {0: 0, 1: 10, 2: 20}
        assert verdict == 2
        assert told == "from 0"
        assert sent > 0


def _one_rank_late(rank, world_size, late_rank, delay_s):
    channel = SideChannel.from_environment(timeout_s=2)
    if rank == late_rank:
        time.sleep(delay_s)
    return channel.all_gather("late", rank)


@pytest.mark.slow
@pytest.mark.parametrize("late_rank", [2, 0])
def test_timeout_names_the_missing_rank(late_rank):
    # Rank 0 late: only the others' outcomes are read (rank 0 is killed once they reported).
    readers = None if late_rank else [1, 2]
    outcomes = run_ranks(_one_rank_late, 3, late_rank, 12.0, timeout_s=60, until=readers)
    waiting = [o for o in outcomes if o.rank != late_rank]
    for o in waiting:
        assert o.error_type == "RanksMissingError", o.error
        assert o.error_attrs["missing"] == [late_rank]
        assert f"rank {late_rank} did not reach rankguard exchange 'late'" in o.error
        # Leader waits timeout_s; the others wait timeout_s + grace (5 s).
        assert o.elapsed_s < 2 + 5 + 4
    late = outcomes[late_rank]
    if late_rank != 0:
        # A late rank still learns the verdict: it is the one that was missing.
        assert late.error_type == "RanksMissingError"
        assert late.error_attrs["missing"] == [late_rank]


def _concurrent(rank, world_size):
    channel = SideChannel.from_environment(timeout_s=10)
    results = {}

    def background():
        results["bg"] = [channel.all_gather("bg", (rank, i)) for i in range(5)]

    thread = threading.Thread(target=background)
    thread.start()
    results["main"] = [channel.all_gather("main", rank + i) for i in range(5)]
    thread.join()
    return results


def test_background_and_main_thread_exchanges_do_not_interfere():
    for o in run_ranks(_concurrent, 2, timeout_s=60):
        assert o.error is None, o.error
        assert o.value["main"] == [{0: i, 1: 1 + i} for i in range(5)]
        assert o.value["bg"] == [{0: (0, i), 1: (1, i)} for i in range(5)]


def _keys_after(rank, world_size):
    store = default_store()
    before = store.num_keys()
    channel = SideChannel.from_environment(timeout_s=10)
    for i in range(3):
        channel.all_gather("cleanup", i)
    channel.barrier("settle")
    time.sleep(0.5)
    return before, store.num_keys()


def test_exchanges_leave_no_keys_behind():
    outcomes = run_ranks(_keys_after, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
    # The last verdict of each name stays (the next exchange of that name deletes it).
    before, after = outcomes[0].value
    assert after - before <= 2


def _default_store_is_reachable(rank, world_size):
    store = default_store()
    store.set(f"probe{rank}", b"x")
    return dist.is_initialized() and store.check([f"probe{rank}"])


def test_default_store_private_api_still_exists():
    # The one private torch.distributed name rankguard uses: fails if torch drops it.
    outcomes = run_ranks(_default_store_is_reachable, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
    assert [o.value for o in outcomes] == [True, True]


def _tcp_client(port):
    """A rank's client of the test's TCPStore server."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _on_tcp_store(worker):
    """Runs ``worker(rank, world_size, port)`` on 2 ranks over a TCPStore; their values."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    outcomes = run_ranks(worker, 2, server.port, timeout_s=90)
    for o in outcomes:
        assert o.error is None, o.error
    return [o.value for o in outcomes]


def _tcp_threads(rank, world_size, port):
    """Rank 1's background thread waits in an exchange that ends only after the main
    threads' 5 quick ones: with one socket shared by both threads, the quick ones could
    not go until that wait ended, and they would time out instead."""
    channel = SideChannel(_tcp_client(port), rank=rank, world_size=world_size, timeout_s=20)
    quick_done = threading.Event()

    def background():
        if rank == 0:
            quick_done.wait(60)  # the exchange 'slow' begins once the quick ones are done
        channel.all_gather("slow", rank)

    channel.barrier("ready")  # both ranks' main threads connected, and here together
    thread = threading.Thread(target=background)
    thread.start()
    if rank == 1:  # its background thread has sent its payload and waits for the verdict
        probe = _tcp_client(port)
        probe.wait([f"{channel.prefix}/slow/0/r1"])
        time.sleep(0.2)
    quick = [channel.all_gather("quick", i, timeout_s=10) for i in range(5)]
    quick_done.set()
    thread.join()
    return quick


@pytest.mark.slow
def test_a_blocked_thread_does_not_stall_another_threads_tcp_store_exchanges():
    # One TCPStore client is one socket: a waiting background thread (the watchdog)
    # must not hold up the main thread's checks. No bound on time: the background
    # wait ends only after the checks, so a stalled check fails with the ranks missing.
    for quick in _on_tcp_store(_tcp_threads):
        assert quick == [{0: i, 1: i} for i in range(5)]


class CountingStore:
    """A store that counts the requests this rank makes (wraps the job's real store)."""

    def __init__(self, store) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def _requests_per_exchange(rank, world_size):
    store = CountingStore(default_store())
    channel = SideChannel(store, rank=rank, world_size=world_size, timeout_s=20)
    for i in range(3):
        channel.all_gather("count", (rank, i))
    return store.requests / 3, channel.exchanges


def test_store_requests_per_exchange_do_not_grow_with_the_world_size():
    # On a shared store, every other rank: set its payload, wait for and get the
    # verdict, delete its payload. Rank 0 keeps its own payload: it waits for and reads
    # every other payload (a request each), sets the verdict and, from the second
    # exchange, deletes the verdict before.
    for world in (2, 4):
        outcomes = run_ranks(_requests_per_exchange, world, timeout_s=90)
        for o in outcomes:
            assert o.error is None, o.error
        (leader, exchanges), *others = [o.value for o in outcomes]
        assert exchanges == 3
        assert leader == pytest.approx((3 + 4 + 4) / 3), world
        assert all(requests == 4 for requests, _ in others), (world, others)


def _tcp_exchanges(rank, world_size, port):
    store = _tcp_client(port)
    channel = SideChannel(store, rank=rank, world_size=world_size, timeout_s=1)
    channel.barrier("start", timeout_s=30)  # the ranks meet: their set-up is not what it times
    before = store.num_keys()
    gathered = [channel.all_gather("cleanup", (rank, i)) for i in range(3)]
    channel.barrier("settle")
    missing = None
    if rank == 0:  # rank 1 never comes to this one
        try:
            channel.all_gather("late", rank)
        except RanksMissingError as exc:
            missing = exc.missing
        store.set("late_named", b"1")
    else:  # rank 1 goes on once rank 0 named it: "after" then times both ranks alike
        store.wait(["late_named"])
        store.delete_key("late_named")
    channel.barrier("after")
    time.sleep(0.5)
    return gathered, missing, store.num_keys() - before


@pytest.mark.slow
def test_tcp_store_exchanges_name_a_missing_rank_and_leave_one_verdict_per_name():
    # Each thread's own TCPStore client waits for the keys and reads them in one
    # request, timing out like a wait: the missing rank is named.
    (gathered, missing, added), (_, none, _) = _on_tcp_store(_tcp_exchanges)
    assert gathered == [{0: (0, i), 1: (1, i)} for i in range(3)]
    assert (missing, none) == ([1], None)
    # Left: the last verdict of "cleanup", "settle", "after" and "late" (3 when rank 1's
    # "start" payload was still there when rank 0 counted the keys before).
    assert 3 <= added <= 4


def test_timeouts_grow_with_the_world_size():
    assert scaled_timeout(300.0, 2) == pytest.approx(300.0 + 2 * PER_RANK_WAIT_S)
    assert scaled_timeout(300.0, 4096) - scaled_timeout(300.0, 8) == pytest.approx(
        4088 * PER_RANK_WAIT_S
    )
    # Errors show the timeout the user set, and the allowance once it is worth saying.
    big = SideChannel(None, rank=0, world_size=4096)._missing_error("x", [7], 300.0)
    assert "within 300 s + 20 s for 4096 ranks" in str(big) and big.timeout_s == 300.0
    small = SideChannel(None, rank=0, world_size=2)._missing_error("x", [1], 0.5)
    assert "within 0.5 s (world size 2)" in str(small) and small.timeout_s == 0.5


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "gather_object",
    "reduce",
    "scatter",
    "monitored_barrier",
)


def _every_guard_without_collectives(rank, world_size, folder):
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from rankguard.callbacks import Event, EventFacts, LoaderFacts
    from rankguard.callbacks.core.guard import GuardRunner
    from rankguard.callbacks.registry import build_guards
    from tests.e2e.common import Points, WarningCollector

    def forbidden(*args, **kwargs):
        raise AssertionError("rankguard issued a collective on the training process group")

    for name in COLLECTIVES:
        setattr(dist, name, forbidden)
    data = Points(32)
    loader = DataLoader(data, 4, sampler=DistributedSampler(data, world_size, rank))
    model = torch.nn.Linear(4, 2)
    runner = GuardRunner(
        build_guards(
            {
                "hang_watchdog": {"exchange_period_s": 0.2, "report_dir": folder},
                "straggler_monitor": {"interval": 2, "warmup_steps": 0},
            }
        )
    )
    facts = EventFacts(
        loaders=[LoaderFacts("train", loader, True), LoaderFacts("eval", loader, False)],
        model=model,
        optimizer=torch.optim.Adam(model.parameters()),
        directories=[f"{folder}/ckpt"],
    )
    warnings = WarningCollector()
    logging.getLogger("rankguard").addHandler(warnings)
    runner.fire(Event.FIT_START, facts)
    for step in range(4):  # the straggler monitor's exchanges, on its background thread
        runner.fire(Event.TRAIN_BATCH_START, EventFacts(step=step))
        model(torch.zeros(1, 4))
        runner.fire(Event.TRAIN_BATCH_END, EventFacts(step=step))
    runner.fire(Event.FIT_END, EventFacts(step=4))  # collects the last one
    eval_facts = EventFacts(loader=facts.loaders[1], step=1)
    runner.fire(Event.EVAL_START, eval_facts)
    for _ in range(len(loader)):
        runner.fire(Event.EVAL_BATCH_START, eval_facts)
        runner.fire(Event.EVAL_BATCH_END, eval_facts)
    runner.fire(Event.EVAL_END, eval_facts)
    runner.fire(
        Event.CHECKPOINT_SAVE_START, EventFacts(step=1, model=model, directories=facts.directories)
    )
    time.sleep(1.0)  # the watchdog thread exchanges statuses meanwhile
    exchanges = runner.channel.exchanges
    runner.close()
    return exchanges, warnings.messages


@pytest.mark.slow
def test_no_guard_ever_uses_the_training_process_group(tmp_path):
    # Every collective of torch.distributed raises in these ranks: the guards'
    # checks and the watchdog's background exchanges all go through the store.
    outcomes = run_ranks(_every_guard_without_collectives, 2, str(tmp_path), timeout_s=90)
    for o in outcomes:
        assert o.error is None, o.error
        exchanges, warnings = o.value
        assert exchanges >= 10  # fit start, 2 straggler, eval start/end, save, watchdog statuses
        assert warnings == []  # an exchange that failed on its thread is logged when collected


def test_each_torchrun_restart_attempt_has_its_own_keys(monkeypatch):
    # torchrun can keep its store across restarts; stale keys of attempt 0 must not be read.
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    plain = SideChannel.from_environment(name="keys")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = SideChannel.from_environment(name="keys")
    assert restarted.prefix.startswith("keys/attempt1/")
    assert not plain.prefix.startswith("keys/attempt")


class _AnswersLate:
    """A store whose answer to a wait comes back after the client gave up.

    Every key the wait asked for reached the store within its timeout, but the answer
    is late (as on a congested store host): the wait raises as a timeout does. Each
    timeout it was given is recorded.
    """

    def __init__(self, store) -> None:
        self.store, self.timeouts = store, []

    def wait(self, keys, timeout):
        self.timeouts.append(timeout.total_seconds())
        self.store.wait(keys, timeout)
        raise RuntimeError("Wait timeout")  # what a TCPStore client raises

    def __getattr__(self, name):
        return getattr(self.store, name)


class _RecordsTimeouts(_AnswersLate):
    """A healthy store whose waits record the timeout each was given."""

    def wait(self, keys, timeout):
        self.timeouts.append(timeout.total_seconds())
        self.store.wait(keys, timeout)


def _exchange_on_threads(store, leader_store, name="late answer"):
    """Rank 0 (on ``leader_store``) and rank 1 (on ``store``) exchange once; rank 0's result."""
    follower = SideChannel(store, rank=1, world_size=2, timeout_s=5.0)
    thread = threading.Thread(target=follower.all_gather, args=(name, 1), daemon=True)
    thread.start()
    leader = SideChannel(leader_store, rank=0, world_size=2, timeout_s=5.0)
    try:
        return leader.all_gather(name, 0)
    finally:
        thread.join(30)


def test_a_payload_in_the_store_whose_answer_came_late_is_decided_not_missing():
    # The store's round trip is the store's: the deciding rank checks each payload it
    # timed out on, and one that is there by then arrived.
    store = dist.HashStore()
    late = _AnswersLate(store)
    assert _exchange_on_threads(store, late) == {0: 0, 1: 1}
    assert late.timeouts  # the leader's wait did time out


@pytest.fixture
def store_round_trip():
    """Sets this process's last measured store round trip; measured as healthy after."""

    def measured(seconds: float) -> None:
        store_health.end(time.monotonic() - seconds)

    yield measured
    store_health.end(time.monotonic())


def test_an_exchange_waits_longer_by_the_stores_round_trips_at_most_double(store_round_trip):
    store = dist.HashStore()
    counted = _RecordsTimeouts(store)
    store_round_trip(0.0)
    _exchange_on_threads(store, counted, "healthy")
    store_round_trip(0.4)  # a congested store: three round trips more
    _exchange_on_threads(store, counted, "slow")
    store_round_trip(4.0)  # a store that hardly answers: the timeout is at most doubled
    _exchange_on_threads(store, counted, "stalled")
    healthy, slow, stalled = (t - scaled_timeout(5.0, 2) for t in counted.timeouts)
    assert healthy == pytest.approx(0.0, abs=0.01)
    assert slow == pytest.approx(STORE_TRIPS * 0.4, abs=0.05)
    assert stalled == pytest.approx(5.0, abs=0.01)
    store_round_trip(0.001)  # the store answers at once again: so does the wait
    assert in_transit_s(5.0) == pytest.approx(STORE_TRIPS * 0.001, abs=0.01)


@pytest.mark.slow
def test_an_exchange_with_something_to_do_meanwhile_does_it_between_slices_of_its_wait():
    # The watchdog reads the fault board while its exchange waits for a late peer: the
    # wait goes in slices, each request between them (and after) keeps the wait's timeout.
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    follower = SideChannel(client, rank=1, world_size=2, timeout_s=5.0)
    leader = SideChannel(client, rank=0, world_size=2, timeout_s=5.0)
    timeouts: list[float] = []

    def meanwhile():
        timeouts.append(leader.store.timeout.total_seconds())

    def late_follower():
        time.sleep(1.2)
        follower.all_gather("sliced", 1)

    thread = threading.Thread(target=late_follower, daemon=True)
    thread.start()
    try:
        assert leader.exchange("sliced", 0, dict, meanwhile=meanwhile, every_s=0.3) == {0: 0, 1: 1}
    finally:
        thread.join(30)
    # Called at 0.3, 0.6 and 0.9 s (1.2 s on a loaded machine): never after the answer.
    assert 3 <= len(timeouts) <= 4, timeouts
    total = scaled_timeout(5.0, 2)
    assert all(total - 0.1 < t < total + 0.1 for t in timeouts), timeouts
    assert total - 0.1 < leader.store.timeout.total_seconds() < total + 0.1

    def leave():
        raise KeyboardInterrupt  # what the watchdog raises to leave: this rank raised

    with pytest.raises(KeyboardInterrupt):  # nobody answers: it leaves at the first slice
        leader.exchange("left", 0, dict, meanwhile=leave, every_s=0.3)
