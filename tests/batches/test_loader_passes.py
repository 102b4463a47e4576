"""What a loader yields beyond its ``__len__``: counted without side effects, seen per pass."""

from __future__ import annotations

import itertools
import logging
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from rankguard.callbacks.batches.batch_parity_guard import BatchParityGuard, EvalRun, pass_verdict
from rankguard.callbacks.batches.loader_passes import (
    LoaderYield,
    PassCounter,
    PassRun,
    count_batches,
    left_behind,
    yield_mismatches,
)
from rankguard.callbacks.core.errors import BatchCountMismatchError
from rankguard.callbacks.core.events import EventFacts, LoaderFacts, LoaderPass
from tests.e2e.common import LyingSampler, Points, Stream


class DrawingSampler(Sampler[int]):
    """Draws its order from python ``random``, numpy and its own generator; counts its passes."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0
        self.rng = np.random.default_rng(3)
        self.own = random.Random(5)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        self.passes += 1
        order = list(range(self.n))
        random.shuffle(order)
        np.random.shuffle(order)
        self.rng.shuffle(order)
        self.own.shuffle(order)
        return iter(order)


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_counting_reads_no_data_and_leaves_every_generator_as_it_was():
    def loaders():
        generator = torch.Generator().manual_seed(7)
        data = Points(40)
        return [
            DataLoader(data, batch_size=4, sampler=RandomSampler(data, generator=generator)),
            DataLoader(data, batch_size=4, sampler=RandomSampler(data)),  # global torch RNG
            DataLoader(data, batch_size=4, sampler=DrawingSampler(40)),
            DataLoader(data, batch_size=None, sampler=DistributedSampler(data, 2, 1, True)),
        ]

    def first_pass(loader):
        return [batch[0].sum().item() for batch in loader]

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = [first_pass(loader) for loader in loaders()], draws()

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    counted = loaders()
    assert [count_batches(loader).batches for loader in counted] == [10, 10, 10, 20]
    assert counted[2].sampler.passes == 0  # its attributes are put back too
    assert ([first_pass(loader) for loader in counted], draws()) == expected


def test_count_shows_a_sampler_yielding_other_than_its_len():
    data = Points(64)
    more = DataLoader(data, batch_size=4, sampler=LyingSampler(data, claimed=16, actual=32))
    fewer = DataLoader(data, batch_size=4, sampler=LyingSampler(data, claimed=16, actual=8))
    assert (len(more), count_batches(more).batches) == (4, 8)
    assert (len(fewer), count_batches(fewer).batches) == (4, 2)


def test_loaders_that_cannot_be_counted_cheaply_say_why_or_are_left_alone():
    assert count_batches(DataLoader(Stream(8), batch_size=4)).batches is None
    assert count_batches([1, 2, 3]).batches is None
    big = count_batches(DataLoader(Points(64), batch_size=4), max_samples=50)
    assert big.batches is None and big.skipped == "its dataset holds 64 samples (over 50)"
    lying = DataLoader(Points(50), batch_size=4, sampler=LyingSampler(Points(50), 8, 70))
    walked = count_batches(lying, max_samples=60)
    assert walked.batches is None and walked.skipped == "its sampler yields over 60 indices"


def test_pass_counter_tells_a_loader_that_ran_out_from_one_that_was_stopped():
    loader = DataLoader(Points(12), batch_size=4)
    counter = PassCounter(loader)
    assert counter.result() is None
    assert len(counter) == 3 and counter.batch_size == 4 and counter.dataset is loader.dataset
    assert len(list(counter)) == 3
    assert counter.result() == LoaderPass(yielded=3, exhausted=True)
    assert len(list(itertools.islice(counter, 2))) == 2  # a framework's limit: not run out
    assert counter.result() == LoaderPass(yielded=2, exhausted=False)
    stream = PassCounter(DataLoader(Stream(6), batch_size=4))
    with pytest.raises(TypeError):
        len(stream)
    assert [len(b[0]) for b in stream] == [4, 2] and stream.result().exhausted


def test_yield_mismatches_name_ranks_with_batches_past_the_plan_or_short_of_it():
    fine = LoaderYield(planned=4, promised=4, actual=4)
    more = LoaderYield(planned=4, promised=4, actual=6)
    fewer = LoaderYield(planned=4, promised=4, actual=2)
    limited = LoaderYield(planned=2, promised=4, actual=6)  # the framework's own limit
    assert yield_mismatches({0: {"eval": fine}, 1: {"eval": limited}}) == {}
    assert yield_mismatches({0: {"eval": fine}, 1: {"eval": more}, 2: {"eval": more}}) == {
        "eval": "ranks 1,2: __len__ 4 batches, yields 6 (2 never run)"
    }
    assert yield_mismatches({0: {"val": fewer}, 1: {"val": fine}}) == {
        "val": "rank 0: __len__ 4 batches, yields 2 (runs out 2 short of the 4 planned)"
    }


def test_data_left_behind_is_named_with_what_is_known_of_it():
    assert left_behind({0: PassRun(3, True), 1: PassRun(3, True)}) == ""
    assert left_behind({0: PassRun(3, False), 1: PassRun(3, False)}) == ""  # cut by the plan
    assert left_behind({0: PassRun(3, True), 1: PassRun(3, None)}) == ""  # not seen
    assert left_behind({0: PassRun(3, True, 3), 1: PassRun(3, False, 4)}) == (
        "rank 0: ran out after 3 batches; still had data: rank 1: ran 3 batches, "
        "at least 1 more left"
    )
    assert left_behind({0: PassRun(2, True, 2, 2), 1: PassRun(2, False, 3, 5)}) == (
        "rank 0: ran out after 2 batches; still had data: rank 1: ran 2 batches, "
        "3 more left (its loader yields 5)"
    )


def test_pass_verdict_checks_promises_for_eval_passes_only():
    # An eval pass that broke its __len__ promise; the same counts in a train epoch are
    # the framework's own limit (max steps, a resumed epoch).
    assert pass_verdict({0: EvalRun(2, 4), 1: EvalRun(2, 4)})[0] == (
        "ranks 0,1: ran 2 of 4 batches its __len__ promised"
    )
    assert pass_verdict({0: PassRun(2), 1: PassRun(2)}) == ("", "")
    assert pass_verdict({0: PassRun(2), 1: PassRun(3)}) == (
        "rank 0: 2 batches; rank 1: 3 batches",
        "",
    )


def test_guard_counts_once_per_fit_and_says_at_info_when_a_loader_is_too_large(caplog):
    loader = DataLoader(Points(64), batch_size=4, sampler=LyingSampler(Points(64), 16, 32))
    facts = EventFacts(loaders=[LoaderFacts("eval", loader, is_train=False)])
    with pytest.raises(BatchCountMismatchError, match="yields 8 \\(4 never run\\)"):
        BatchParityGuard().on_fit_start(facts)
    with caplog.at_level(logging.INFO, logger="rankguard"):
        BatchParityGuard(max_count_samples=10).on_fit_start(facts)
    [info] = [r.getMessage() for r in caplog.records if "not counted" in r.getMessage()]
    assert "loader 'eval' not counted before its first batch: its dataset holds 64" in info
    BatchParityGuard(max_count_samples=0).on_fit_start(facts)  # off: nothing counted
    with pytest.raises(ValueError, match="`max_count_samples`"):
        BatchParityGuard(max_count_samples=-1)
