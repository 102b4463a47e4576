"""Metric names compared before a framework reduces them: the pure decision and the exchange."""

from __future__ import annotations

import logging

import pytest

from rankguard.callbacks.core.errors import MetricMismatchError
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.hang.metric_reductions import (
    ReductionCheck,
    Row,
    describe,
    digest,
    first_difference,
    reduction_rows,
)
from tests.mp import run_ranks

TYPES = {"train/loss": "mean", "grad/norm": "max", "debug/skipped": "sum", "lr": None}
FLUSH = {5: ["train/loss", "grad/norm", "lr"], 6: ["train/loss", "grad/norm", "lr"]}


def _with(step, name, flush=FLUSH):
    return {s: [*names, name] if s == step else list(names) for s, names in flush.items()}


def test_rows_keep_every_step_and_only_the_names_with_a_reduce_type_sorted():
    rows = reduction_rows({6: ["train/loss", "lr"], 5: ["lr"]}, TYPES)
    assert rows == (Row(5, ()), Row(6, (("train/loss", "mean"),)))
    # An enum's value is its name: OLMo-core's ReduceType.max is "max".
    assert reduction_rows({1: ["a"]}, {"a": type("E", (), {"value": "max"})()}) == (
        Row(1, (("a", "max"),)),
    )


def test_equal_flushes_differ_nowhere_and_share_a_digest():
    rows = {r: reduction_rows(FLUSH, TYPES) for r in (0, 1, 2)}
    assert first_difference(rows) is None
    assert len({digest(r) for r in rows.values()}) == 1


def test_one_extra_name_on_one_rank_is_named_with_its_step_and_rank():
    rows = {0: reduction_rows(FLUSH, TYPES), 1: reduction_rows(_with(5, "debug/skipped"), TYPES)}
    diff = first_difference(rows)
    assert diff is not None and diff.label == 5
    assert diff.extra == {("debug/skipped", "sum"): [1]}
    text = describe(diff, where="the flush", fix="record it everywhere.", world_size=2)
    lead, *rest = text.splitlines()
    assert lead == "Ranks would reduce different metrics in one collective (the flush, step 5)."
    assert rest[0] == "  rank 1 recorded 'debug/skipped' (sum) at step 5; rank 0 did not."
    assert "  rank 0 would reduce steps 5-6, 2 values at step 5." in rest
    assert "  rank 1 would reduce steps 5-6, 3 values at step 5." in rest
    assert rest[-1] == "  Fix: record it everywhere."


def test_the_same_count_of_other_names_is_a_difference_too():
    # Sizes agree, so the collective would pair one rank's loss with another's norm.
    a = reduction_rows({5: ["train/loss"]}, TYPES)
    b = reduction_rows({5: ["grad/norm"]}, {"grad/norm": "mean"})
    diff = first_difference({0: a, 1: b})
    assert diff is not None
    assert diff.extra == {("grad/norm", "mean"): [1], ("train/loss", "mean"): [0]}


def test_a_rank_with_nothing_to_flush_and_a_note_for_a_framework_metric():
    late = reduction_rows({8: ["save_s"]}, {"save_s": "max"})
    diff = first_difference({0: late, 1: (), 2: ()})
    assert diff is not None and diff.rows == {0: (("save_s", "max"),), 1: None, 2: None}
    text = describe(diff, where="w", fix="f", notes={"save_s": "recorded when a save ends."})
    assert "  rank 0 recorded 'save_s' (max) at step 8; ranks 1,2 did not." in text
    assert "  ranks 1,2 would reduce nothing: no collective at all." in text
    assert "  'save_s': recorded when a save ends." in text


def test_a_step_only_some_ranks_flush_is_found_across_several_steps():
    base = {4: ["train/loss"], 5: ["train/loss"]}
    more = {**base, 6: ["train/loss"]}
    diff = first_difference({0: reduction_rows(base, TYPES), 1: reduction_rows(more, TYPES)})
    assert diff is not None and diff.label == 6 and diff.rows[0] is None
    assert diff.extra == {("train/loss", "mean"): [1]}


def test_a_local_channel_checks_nothing():
    check = ReductionCheck(SideChannel(None), name="n", where="w", fix="f")
    check.check(reduction_rows(FLUSH, TYPES))
    assert check.checks == 1


def _flushes(rank, world_size, odd_rank):
    channel = SideChannel.from_environment(timeout_s=20)
    check = ReductionCheck(channel, name="flush", where="the flush", fix="f")
    same = reduction_rows(FLUSH, TYPES)
    check.check(same)  # agree
    check.check(same)
    rows = reduction_rows(_with(6, "debug/skipped"), TYPES) if rank == odd_rank else same
    try:
        check.check(rows)
    except MetricMismatchError as exc:
        return {"checks": check.checks, "error": str(exc)}
    return {"error": None}


