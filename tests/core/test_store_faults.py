"""Faults of the store itself: a slow store and a dropped connection on a healthy job.

Two gloo ranks train a real loop under ``rankguard.integrations.torch.RankGuard``
while their store connections go through :class:`tests.store_proxy.StoreProxy`: the
store's server lives in the test's process (as torchrun's agent hosts it), and the
ranks' process group and rankguard's side channel both reach it through the proxy.
Gloo uses the store only to connect its ranks, before the faults start, so the faults
reach rankguard's exchanges alone. rankguard must degrade (report later, or skip an
exchange) and never stall a training step, raise, or name a healthy rank.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.mp import run_ranks
from tests.store_proxy import StoreProxy

WORLD = 2
#: Train steps of one epoch, each a forward, a backward (DDP's all-reduce) and a sleep of
#: :data:`STEP_S`: about 18 s in all.
STEPS = 600
STEP_S = 0.02
#: The watchdog exchanges its status every 0.5 s, so that the faults meet many of its
#: exchanges; every other guard runs at its defaults (the monitors and the replica check
#: every 50 batches, or 5 s at these fast steps).
SETTINGS = {"hang_watchdog": {"exchange_period_s": 0.5}}
#: The slow store's latency, each way: a request and its answer take twice it, and one
#: exchange three such round trips or more.
LATENCY_S = 0.5


#: What a line that names a rank as not answering says (docs/hang.md).
ACCUSES = re.compile(r"\b(frozen|dead|stuck|gone|missing|did not reach)\b")


class _Lines(logging.Handler):
    """Records (seconds since the fit started, level, message) of rankguard's log lines."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.start = time.monotonic()
        self.lines: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic() - self.start, record.levelname, record.getMessage()))


def _through_proxy(ports: list[int], rank: int, world_size: int, init_file: str) -> None:
    """Joins the gloo process group through this rank's port of the proxy."""
    import torch.distributed as dist

    del init_file
    store = dist.TCPStore("127.0.0.1", ports[rank], is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _train(rank: int, world_size: int, out: str) -> dict:
    """A healthy loop; each step's wall time and rankguard's log lines (INFO and above)."""
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from rankguard.integrations.torch import RankGuard

    lines = _Lines()
    log = logging.getLogger("rankguard")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(
        torch.randn(STEPS * 4 * WORLD, 8), torch.randint(0, 2, (STEPS * 4 * WORLD,))
    )
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0))
    steps: list[float] = []
    guard = RankGuard(**SETTINGS)
    with guard.fit(model, optimizer, loader) as run:
        Path(out, f"started{rank}").touch()
        lines.start = last = time.monotonic()
        for x, y in run.train(loader):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(STEP_S)
            now = time.monotonic()
            steps.append(now - last)  # rankguard's part of the step (in ``run.train``) included
            last = now
    return {
        "steps": steps,
        "lines": lines.lines,
    }


def _fit_with(fault, tmp_path: Path):
    """Runs :func:`_train` on :data:`WORLD` ranks; ``fault(proxy)`` runs once both started."""
    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    with StoreProxy(server.port, WORLD) as proxy:

        def inject() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if all((tmp_path / f"started{r}").exists() for r in range(WORLD)):
                    fault(proxy)
                    return
                time.sleep(0.05)

        injector = threading.Thread(target=inject, daemon=True)
        injector.start()
        setup = functools.partial(_through_proxy, proxy.ports)
        # 600 steps take 40-55 s on 4 busy workers: the hard limit holds at twice that load.
        outcomes = run_ranks(_train, WORLD, str(tmp_path), timeout_s=180, setup=setup)
        injector.join(5)
    return outcomes


def _rankguard_lines(outcome, levels=("INFO", "WARNING", "ERROR", "CRITICAL")) -> list[str]:
    return [f"{level} {text}" for _, level, text in outcome.value["lines"] if level in levels]


def _assert_healthy(outcomes) -> None:
    """Every rank finished its fit, trained every step, named nobody and raised nothing."""
    for o in outcomes:
        assert (o.exitcode, o.error) == (0, None), o
        assert len(o.value["steps"]) == STEPS
        lines = _rankguard_lines(o)
        assert not [line for line in lines if line.startswith(("ERROR", "CRITICAL"))], lines
        verdicts = [line for line in lines if ACCUSES.search(line)]
        assert not verdicts, verdicts


def _slow(proxy: StoreProxy) -> None:
    """The store's host is congested for 12 s: every request and answer takes 0.5 s more.

    12 s hold two of the monitors' exchanges (every 5 s at these steps) and their collects,
    on every rank, however the machine's load shifts the fit's clock.
    """
    time.sleep(1.0)
    proxy.latency_s = LATENCY_S
    time.sleep(12.0)
    proxy.latency_s = 0.0


