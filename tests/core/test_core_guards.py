"""Core guards without a framework: decisions, messages, validation, registry."""

from __future__ import annotations

import sys
import threading

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.callbacks import (
    GUARDS,
    BatchCountMismatchError,
    BatchParityGuard,
    DropLastGuard,
    DropLastMismatchError,
    Event,
    EventFacts,
    LoaderFacts,
    SideChannel,
    build_guards,
)
from rankguard.callbacks.batches.batch_parity_guard import (
    EvalRun,
    count_mismatches,
    eval_run_mismatch,
)
from rankguard.callbacks.batches.drop_last_guard import settings_mismatches
from rankguard.callbacks.core.ranks import format_groups, format_ranks
from rankguard.callbacks.core.step_log import StepLog
from rankguard.callbacks.data.loaders import (
    enforce_drop_last,
    loader_settings,
    promised_batches,
    sample_accounting,
)
from tests.e2e.common import Points, Stream
from tests.mp import run_ranks


def test_rank_ranges_stay_compact_at_1024_ranks():
    counts = {r: 2 if r < 512 else 3 for r in range(1024)}
    assert format_groups(counts, lambda n: f"{n} batches") == (
        "ranks 0-511: 2 batches; ranks 512-1023: 3 batches"
    )
    assert format_ranks([5, 0, 1, 2, 9, 7, 8]) == "0-2,5,7-9"
    assert format_ranks([3, 4]) == "3,4"
    assert format_groups({0: 1}) == "rank 0: 1"


def test_count_mismatches_groups_ranks_and_ignores_equal_loaders():
    per_rank = {0: {"eval": 2, "train": 5}, 1: {"eval": 4, "train": 5}, 2: {"eval": 2, "train": 5}}
    assert count_mismatches(per_rank) == {"eval": "ranks 0,2: 2 batches; rank 1: 4 batches"}
    assert count_mismatches({0: {"s": None}, 1: {"s": None}}) == {}
    assert "unknown count" in count_mismatches({0: {"s": None}, 1: {"s": 3}})["s"]
    assert (
        count_mismatches({0: {"v": 2}, 1: {}})["v"] == "rank 0: 2 batches; rank 1: no such loader"
    )


def test_eval_run_mismatch_flags_uneven_runs_and_broken_len_promises():
    assert eval_run_mismatch({0: EvalRun(4, 4), 1: EvalRun(4, 4)}) == ""
    assert eval_run_mismatch({0: EvalRun(3, None), 1: EvalRun(3, None)}) == ""
    assert eval_run_mismatch({0: EvalRun(2, None), 1: EvalRun(4, None)}) == (
        "rank 0: ran 2 batches; rank 1: ran 4 batches"
    )
    assert eval_run_mismatch({0: EvalRun(2, 4), 1: EvalRun(2, 4)}) == (
        "ranks 0,1: ran 2 of 4 batches its __len__ promised"
    )


def test_loader_facts_read_without_iterating():
    data = Points(10)
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 4, 0))
    settings = loader_settings(loader)
    assert (settings.batch_size, settings.drop_last, settings.dist_num_replicas) == (4, False, 4)
    acc = sample_accounting(loader)
    assert (acc.samples, acc.padded, acc.last_batch) == (3, 2, 3)
    assert promised_batches(LoaderFacts("x", loader, False, num_batches=None)) == 1
    assert promised_batches(LoaderFacts("x", DataLoader(Stream(8)), False, 5)) is None


def test_enforce_drop_last_gives_full_batches_only():
    data = Points(18)
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1))
    assert len(loader) == 3  # 9 samples: 2 full batches and a partial one
    assert enforce_drop_last(loader)
    assert len(loader) == 2
    assert [len(b[0]) for b in loader] == [4, 4]
    assert not enforce_drop_last(DataLoader(Stream(4)))


def test_settings_mismatches_name_each_differing_setting():
    a = loader_settings(DataLoader(Points(8), batch_size=4, drop_last=True))
    b = loader_settings(DataLoader(Points(8), batch_size=2, drop_last=False))
    desc = settings_mismatches({0: {"train": a}, 1: {"train": b}})["train"]
    assert "batch_size: rank 0: 4, rank 1: 2" in desc
    assert "drop_last: rank 0: True, rank 1: False" in desc
    assert "<no such loader>" in settings_mismatches({0: {"train": a}, 1: {}})["train"]


