"""OLMo-core's own asynchronous pre-train save, its completion ordered per rank, with rankguard.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/olmo_core_async_job.py OUT_DIR SCENARIO...

Every scenario is a fresh 2-step ``Trainer`` (``tests/e2e/olmo_core_concerns/harness.py``'s
:func:`build_trainer`) whose ``CheckpointerCallback`` saves asynchronously
(OLMo-core's default on CPU): its pre-train save at step 0, its final save at
step 2 synchronously (OLMo-core's ``post_train``). When that step-0 save ends
on a rank, OLMo-core's done-callback records ``checkpoint/save_async_duration_s``
(reduce type max) at the step that rank is in, from the thread that completed
the save. Where a real run leaves that moment to chance, :class:`SaveOrder`
fixes it per rank, with OLMo-core's own classes: a rank waits for its save's
done-callback before its first batch (the metric lands at step 0), or its
``Checkpointer.save_async`` future is held back (the save itself runs as
usual) until the rank is at a given step, and completed there from a thread of
its own, which then runs OLMo-core's done-callback. OLMo-core's first metric
flush is at step 1.

Outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see ``tests/e2e/common.py``).
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from olmo_core.train.callbacks import Callback
from olmo_core.train.common import ReduceType

from tests.e2e.common import run_scenarios
from tests.e2e.olmo_core_concerns.harness import COUNTERS, QUICK, build_trainer, counting, fit

OUT = Path(".")
#: How long a rank waits for its own save's done-callback before it fails the scenario.
WAIT_S = 60.0
#: OLMo-core's metric for the asynchronous save's duration.
METRIC = "checkpoint/save_async_duration_s"


class SaveOrder(Callback):
    """Fixes at which step this rank's asynchronous pre-train save ends.

    Args:
        at_step: The step at which OLMo-core's done-callback records the metric on
            this rank: 0 (the rank waits for it before its first batch) or the step
            at whose start the held save is completed (the rank waits for the
            done-callback before that step's ``post_step`` returns).
    """

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.release = threading.Event()
        self.saved = threading.Event()
        self.recorded_at: int | None = None

    def post_attach(self) -> None:
        """Holds the checkpointer's save futures back until :attr:`release` (steps past 0)."""
        if self.at_step == 0:
            return
        checkpointer = self.trainer.checkpointer
        save_async = checkpointer.save_async
        release = self.release

        def held_save_async(*args: Any, **kwargs: Any) -> Future:
            written: Future = save_async(*args, **kwargs)
            held: Future = Future()

            def complete() -> None:
                try:
                    written.result()
                except BaseException as exc:
                    held.set_exception(exc)
                    return
                release.wait(WAIT_S)
                held.set_result(None)  # runs OLMo-core's done-callback on this thread

            threading.Thread(target=complete, name="held_async_save", daemon=True).start()
            return held

        checkpointer.save_async = held_save_async

    def post_checkpoint_saved(self, path: Any) -> None:
        """Called by OLMo-core's done-callback right after it recorded the metric."""
        if not self.saved.is_set():
            self.recorded_at = self.trainer.global_step
            COUNTERS["save_metric_step"] = self.recorded_at
            self.saved.set()

    def _wait(self) -> None:
        if not self.saved.wait(WAIT_S):
            raise TimeoutError(f"rank {dist.get_rank()}: the pre-train save never ended")

    def pre_load_batch(self) -> None:
        """Before the first batch (still step 0): the step-0 rank waits for its save."""
        if self.at_step == 0 and self.trainer.global_step == 0:
            self._wait()

    def pre_step(self, batch: Any) -> None:
        """At the start of step ``at_step``: the held save ends."""
        if self.trainer.global_step == self.at_step:
            self.release.set()

    def post_step(self) -> None:
        """Before step ``at_step``'s flush: its metric is recorded."""
        if self.trainer.global_step == self.at_step:
            self._wait()


class OnlyHere(Callback):
    """Records a reduced metric at every step on rank 1 alone (a pipeline stage's own metric).

    A tensor, as a stage's loss: OLMo-core stores it as float32, the dtype of the
    zeros it reduces in its place on the other ranks.
    """

    def post_step(self) -> None:
        if dist.get_rank() == 1:
            value = torch.tensor(1.0)
            self.trainer.record_metric("stage/only_rank_1", value, reduce_type=ReduceType.sum)


def staged(name: str, steps: dict[int, int], extra: dict[str, Callback] | None = None) -> None:
    """A 2-step fit, each rank's pre-train save ending at ``steps[rank]``."""
    from rankguard.integrations.olmo_core import RankGuard

    order = SaveOrder(steps[dist.get_rank()])
    callbacks = {**counting(RankGuard(**QUICK)), "save_order": order, **(extra or {})}
    trainer = build_trainer(
        OUT / name,
        callbacks,
        eval_sequences=None,
        steps=2,
        save_interval=100,
        save_async=True,
    )
    try:
        fit(trainer)
    finally:
        order.release.set()  # never leave a held save behind


def same_step() -> None:
    """Both ranks' saves end at step 0: one flush holds the metric on both (healthy)."""
    staged("same_step", {0: 0, 1: 0})


def same_step_names_differ() -> None:
    """As ``same_step``; rank 1 also records a metric of its own: OLMo-core gathers names."""
    staged("same_step_names_differ", {0: 0, 1: 0}, {"only_here": OnlyHere()})


def split_steps() -> None:
    """Rank 0's save ends at step 0, rank 1's during step 1: both before the first flush.

    OLMo-core's first flush finds the same names on both ranks (it compares the
    names ever recorded), then reduces step 0 on rank 0 only.
    """
    staged("split_steps", {0: 0, 1: 1})


def after_first_flush() -> None:
    """Rank 0's save ends at step 0, rank 1's at step 2: after the first flush (step 1)."""
    staged("after_first_flush", {0: 0, 1: 2})


def after_first_flush_names_differ() -> None:
    """As ``after_first_flush``; OLMo-core gathers names per flush (rank 1's own metric)."""
    staged("after_first_flush_names_differ", {0: 0, 1: 2}, {"only_here": OnlyHere()})


SCENARIOS = {
    "same_step": same_step,
    "same_step_names_differ": same_step_names_differ,
    "split_steps": split_steps,
    "after_first_flush": after_first_flush,
    "after_first_flush_names_differ": after_first_flush_names_differ,
}


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two shared cores
    run_scenarios(SCENARIOS, COUNTERS)


if __name__ == "__main__":
    main()
