"""Hangs and desyncs: a rank stalled after eval, a metric only one rank records, a data
check that raises on one rank (each ends the job, so it comes last)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch.distributed as dist
from olmo_core.train.callbacks import Callback
from olmo_core.train.common import ReduceType

from tests.e2e.common import destroy_process_group_waits, rankguard_off
from tests.e2e.hang_settings import HANG
from tests.e2e.olmo_core_concerns import harness
from tests.e2e.olmo_core_concerns.harness import QUICK, build_trainer, counting, fit


class StallAfterEval(Callback):
    """The bug: rank 1 never comes back from its first evaluation (here a sleep)."""

    priority = -1  # after the evaluator's post_step (0)

    def post_step(self) -> None:
        if self.step % 4 == 0 and dist.get_rank() == 1:
            (harness.OUT / "stall.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
            while True:
                time.sleep(3600)


class RecordOnRank1(Callback):
    """Rank 1 records a metric with a reduce type at step 5, after OLMo-core's first flush.

    As a callback counting a quantity only some ranks have (tokens skipped by a
    filter, a debug metric): OLMo-core flushes it with the steps 5-6 at step 6.
    The moment it records goes to ``harness.OUT/split.json`` (``benchmarks/detection.py``).
    """

    def post_step(self) -> None:
        if dist.get_rank() == 1 and self.trainer.global_step == 5:
            (harness.OUT / "split.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
            self.trainer.record_metric("debug/skipped_tokens", 3.0, reduce_type=ReduceType.sum)


def metric_on_one_rank() -> None:
    from rankguard.integrations.olmo_core import RankGuard

    callbacks = {**counting(RankGuard(**QUICK)), "debug": RecordOnRank1()}
    fit(build_trainer(harness.OUT / "metric_on_one_rank", callbacks))


def metric_on_one_rank_bare() -> None:
    """The same fault without rankguard: OLMo-core's flush at step 6 meets gloo."""
    fit(build_trainer(harness.OUT / "metric_on_one_rank_bare", {"debug": RecordOnRank1()}))


def post_eval_stall() -> None:
    from rankguard.integrations.olmo_core import RankGuard

    settings = {**HANG, "report_dir": str(harness.OUT / "reports")}
    callbacks = {**counting(RankGuard(hang_watchdog=settings)), "stall": StallAfterEval()}
    fit(build_trainer(harness.OUT / "post_eval_stall", callbacks))


def check_batch(batch: dict[str, Any], step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if dist.get_rank() == 1 and step == 6:
        (harness.OUT / "raised.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckBatches(Callback):
    """The user's callback that checks each train batch before its step.

    OLMo-core's ``global_step`` counts the step in progress (1 in the first); ``step`` is the
    steps done before it, as a loop's own counter and rankguard's reports count them.
    """

    def pre_step(self, batch: dict[str, Any]) -> None:
        check_batch(batch, self.trainer.global_step - 1)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6; rank 0 goes on into its next
    collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default. It ends the job (exit code 70).
    """
    from rankguard.integrations.olmo_core import RankGuard

    (harness.OUT / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    watchdog = {
        "report_dir": str(harness.OUT / "reports_data_check_raises"),
        "teardown_timeout_s": 3,
    }
    callbacks = {"check": CheckBatches()}
    if not rankguard_off():
        callbacks["rankguard"] = RankGuard(hang_watchdog=watchdog)
    trainer = build_trainer(harness.OUT / "data_check_raises", callbacks)
    try:
        trainer.fit()
    finally:
        destroy_process_group_waits()


SCENARIOS = {
    "metric_on_one_rank": metric_on_one_rank,
    "metric_on_one_rank_bare": metric_on_one_rank_bare,
    "post_eval_stall": post_eval_stall,
    "data_check_raises": data_check_raises,
}