@pytest.mark.parametrize(
    ("cls", "kwargs", "argument"),
    [
        (BatchParityGuard, {"on_violation": "ignore"}, "on_violation"),
        (BatchParityGuard, {"eval_end_timeout_s": 0}, "eval_end_timeout_s"),
        (DropLastGuard, {"mode": "fix"}, "mode"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_argument(cls, kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        cls(**kwargs)


def test_registry_builds_all_guards_and_rejects_unknown_names():
    assert [g.name for g in build_guards({})] == list(GUARDS)
    without = [g.name for g in build_guards({"drop_last_guard": False})]
    assert without == [name for name in GUARDS if name != "drop_last_guard"]
    with pytest.raises(ValueError, match="Did you mean 'batch_parity_guard'"):
        build_guards({"batch_parity": {}})
    with pytest.raises(ValueError, match="Did you mean 'eval_end_timeout_s'"):
        build_guards({"batch_parity_guard": {"eval_timeout_s": 3}})


def test_warn_mode_logs_instead_of_raising(caplog):
    guard = BatchParityGuard(on_violation="warn")
    guard.violation(BatchCountMismatchError("ranks differ"))
    assert "ranks differ" in caplog.text


def _uneven_eval_on_rank(rank, world_size, on_violation):
    guard = BatchParityGuard(on_violation=on_violation)
    guard.bind(SideChannel.from_environment(timeout_s=20))
    loader = DataLoader(Points(8 if rank == 1 else 16), batch_size=4)
    guard.handle(Event.EVAL_START, EventFacts(loader=LoaderFacts("val", loader, False)))
    return "passed"


def test_uneven_eval_counts_are_raised_on_every_rank_with_grouped_counts():
    outcomes = run_ranks(_uneven_eval_on_rank, 3, "raise", timeout_s=60)
    for o in outcomes:
        assert o.error_type == "BatchCountMismatchError"
        assert "loader 'val': ranks 0,2: 4 batches; rank 1: 2 batches" in o.error


def _rank_never_finishes_eval(rank, world_size):
    import time

    guard = BatchParityGuard(eval_end_timeout_s=2)
    guard.bind(SideChannel.from_environment(timeout_s=20))
    facts = EventFacts(loader=LoaderFacts("val", DataLoader(Points(8), batch_size=4), False))
    guard.handle(Event.EVAL_START, facts)
    if rank == 1:
        time.sleep(60)  # stuck in eval (killed once rank 0 reported)
    guard.handle(Event.EVAL_END, facts)


@pytest.mark.slow
def test_after_eval_check_names_the_rank_stuck_in_eval_instead_of_hanging():
    outcomes = run_ranks(_rank_never_finishes_eval, 2, timeout_s=60, until=[0])
    assert outcomes[0].error_type == "BatchCountMismatchError"
    assert "rank 1 did not finish eval loader 'val' within 2 s" in outcomes[0].error
    assert outcomes[0].elapsed_s < 10


def _drop_last_differs(rank, world_size):
    guard = DropLastGuard()
    guard.bind(SideChannel.from_environment(timeout_s=20))
    data = Points(20)
    loader = DataLoader(
        data, batch_size=4, sampler=DistributedSampler(data, world_size, rank), drop_last=rank == 0
    )
    guard.handle(Event.FIT_START, EventFacts(loaders=[LoaderFacts("train", loader, True)]))


def test_drop_last_mismatch_names_the_setting_and_ranks():
    for o in run_ranks(_drop_last_differs, 2, timeout_s=60):
        assert o.error_type == DropLastMismatchError.__name__
        assert "drop_last: rank 0: True, rank 1: False" in o.error


def _rank_missing_at_eval_start(rank, world_size):
    import logging
    import time

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("rankguard").addHandler(handler)
    guard = BatchParityGuard(on_violation="warn")
    guard.bind(SideChannel.from_environment(timeout_s=2))
    if rank == 1:
        time.sleep(60)  # never arrives in time (killed once rank 0 reported)
    loader = DataLoader(Points(8), batch_size=4)
    guard.handle(Event.EVAL_START, EventFacts(loader=LoaderFacts("val", loader, False)))
    return records


@pytest.mark.slow
def test_warn_mode_also_warns_when_a_rank_does_not_arrive():
    rank0 = run_ranks(_rank_missing_at_eval_start, 2, timeout_s=60, until=[0])[0]
    assert rank0.error is None, rank0.error
    assert any("rank 1 did not reach" in message for message in rank0.value)


def _raise_late_on_rank_1(rank, world_size):
    import logging
    import time

    from rankguard.callbacks.core.errors import RankGuardError

    logged = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.created)
    logging.getLogger("rankguard").addHandler(handler)
    guard = DropLastGuard()
    guard.bind(SideChannel.from_environment(timeout_s=20))
    times = {}
    for every_rank in (True, False):
        if rank == 1:
            time.sleep(2.0)  # slower to reach the error than rank 0
        try:
            guard.raise_on_every_rank(RankGuardError("same verdict"), every_rank=every_rank)
        except RankGuardError:
            times[every_rank] = {"logged": logged[-1], "raised": time.time()}
        guard.channel.barrier("next")
    return times


@pytest.mark.slow
def test_every_rank_logs_the_error_before_any_rank_raises_it():
    rank0, rank1 = (o.value for o in run_ranks(_raise_late_on_rank_1, 2))
    # A launcher that ends the job at the first exit cannot hide rank 1's error.
    assert rank0[True]["raised"] >= rank1[True]["logged"]
    # An error only some ranks see (about a rank that never arrived) does not wait.
    assert rank0[False]["raised"] < rank1[False]["logged"] - 1.0


def test_take_closed_returns_the_interval_of_its_batch_and_drops_older_ones_only():
    closed = {50: "first", 100: "second", 150: "third"}
    steps = StepLog()
    assert steps.take_closed(closed, 100) == "second"
    assert closed == {150: "third"}  # 50 was never taken: dropped; 150 is not yet due
    assert steps.take_closed(closed, 200) is None  # never closed (a log reset under it)
    assert closed == {}


def test_a_batch_start_calls_the_due_handler_and_the_switch_each_at_its_own_batch():
    calls = []
    steps = StepLog()
    steps.connect([], on_due=lambda batches: calls.append(("due", batches)) or batches + 3)

    def switch(batches: int) -> float:
        calls.append(("switch", batches))
        return batches + 2

    steps.switch, steps.switch_at = switch, 2
    for step in range(6):  # both kinds of batch start share the one threshold
        if step % 2:
            steps.batch_start(step)
        else:
            steps.fetch_end_batch_start(step)
    assert calls == [("due", 1), ("switch", 2), ("due", 4), ("switch", 4), ("switch", 6)]
    assert (steps.due, steps.switch_at, steps.act_at) == (7, 8, 7)


def test_drain_while_the_training_thread_appends_loses_and_reorders_no_entry():
    steps, read = StepLog(), []
    steps.connect([read.extend], on_due=lambda batches: batches + 10**9)
    total = 200_000

    def train() -> None:
        for step in range(total):
            steps.batch_end_fetch_start(step)

    thread = threading.Thread(target=train)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between any two bytecodes
    try:
        thread.start()
        drains = 0
        while thread.is_alive():
            steps.drain()  # the watchdog's reads, concurrent with the appends
            drains += 1
        thread.join()
    finally:
        sys.setswitchinterval(switch)
    steps.drain()
    assert drains > 1
    assert [entry[2] for entry in read] == list(range(total))
    assert steps.entries == []


def test_an_error_is_explained_on_this_rank_before_the_other_ranks_are_told():
    # A peer told ends within seconds and its launcher then stops this rank: every line
    # that only explains the error here is logged first, whatever the guards' order.
    from rankguard.callbacks.core.guard import Guard, GuardRunner
    from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    said: list[str] = []

    class Teller(Guard):
        name = "teller"
        tells_peers_on_error = True

        def on_error(self, exc, facts):
            said.append("told")

    class Explainer(Guard):
        name = "explainer"

        def on_error(self, exc, facts):
            said.append("explained")

    GuardRunner([Teller(), Explainer()]).error(ValueError("x"), EventFacts(step=3))
    assert said == ["explained", "told"]
    assert HangWatchdog.tells_peers_on_error and not DataStallMonitor.tells_peers_on_error
