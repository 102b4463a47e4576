"""The hand-written loop API (``rankguard.integrations.torch``) in one process, no process group.

The same loop runs on 2 ranks under ``torchrun`` in ``tests/frameworks/launches.py``;
here: the events it fires and their order, its misuse errors, loaders it
cannot inspect, a healthy loop's silence, and the checkpoint plan it gets
(that one on 2 spawned ranks, since a sharded save only differs from a full
one at world size > 1).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from rankguard.callbacks.core.errors import CheckpointMemoryError
from rankguard.callbacks.core.events import LoaderPass
from rankguard.callbacks.core.guard import Guard
from rankguard.integrations import torch as rg_torch
from rankguard.integrations.torch import RankGuard
from tests.e2e.common import PER_STEP_NAMES, EventLog, Points
from tests.mp import run_ranks

QUICK = {"hang_watchdog": {"exchange_period_s": 0.2}}


def loaders(n_train: int = 8, n_eval: int = 4, batch_size: int = 2):
    return DataLoader(Points(n_train), batch_size=batch_size), DataLoader(
        Points(n_eval), batch_size=batch_size
    )


def model_and_optimizer():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model, optimizer, batch) -> None:
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def recording_guard():
    log = EventLog()
    return rg_torch._LoopGuard([log]), log


def test_no_process_group_here():
    assert not dist.is_initialized()  # world size 1 without torch.distributed


def test_loop_events_follow_the_documented_order(tmp_path):
    guard, log = recording_guard()
    model, optimizer = model_and_optimizer()
    train, evals = loaders(n_train=4, n_eval=4)
    torch.save(model.state_dict(), tmp_path / "resume.pt")
    with guard.load(tmp_path / "resume.pt"):  # a resume, before the fit
        model.load_state_dict(torch.load(tmp_path / "resume.pt"))
    with guard.fit(model, optimizer, train, eval_loaders={"val": evals}) as run:
        for batch in run.train(train):
            step(model, optimizer, batch)
            if run.step == 1:
                for _ in run.eval(evals):
                    pass
            if run.step == 2:
                with run.checkpoint(tmp_path):
                    torch.save(model.state_dict(), tmp_path / "m.pt")
    assert log.events == [
        ("checkpoint_load_start", 0, None),
        ("fit_start", 0, None),
        ("epoch_start", 0, "train"),
        ("data_fetch_start", 0, None),
        ("data_fetch_end", 0, None),
        ("train_batch_start", 0, None),
        # The step's end is known only when the eval starts in its body.
        ("train_batch_end", 0, None),
        ("eval_start", 1, "val"),
        ("eval_batch_start", 1, "val"),
        ("eval_batch_end", 1, "val"),
        ("eval_batch_start", 1, "val"),
        ("eval_batch_end", 1, "val"),
        ("eval_end", 1, "val"),
        # After eval until the next train fetch: the watchdog's post-eval phase.
        ("data_fetch_start", 1, None),
        ("data_fetch_end", 1, None),
        ("train_batch_start", 1, None),
        ("train_batch_end", 1, None),
        ("checkpoint_save_start", 2, None),
        ("checkpoint_save_end", 2, None),
        ("data_fetch_start", 2, None),  # the fetch that found the loader exhausted
        # The epoch ends where every rank is sure to be: the next epoch or the fit's end.
        ("epoch_end", 2, "train"),
        ("fit_end", 2, None),
    ]
    assert (run.step, run.epoch) == (2, 0)


class DueLog(EventLog):
    """An event log that acts at the start of train batch 3, then of every second batch."""

    name = "due_log"

    def __init__(self) -> None:
        super().__init__()
        self.due = 3
        self.acted: list[tuple[int, tuple]] = []

    def on_due(self, batches: int) -> None:
        self.steps.drain()
        self.acted.append((batches, self.events[-1]))
        self.due = batches + 2


def test_usual_steps_record_every_event_and_act_at_the_due_batch_start():
    """The loop's usual steps (one entry a call, made inline) read as the four events."""
    log = DueLog()
    model, optimizer = model_and_optimizer()
    train, _ = loaders(n_train=10)  # 5 batches
    with rg_torch._LoopGuard([log]).fit(model, optimizer, train) as run:
        for batch in run.train(train):
            step(model, optimizer, batch)
    per_step = [(event, step) for event, step, _ in log.events if event in PER_STEP_NAMES]
    expected = []
    for n in range(5):
        expected += [
            ("data_fetch_start", n),
            ("data_fetch_end", n),
            ("train_batch_start", n),
            ("train_batch_end", n),
        ]
    expected.append(("data_fetch_start", 5))  # the fetch that found the loader exhausted
    assert per_step == expected
    # Batches count from 1: batch 3 is step 2; each due saw its own batch's start.
    assert log.acted == [(3, ("train_batch_start", 2, None)), (5, ("train_batch_start", 4, None))]