def test_three_ranks_agree_twice_then_every_rank_raises_naming_the_odd_rank():
    outcomes = run_ranks(_flushes, 3, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
        message = o.value["error"]
        assert message is not None and message.startswith(
            "Ranks would reduce different metrics in one collective (the flush, step 6)."
        )
        assert "rank 2 recorded 'debug/skipped' (sum) at step 6; ranks 0,1 did not." in message
        assert o.value["checks"] == 3


def _loss_keys(rank, world_size, changer):
    import time

    channel = SideChannel.from_environment(timeout_s=20)
    check = ReductionCheck(channel, name="loss", where="the loss", fix="f", timeout_s=4)
    total = reduction_rows({1: ["total"]}, {"total": "sum", "aux": "sum"})
    check.check_changed(total)  # the first batch: every rank compares
    for batch in range(2, 5):  # unchanged: nothing exchanged
        check.check_changed(reduction_rows({batch: ["total"]}, {"total": "sum"}))
    exchanges = channel.exchanges
    both = reduction_rows({5: ["total", "aux"]}, {"total": "sum", "aux": "sum"})
    if changer is None:  # every rank's keys change at batch 5: they agree at once
        started = time.monotonic()
        check.check_changed(both)
        return {"agreed_in": time.monotonic() - started, "exchanges": exchanges}
    if rank != changer:
        time.sleep(8)  # in the collective, as the unchanged ranks are
        return {"exchanges": exchanges}
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("rankguard").addHandler(handler)
    try:
        check.check_changed(both)
    except Exception as exc:
        return {"error": type(exc).__name__, "exchanges": exchanges, "said": said}
    return {"error": None}


def test_loss_keys_changed_alike_on_every_rank_agree_after_one_exchange_each():
    for o in run_ranks(_loss_keys, 2, None, timeout_s=60):
        assert o.error is None, o.error
        assert o.value["exchanges"] == 1  # batches 2-4 exchanged nothing
        assert o.value["agreed_in"] < 2.0


@pytest.mark.slow
def test_a_rank_whose_loss_keys_changed_alone_waits_and_says_which_keys():
    outcomes = run_ranks(_loss_keys, 2, 1, timeout_s=60)
    changer = next(o for o in outcomes if o.rank == 1)
    assert changer.error is None, changer.error
    # It never went on into the collective: it waited for rank 0, who never came.
    said = changer.value.pop("said")
    assert changer.value == {"error": "RanksMissingError", "exchanges": 1}
    assert any("rank 1's names for the loss changed at step 5 (+'aux' (sum))" in m for m in said)


@pytest.mark.parametrize("setting", [True, False])
def test_the_watchdog_builds_the_check_only_when_it_is_on(setting):
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog

    watchdog = HangWatchdog(check_metric_reductions=setting)
    check = watchdog.metric_reduction_check("flush", where="w", fix="f")
    assert (check is not None) == setting
    if check is not None:
        assert check.name == "metric_reduction/flush"
    with pytest.raises(ValueError, match="check_metric_reductions"):
        HangWatchdog(check_metric_reductions="yes")


def _gathered(rank, world_size):
    channel = SideChannel.from_environment(timeout_s=20)
    check = ReductionCheck(channel, name="gathered", where="the flush", fix="f")
    agreed = check.same(("loss",))
    differ = check.same(("loss", "stage") if rank == 1 else ("loss",))
    # Names differ by design; only the steps size the reduction: the same steps agree.
    names = {5: ["loss", "stage"] if rank == 1 else ["loss"]}
    check.check(reduction_rows(names, TYPES_ANY), compared=(5,))
    steps = {5: ["loss"], 6: ["loss"]} if rank == 0 else {6: ["loss"]}
    try:
        check.check(reduction_rows(steps, TYPES_ANY), compared=tuple(steps))
    except MetricMismatchError as exc:
        return {"same": [agreed, differ], "error": str(exc)}
    return {"same": [agreed, differ], "error": None}


TYPES_ANY = {"loss": "max", "stage": "sum"}


def test_same_and_a_comparison_of_what_sizes_a_gathered_reduction():
    for o in run_ranks(_gathered, 2, timeout_s=60):
        assert o.error is None, o.error
        assert o.value["same"] == [True, False]
        message = o.value["error"]
        assert message is not None and "(the flush, step 5)" in message
        assert "rank 0 recorded 'loss' (max) at step 5; rank 1 did not." in message


def test_same_is_true_on_one_rank():
    assert ReductionCheck(SideChannel(None), name="n", where="w", fix="f").same(1)