# `timing`: it bounds measured step times, which another worker's load stretches (run alone,
# in today's world; the store's client is the same code in both, and the other tests here run
# its slow and dropped requests in both worlds).
@pytest.mark.timing
def test_a_slow_store_delays_rankguard_not_the_training_steps(tmp_path):
    outcomes = _fit_with(_slow, tmp_path)
    _assert_healthy(outcomes)
    for o in outcomes:
        # A step that waited for one exchange would take 3 round trips (3 s) or more.
        assert max(o.value["steps"]) < 2 * LATENCY_S, sorted(o.value["steps"])[-5:]
        said = [line for line in _rankguard_lines(o) if "the store answers slowly" in line]
        # The monitors' verdicts come late; each says so once, at INFO.
        assert said, _rankguard_lines(o)
        assert all(line.startswith("INFO ") for line in said), said
        assert len(said) == len(set(said)), said
        assert not [line for line in _rankguard_lines(o) if line.startswith("WARNING")], said


def _drop(proxy: StoreProxy) -> None:
    """Rank 1's connections of rankguard's threads drop, twice (its process group's stays)."""
    for _ in range(2):
        time.sleep(3.0)
        assert proxy.drop(rank=1, first=1) > 0


@pytest.mark.slow
def test_a_dropped_store_connection_is_opened_again_in_one_line(tmp_path):
    outcomes = _fit_with(_drop, tmp_path)
    _assert_healthy(outcomes)
    assert max(max(o.value["steps"]) for o in outcomes) < 2 * LATENCY_S
    dropped = [line for line in _rankguard_lines(outcomes[1]) if "store dropped" in line]
    assert dropped, _rankguard_lines(outcomes[1])
    # One line, however many connections drop how often: the first at WARNING, then DEBUG.
    assert len(dropped) == 1, dropped
    assert dropped[0].startswith("WARNING rankguard: this rank's connection to the store dropped (")
    assert dropped[0].endswith("); connected again")
    assert not [line for line in _rankguard_lines(outcomes[0]) if "store dropped" in line]


def test_a_thread_client_connects_again_and_resends_the_set_the_drop_lost(caplog, monkeypatch):
    from torch.distributed import TCPStore

    from rankguard.callbacks.core import side_channel
    from rankguard.callbacks.core.side_channel import SideChannel

    monkeypatch.setattr(side_channel, "_reconnects", 0)
    caplog.set_level(logging.DEBUG, logger="rankguard")
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    with StoreProxy(server.port, 1) as proxy:
        root = TCPStore("127.0.0.1", proxy.ports[0], is_master=False, wait_for_workers=False)
        channel = SideChannel(root, rank=1, world_size=2, timeout_s=5)
        channel.store.set("before", b"1")
        assert proxy.drop(first=1) == 1  # the thread's own connection, not the root's
        time.sleep(0.2)
        channel.store.set("lost", b"2")  # no answer: sent into the dropped connection
        assert channel.store.get("lost") == b"2"  # its error, then sent again
        assert server.get("lost") == b"2" and server.get("before") == b"1"
    said = [r for r in caplog.records if "store dropped" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"]
    assert said[0].getMessage().endswith("); connected again")


@pytest.mark.slow
def test_a_verdict_is_waited_for_while_the_store_answers_at_once_and_briefly_once_slow(caplog):
    from torch.distributed import TCPStore

    from rankguard.callbacks.core.background_exchange import Pending
    from rankguard.callbacks.core.guard import LATE_AFTER_S, Guard
    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.core.store_health import SLOW_REQUEST_S, store_health

    caplog.set_level(logging.INFO, logger="rankguard")
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    store_health.restart()  # a fit starts
    guard = Guard()
    with StoreProxy(server.port, 1) as proxy:
        root = TCPStore("127.0.0.1", proxy.ports[0], is_master=False, wait_for_workers=False)
        channel = SideChannel(root, rank=1, world_size=2, timeout_s=5)
        channel.store.add("polls", 1)  # answered at once: the store is healthy
        # A healthy store: a verdict the ranks are slow to send (a loaded machine) is waited
        # for, here 4 times longer than a slow store would be, so every rank acts at it.
        soon = Pending()
        started = time.monotonic()  # before the timer starts: it cannot end sooner than this
        threading.Timer(8 * LATE_AFTER_S, soon._finish, args=("verdict",)).start()
        assert not guard.verdict_late(soon, 60)
        assert time.monotonic() - started >= 8 * LATE_AFTER_S
        # The store turns slow: another thread's poll (its own client, as the watchdog's)
        # waits 2 x 0.4 s for its answer.
        connected, slow = threading.Event(), threading.Event()

        def polls() -> None:
            channel.store.add("polls", 1)  # connected while the store answers at once
            connected.set()
            slow.wait()
            channel.store.add("polls", 1)

        poll = threading.Thread(target=polls)
        poll.start()
        assert connected.wait(10)
        proxy.latency_s = 0.4
        slow.set()
        late = Pending()
        started = time.monotonic()
        assert guard.verdict_late(late, 61) and guard.verdict_late(late, 62)
        # Each batch waited its short bound once the poll was slow, not the verdict.
        assert 2 * LATE_AFTER_S <= time.monotonic() - started < 2 * LATE_AFTER_S + 0.8
        # Another guard whose part went in the same exchange does not wait for it again at
        # batch 62 (two guards due at one batch: the batch waits once, not twice); it says
        # so once, as the first did.
        started = time.monotonic()
        assert Guard().verdict_late(late, 62)
        assert time.monotonic() - started < LATE_AFTER_S / 2
        # Nor does a guard whose verdict comes from another exchange due at batch 62: the
        # batch's wait is spent.
        other = Pending()
        started = time.monotonic()
        assert Guard().verdict_late(other, 62)
        assert time.monotonic() - started < LATE_AFTER_S / 2
        poll.join()
        late._finish("verdict")
        assert not guard.verdict_late(late, 63) and not guard.verdict_late(None, 63)
        proxy.latency_s = 0.0
        channel.store.add("polls", 1)  # answered at once again: this fit still waits briefly
        assert store_health.slow_seen and not store_health.slow()
        # The verdict of an exchange thread's first exchange (its thread starting and
        # connecting, at a fit's start) is waited for long whatever the store did.
        first = Pending(first=True)
        threading.Timer(4 * LATE_AFTER_S, first._finish, args=("verdict",)).start()
        assert not guard.verdict_late(first, 64)
        store_health.restart()  # the next fit waits long again
        again = Pending()
        threading.Timer(2 * SLOW_REQUEST_S, again._finish, args=("verdict",)).start()
        assert not guard.verdict_late(again, 64)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [(level, text[:112]) for level, text in said[:2]] == [
        (
            "INFO",
            f"rankguard guard: the verdict of its exchange was not in at train batch {batch} "
            "after 0.5 s (the store answers slowly)",
        )
        for batch in (61, 62)
    ]
    assert len(said) == 3 and said[2][0] == "INFO", said  # the third guard's, once
    assert said[2][1].startswith(
        "rankguard guard: the verdict of its exchange was not in at train batch 62 after 0.5 s "
    ), said


def test_a_late_verdict_is_said_after_the_bound_its_batch_waited_not_the_clock(monkeypatch, caplog):
    # A loaded machine: the wait's polls end past the bound (0.35 s apart, the second at 0.7
    # s). CI read "after 0.6 s" once where the bound is 0.5 s, and a recording would go stale.
    from rankguard.callbacks.core import guard as guard_module
    from rankguard.callbacks.core.background_exchange import Pending
    from rankguard.callbacks.core.guard import Guard
    from rankguard.callbacks.core.store_health import store_health

    caplog.set_level(logging.INFO, logger="rankguard")
    monkeypatch.setattr(guard_module, "LATE_POLL_S", 0.35)
    store_health.restart()  # a fit starts; its store was slow once
    monkeypatch.setattr(store_health, "slow_seen", True)
    started = time.monotonic()
    assert Guard().verdict_late(Pending(), 7)
    assert time.monotonic() - started >= 0.7
    store_health.restart()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        "rankguard guard: the verdict of its exchange was not in at train batch 7 after 0.5 s "
        "(the store answers slowly)"
    ), said