class PassLog(Guard):
    """Records what each EVAL_END and EPOCH_END says the loader's iterator did."""

    name = "pass_log"

    def __init__(self) -> None:
        super().__init__()
        self.passes: list[tuple] = []

    def on_eval_end(self, facts) -> None:
        self.passes.append(("eval_end", facts.step, facts.loader_pass))

    def on_epoch_end(self, facts) -> None:
        self.passes.append(("epoch_end", facts.epoch, facts.loader_pass))


def test_eval_and_epoch_ends_say_how_many_batches_the_iterator_gave_and_if_it_ran_out():
    log = PassLog()
    guard = rg_torch._LoopGuard([log])
    model, optimizer = model_and_optimizer()
    train, evals = loaders(n_train=8, n_eval=4)  # 4 train and 2 eval batches
    with guard.fit(model, optimizer, train) as run:
        for epoch in range(2):
            for batch in run.train(train):
                step(model, optimizer, batch)
                if epoch == 1 and run.step == 6:
                    break  # the loop cuts the epoch: not run out
            for _ in run.eval(evals):
                pass
            for _ in run.eval(evals, max_batches=1):  # stopped at the cap: not run out
                pass
    assert log.passes == [
        ("eval_end", 4, LoaderPass(2, True)),
        ("eval_end", 4, LoaderPass(1, False)),
        ("epoch_end", 0, LoaderPass(4, True)),  # at the next epoch's start
        ("eval_end", 6, LoaderPass(2, True)),
        ("eval_end", 6, LoaderPass(1, False)),
        ("epoch_end", 1, LoaderPass(2, False)),  # at the fit's end
    ]


def test_leaving_eval_early_compares_the_batches_that_ran(caplog):
    caplog.set_level(logging.INFO, logger="rankguard")
    model, optimizer = model_and_optimizer()
    train, evals = loaders(n_train=4, n_eval=8)  # 4 eval batches promised
    ran = []
    with RankGuard(**QUICK).fit(model, optimizer, train, eval_loaders=evals) as run:
        for batch in run.train(train):
            step(model, optimizer, batch)
            for i, _ in enumerate(run.eval(evals)):  # llama-recipes' max_eval_step
                if i == 1:
                    break
            ran.append(sum(1 for _ in run.eval(evals, max_batches=3)))
    assert ran == [3, 3]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    left = [r.getMessage() for r in caplog.records if "left eval" in r.getMessage()]
    assert left == [
        "rankguard: the loop left eval 'eval' after 2 batches; the batches that ran are "
        "compared across ranks (`run.eval(loader, max_batches=N)` also checks the plan before "
        "the first batch)"
    ]


def test_healthy_loop_is_silent_and_hands_over_the_metrics(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="rankguard")
    model, optimizer = model_and_optimizer()
    train, evals = loaders()
    logged: list[dict] = []
    guard = RankGuard(data_stall_monitor={"interval": 2}, **QUICK)
    with guard.fit(
        model,
        optimizer,
        train,
        eval_loaders=evals,
        save_dirs=tmp_path / "ckpt",
        log_metrics=logged.append,
    ) as run:
        for epoch in range(2):
            for batch in run.train():
                step(model, optimizer, batch)
            for _ in run.eval(evals):
                pass
            with run.checkpoint():
                torch.save(model.state_dict(), tmp_path / "ckpt" / f"epoch{epoch}.pt")
    assert [r for r in caplog.records if r.name.startswith("rankguard")] == []
    keys = {key for metrics in logged for key in metrics}
    assert {"rankguard/data_wait_s", "rankguard/shared_dir_wait_s"} <= keys
    assert "rankguard/checkpoint_needed_bytes" in run.metrics
    assert (run.step, run.epoch) == (8, 1)
    assert len(run.train(train)) == 4 and len(run.eval(evals, max_batches=1)) == 1


