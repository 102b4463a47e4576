"""The interval exchange: what guards post at one train batch travels as one exchange."""

from __future__ import annotations

from time import perf_counter

import pytest

from rankguard.callbacks.core import background_exchange
from rankguard.callbacks.core.background_exchange import IntervalExchange
from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.callbacks.core.side_channel import SideChannel
from tests.mp import run_ranks


def _no_totals() -> int:
    raise ValueError("no totals")


def _two_parts(rank: int, world_size: int, broken_rank: int) -> dict:
    channel = SideChannel.from_environment(timeout_s=10)
    intervals = IntervalExchange()
    stall = intervals.post(channel, 50, "stall", lambda: 10 * rank, lambda v: max(v.values()))
    straggler = intervals.post(
        channel, 50, "straggler", _no_totals if rank == broken_rank else lambda: rank, dict
    )
    intervals.flush()
    out = {"stall": stall.result(30), "payload": stall.payload}
    try:
        out["straggler"] = straggler.result(30)
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["exchanges"] = channel.exchanges
    intervals.close()
    return out


def test_parts_posted_at_one_batch_go_as_one_exchange_and_each_gets_its_verdict():
    for o in run_ranks(_two_parts, 2, -1, timeout_s=60):
        assert o.error is None, o.error
        assert o.value["exchanges"] == 1
        assert o.value["stall"] == 10
        assert o.value["payload"] == 10 * o.rank
        assert o.value["straggler"] == {0: 0, 1: 1}


def test_a_part_one_rank_cannot_build_fails_on_every_rank_and_the_others_still_decide():
    for o in run_ranks(_two_parts, 2, 1, timeout_s=60):
        assert o.error is None, o.error
        assert o.value["stall"] == 10
        assert (
            "'straggler' failed: rank 1 could not build it: ValueError: no totals"
            in (o.value["error"])
        )


def _at_batch(rank: int, world_size: int, late_rank: int | None) -> tuple[str, str]:
    from rankguard.callbacks.core.store_health import store_health

    store_health.left_late = rank == late_rank  # this rank's guard acted on a verdict late
    channel = SideChannel.from_environment(timeout_s=10)
    intervals = IntervalExchange()
    pending = intervals.post(channel, 50 * (rank + 1), "stall", lambda: rank, dict)
    intervals.flush()
    try:
        return "verdict", repr(pending.result(30))
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    finally:
        intervals.close()


def test_ranks_that_post_at_different_batches_are_told_so():
    for o in run_ranks(_at_batch, 2, None, timeout_s=60):
        assert o.error is None, o.error
        assert o.value == (
            "RuntimeError",
            "rankguard exchange part 'stall' failed: the ranks posted it at different train "
            "batches ({0: 50, 1: 100}): are the guards set the same on every rank?",
        )


def test_ranks_at_different_batches_after_a_late_verdict_are_told_it_is_skewed():
    # Rank 1 acted on an earlier verdict late (a slow store): no misconfiguration.
    for o in run_ranks(_at_batch, 2, 1, timeout_s=60):
        assert o.error is None, o.error
        assert o.value == (
            "ExchangeSkewed",
            "rankguard exchange part 'stall' failed: the ranks posted it at different train "
            "batches ({0: 50, 1: 100}): rank 1 acted on an earlier verdict late",
        )


def test_a_part_never_flushed_says_so_and_a_local_channel_decides_at_flush():
    intervals = IntervalExchange()
    pending = intervals.post(SideChannel(None), 5, "stall", lambda: 3, lambda v: v[0] + 1)
    with pytest.raises(RuntimeError, match="posted but never sent"):
        pending.result(0)
    nothing = intervals.post(SideChannel(None), 5, "nothing", lambda: 3, lambda v: None)
    intervals.flush()
    assert pending.result(0) == 4
    assert nothing.result(0) is None  # a verdict of None is a verdict


class _Poster(Guard):
    """Posts an exchange every 5 train batches; keeps its verdicts."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name  # type: ignore[misc]
        self.due = 5
        self.verdicts: list = []
        self._pending = None

    def on_due(self, batches: int) -> None:
        if self._pending is not None:
            self.verdicts.append(self._pending.result(30))
        self._pending = self._runner.intervals.post(
            self.channel, batches, self.name, lambda: (self.name, batches), dict
        )
        self.due = batches + 5


def _runner_of_two(rank: int, world_size: int) -> tuple:
    guards = [_Poster("first"), _Poster("second")]
    runner = GuardRunner(guards)
    runner.open()
    for step in range(16):  # dues at batches 5, 10, 15
        runner.steps.batch_start(step)
    for guard in guards:  # the last one, posted at batch 15
        guard.verdicts.append(guard._pending.result(30))
    exchanges = runner.channel.exchanges  # type: ignore[union-attr]
    runner.close()
    return exchanges, guards[0].verdicts, guards[1].verdicts


def test_the_runner_sends_its_due_guards_posts_at_a_batch_as_one_exchange():
    for o in run_ranks(_runner_of_two, 2, timeout_s=60):
        assert o.error is None, o.error
        exchanges, first, second = o.value
        assert exchanges == 3  # three batches, two guards: one exchange each batch
        assert first == [{0: ("first", b), 1: ("first", b)} for b in (5, 10, 15)]
        assert second == [{0: ("second", b), 1: ("second", b)} for b in (5, 10, 15)]


def _next_posts(rank: int, world_size: int) -> dict:
    channel = SideChannel.from_environment(timeout_s=10)
    intervals = IntervalExchange()
    out = {}
    for since, batch in ((None, 50), (1.0 + rank, 100), (0.001, 150)):
        # Seconds since the last exchange (rank 1 slower); None: no fit start seen.
        intervals._since = None if since is None else (perf_counter() - since, batch - 50)
        pending = intervals.post(channel, batch, "stall", lambda: rank, dict)
        intervals.flush()
        pending.result(30)
        out[batch] = (pending.next_post(batch, 50, auto=False), pending.next_post(batch, 50, True))
    never = intervals.post(channel, 200, "stall", lambda: rank, dict)  # never sent
    out["unsent"] = never.next_post(200, 50, auto=True)
    intervals.close()
    return out


def test_the_next_post_is_an_interval_later_or_stretched_to_the_slowest_ranks_pace():
    outcomes = run_ranks(_next_posts, 2, timeout_s=60)
    assert outcomes[0].value == outcomes[1].value  # every rank the same
    for o in outcomes:
        assert o.error is None, o.error
        assert background_exchange.AUTO_INTERVAL_S == 5.0
        # No pace measured: one interval later, as with an interval set.
        assert o.value[50] == (100, 100)
        # Rank 1's 50 batches took 2 s: the smallest multiple of 50 that lasts 5 s at
        # its pace is 150 batches, on both ranks.
        assert o.value[100] == (150, 250)
        # 50 batches in 1 ms and a little (the exchange's own time): stretched to
        # 5 s, some 250,000 batches, a multiple of 50.
        explicit, auto = o.value[150]
        assert explicit == 200
        assert 150 + 50 * 1000 <= auto <= 150 + 50 * 5000 and (auto - 150) % 50 == 0
        assert o.value["unsent"] == 250  # no verdict: one interval later