def test_an_exchange_skewed_by_a_late_verdict_is_skipped_at_info_any_other_failure_warns(caplog):
    from rankguard.callbacks.core.background_exchange import ExchangeSkewed
    from rankguard.callbacks.core.guard import Guard

    caplog.set_level(logging.INFO, logger="rankguard")
    Guard().skip_failed("a straggler exchange", ExchangeSkewed("posted at batches 50 and 100"))
    Guard().skip_failed("a straggler exchange", RuntimeError("rank 1 could not build it"))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "INFO",
            "rankguard guard: a straggler exchange failed (posted at batches 50 and 100); "
            "skipping it",
        ),
        (
            "WARNING",
            "rankguard guard: a straggler exchange failed (rank 1 could not build it); skipping it",
        ),
    ]


def test_a_thread_opening_a_client_to_a_store_whose_host_ended_is_told_at_once():
    """Rank 0 hosted the store and died (Composer's, Lightning's launcher): no minute's wait."""
    from torch.distributed import TCPStore

    from rankguard.callbacks.core.side_channel import SideChannel, StoreGoneError

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    root = TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    channel = SideChannel(root, rank=1, world_size=2, timeout_s=30)
    channel.store.set("healthy", b"1")  # a listening store: the look is silent
    assert server.get("healthy") == b"1"
    port = server.port
    del server  # its process ended
    errors: list[BaseException] = []

    def publish() -> None:  # a thread of its own: a client of its own
        try:
            channel.store.set("fault", b"rank 1 raised")
        except BaseException as exc:
            errors.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=publish)
    thread.start()
    thread.join(70)
    assert time.monotonic() - started < 5.0  # a TCPStore client retries a refusal for 60 s
    assert [type(e) for e in errors] == [StoreGoneError], errors
    assert str(errors[0]) == (
        f"the store at 127.0.0.1:{port} refuses connections: the process that hosted it has ended"
    )