def test_loaders_without_len_are_checked_as_far_as_possible_and_said_once_at_info(caplog):
    caplog.set_level(logging.INFO, logger="rankguard")
    model, optimizer = model_and_optimizer()

    def stream(n):
        return ((torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(n))

    with RankGuard(**QUICK).fit(model, optimizer) as run:
        for _ in range(2):
            for batch in run.train(stream(3)):
                step(model, optimizer, batch)
            for _ in run.eval(stream(2), name="stream_eval"):
                pass
    notes = [r.getMessage() for r in caplog.records if "checked as far as" in r.getMessage()]
    assert notes == [
        "rankguard: loader 'stream_eval' (generator) is checked as far as it can be: no "
        "__len__: batch counts are compared only after each eval; no dataset: its data is "
        "not fingerprinted"
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert run.step == 6


def _fit_twice(guard, model, optimizer, train):
    with guard.fit(model, optimizer, train), guard.fit(model, optimizer, train):
        pass


def _enter_twice(guard, model, optimizer, train):
    run = guard.fit(model, optimizer, train)
    with run:
        pass
    with run:
        pass


def _train_after_fit(guard, model, optimizer, train):
    with guard.fit(model, optimizer, train) as run:
        pass
    next(iter(run.train()))


def _eval_before_fit(guard, model, optimizer, train):
    run = guard.fit(model, optimizer, train)
    iter(run.eval(train))


def _nested_checkpoints(guard, model, optimizer, train, tmp_path):
    with guard.fit(model, optimizer, train) as run, run.checkpoint(tmp_path):
        with run.checkpoint(tmp_path):
            pass


def _same_checkpoint_twice(guard, model, optimizer, train, tmp_path):
    with guard.fit(model, optimizer, train) as run:
        save = run.checkpoint(tmp_path)
        with save:
            pass
        with save:
            pass


def _train_inside_checkpoint(guard, model, optimizer, train, tmp_path):
    with guard.fit(model, optimizer, train) as run, run.checkpoint(tmp_path):
        for _ in run.train():
            pass


def _resume_an_ended_eval(guard, model, optimizer, train):
    with guard.fit(model, optimizer, train) as run:
        it = iter(run.eval(train))
        next(it)
        next(iter(run.train()))  # the loop moved on: the eval ended
        next(it)


def _old_epoch_iterator(guard, model, optimizer, train):
    with guard.fit(model, optimizer, train) as run:
        first = iter(run.train())
        next(first)
        iter(run.train())  # epoch 1 starts
        next(first)


MISUSE = {
    "fit started twice": (_fit_twice, "while an earlier fit of this RankGuard is still running"),
    "a fit entered twice": (_enter_twice, "was already entered"),
    "train after fit": (_train_after_fit, "`run.train(...)` used after its `with guard.fit"),
    "eval before fit": (_eval_before_fit, "`run.eval(...)` used before its `with guard.fit"),
    "nested saves": (_nested_checkpoints, "saves do not nest"),
    "a save entered twice": (_same_checkpoint_twice, "saves do not nest"),
    "train inside a save": (_train_inside_checkpoint, "inside `with run.checkpoint(...)`"),
    "eval end without start": (_resume_an_ended_eval, "was already ended when the loop moved on"),
    "an old epoch's iterator": (_old_epoch_iterator, "of epoch 0 used after epoch 1 started"),
}


@pytest.mark.parametrize("case", MISUSE, ids=list(MISUSE))
def test_out_of_order_calls_name_the_call_and_the_expected_order(case, tmp_path):
    misuse, message = MISUSE[case]
    guard = RankGuard(**QUICK)
    model, optimizer = model_and_optimizer()
    train, _ = loaders()
    args = (guard, model, optimizer, train)
    if "tmp_path" in misuse.__code__.co_varnames:
        args += (tmp_path,)
    with pytest.raises(RuntimeError, match=r"Expected order: `with guard\.fit") as raised:
        misuse(*args)
    assert message in str(raised.value)
    # The guard is usable again: the misuse ended that fit, nothing is left running.
    with guard.fit(model, optimizer, train) as run:
        assert sum(1 for _ in run.train()) == 4


BAD_ARGUMENTS = {
    "state_dict_type": (
        lambda g, m, o, t: g.fit(m, o, t, state_dict_type="partial"),
        "`state_dict_type`",
    ),
    "save_dirs": (lambda g, m, o, t: g.fit(m, o, t, save_dirs=3), "`save_dirs`"),
    "eval name": (lambda g, m, o, t: g.fit(m, o, t, eval_loaders={"": t}), "`eval_loaders` names"),
    "train_loader": (lambda g, m, o, t: g.fit(m, o, 5), "`train_loader` must be an iterable"),
    "optimizer": (lambda g, m, o, t: g.fit(m, "adam", t), "`optimizer`"),
    "max_batches": (lambda g, m, o, t: g.fit(m, o, t).eval(t, max_batches=0), "`max_batches`"),
    "no train loader": (lambda g, m, o, t: g.fit(m, o).train(), "`run.train()` needs the train"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=list(BAD_ARGUMENTS))
def test_bad_arguments_are_value_errors_naming_the_argument(case):
    call, message = BAD_ARGUMENTS[case]
    model, optimizer = model_and_optimizer()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(RankGuard(**QUICK), model, optimizer, loaders()[0])


def _planned_saves(rank: int, world_size: int) -> dict[str, str]:
    """A 2-rank loop on 'two nodes', each with memory for a sharded save but not a full one."""
    os.environ["NODE_RANK"] = str(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 257 KiB of fp32 state, the weight 256 KiB
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Through a buffer a full save needs state + largest tensor on rank 0's node; a
    # sharded one needs the state once per node (half of it twice).
    planner = {"mode": "auto", "writer": "buffer", "host_memory_bytes": 400 << 10}
    outcomes = {}
    for saves in ("full", "sharded"):
        guard = RankGuard(checkpoint_planner=planner, hang_watchdog=False)
        try:
            with guard.fit(model, optimizer, state_dict_type=saves):
                outcomes[saves] = "fits"
        except CheckpointMemoryError as error:
            outcomes[saves] = str(error)
    return outcomes


def test_auto_checkpoint_plan_in_a_loop_names_sharded_saves_and_reads_what_fit_says():
    outcomes = run_ranks(_planned_saves, 2, timeout_s=120)
    for outcome in outcomes:
        assert outcome.exitcode == 0, outcome.error
        full = outcome.value["full"]  # a loop cannot be switched: it says what to change
        assert "A sharded save would fit" in full
        assert "torch.distributed.checkpoint.save(" in full
        assert "guard.fit(..., state_dict_type='sharded')" in full
        assert outcome.value["sharded"] == "fits"  # told by fit(state_dict_type=...)


def test_the_watchdogs_calibration_goes_into_the_loops_checkpoint_and_back(tmp_path):
    # A loop saves guard.state_dict() with its model; the resumed guard starts calibrated.
    # A floor far above a step's time on a loaded machine: the calibrated deadline is the floor.
    settings = {"hang_watchdog": {"exchange_period_s": 0.2, "warmup_steps": 0, "floor_s": 5.0}}
    model, optimizer = model_and_optimizer()
    train, evals = loaders(n_train=32)
    guard = RankGuard(**settings)
    with guard.fit(model, optimizer, train, eval_loaders=evals) as run:
        for _ in range(2):
            for batch in run.train():
                step(model, optimizer, batch)
            for _ in run.eval(evals):
                pass
    torch.save({"model": model.state_dict(), "rankguard": guard.state_dict()}, tmp_path / "c.pt")
    guard.close()
    saved = torch.load(tmp_path / "c.pt")["rankguard"]
    assert saved["hang_watchdog"]["calibration"]["recent"]["train"]  # the steps it timed

    resumed = RankGuard(**settings)
    resumed.load_state_dict(saved)
    watchdog = next(g for g in resumed.runner.guards if g.name == "hang_watchdog")
    with resumed.fit(model, optimizer, train) as run:
        for _ in run.train():
            # Calibrated from the checkpoint before its first step ended: the floor, not 600 s.
            assert watchdog.deadlines["train"] == 5.0
            break
    fresh = RankGuard(**settings)
    assert fresh.state_dict() == {}
    fresh.close()
