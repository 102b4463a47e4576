"""Hangs and desyncs: a rank stalled after eval, a collective on rank 0 only, a data check
that raises on one rank (each ends the job, so it comes last)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import destroy_process_group_waits, seeded_split
from tests.e2e.hang_settings import HANG
from tests.e2e.torch_loop_concerns import harness
from tests.e2e.torch_loop_concerns.harness import check_batch, fit


def stall_after_eval() -> None:
    """The bug: rank 1 never comes back from its first eval (here a sleep)."""
    if dist.get_rank() == 1:
        (harness.OUT / "stall.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
        while True:
            time.sleep(3600)


def post_eval_stall() -> None:
    settings = {**HANG, "report_dir": str(harness.OUT / "reports")}
    fit(RankGuard(hang_watchdog=settings), *seeded_split(), after_eval=stall_after_eval)


def reduce_on_rank0_only() -> None:
    """The bug: a collective under ``if rank == 0`` (a metric summed "on the main process")."""
    if dist.get_rank() == 0:
        (harness.OUT / "split.json").write_text(json.dumps({"rank": 0, "t": time.time()}))
        dist.all_reduce(torch.ones(3))


def rank0_collective() -> None:
    """Every setting at its default: the deadlock is proven and ends the job (exit code 70)."""
    guard = RankGuard(hang_watchdog={"report_dir": str(harness.OUT / "reports_rank0_collective")})
    fit(guard, *seeded_split(), after_eval=reduce_on_rank0_only)


def strict_check(batch: dict, step: int) -> None:
    """The data check at step 6, whose error leaves the loop; rank 1 marks the moment."""
    if dist.get_rank() == 1 and step == 6:
        (harness.OUT / "raised.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
    check_batch(batch, step, bad_step=6)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6 (epoch 1); rank 0 goes on into
    its next collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default.
    """
    (harness.OUT / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    watchdog = {
        "report_dir": str(harness.OUT / "reports_data_check_raises"),
        "teardown_timeout_s": 3,
    }
    try:
        fit(RankGuard(hang_watchdog=watchdog), *seeded_split(), epochs=2, check=strict_check)
    finally:
        destroy_process_group_waits()


SCENARIOS = {
    "post_eval_stall": post_eval_stall,
    "rank0_collective": rank0_collective,
    "data_check_raises": data_check_raises,
}
