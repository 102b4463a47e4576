"""Hangs and deadlocks in Composer (tests/frameworks/test_hang_e2e.py, test_deadlock_e2e.py)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torchmetrics
from composer import Callback, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist

from rankguard.integrations.composer import HangWatchdog, RankGuard
from tests.e2e import hang_settings
from tests.e2e.common import destroy_process_group_waits, rankguard_off
from tests.e2e.composer_concerns import harness
from tests.e2e.composer_concerns.harness import COUNTERS, count, fit, rank, sharded, trainer


class Pace(Callback):
    """Makes train and eval batches take a known time; records the longest train-to-train gap."""

    def __init__(self, train_s: float, eval_s: float) -> None:
        self.train_s, self.eval_s = train_s, eval_s
        self.last_end: float | None = None

    def before_forward(self, state, logger):
        time.sleep(self.train_s)

    def eval_before_forward(self, state, logger):
        time.sleep(self.eval_s)

    def batch_end(self, state, logger):
        now = time.monotonic()
        if self.last_end is not None:
            gap = now - self.last_end
            COUNTERS["longest_train_gap_s"] = max(COUNTERS.get("longest_train_gap_s", 0.0), gap)
        self.last_end = now
        count("train_batches")

    def eval_batch_end(self, state, logger):
        count("eval_batches")


def mark_stall(name: str) -> None:
    """Records when this rank starts to stall (Unix time) in ``OUT/<name>``, for the latency."""
    with open(os.path.join(harness.OUT, name), "w") as file:
        json.dump({"rank": rank(), "t": time.time()}, file)


def mark_split(splitter: int) -> None:
    """Records the moment (Unix time) rank ``splitter`` takes the path the others do not."""
    with open(os.path.join(harness.OUT, "split.json"), "w") as file:
        json.dump({"rank": splitter, "t": time.time()}, file)


def stall_after_eval(marker: str = "stall_post_eval_stall.json") -> None:
    """The bug: rank 1 never comes back from eval (a hook that blocks, here a sleep)."""
    mark_stall(marker)
    time.sleep(3600)


class StallAfterEval(Callback):
    """On rank 1 only, blocks at the first EVAL_END (after rankguard saw it)."""

    def eval_end(self, state, logger):
        if rank() == 1:
            stall_after_eval()


def reduce_on_side_group(group) -> None:
    """The bug: a collective only rank 1 calls (on a group rank 0 never uses after eval)."""
    mark_stall("stall_unmatched_collective.json")
    torch.distributed.all_reduce(torch.ones(1), group=group)


class UnmatchedCollective(Callback):
    """Both ranks make an extra gloo group at fit start; after eval only rank 1 reduces on it."""

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")

    def eval_end(self, state, logger):
        if rank() == 1:
            reduce_on_side_group(self.group)


def reduce_on_rank0_only(group) -> None:
    """The bug: a collective under ``if rank == 0`` (a metric summed "on the main process")."""
    mark_split(0)
    torch.distributed.all_reduce(torch.ones(3), group=group)


class Rank0Collective(Callback):
    """At the first epoch's end, rank 0 alone reduces a tensor.

    On its own gloo group: on the training group gloo would pair it with
    Composer's next collective on rank 1 and crash on the size mismatch.
    """

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")

    def epoch_end(self, state, logger):
        if rank() == 0:
            reduce_on_rank0_only(self.group)


class MetricOnRank0(Callback):
    """Composer's nearest to a key logged with ``sync_dist=True`` on one rank (Composer
    logs no per-key sync): a torchmetrics metric updated on every rank, computed (which
    gathers its state from every rank) on rank 0 only, to log it "on the main process".

    Its sync on a gloo group of its own, as :class:`Rank0Collective` does.
    """

    def fit_start(self, state, logger):
        group = torch.distributed.new_group(backend="gloo")
        self.metric = torchmetrics.MeanMetric(process_group=group)

    def batch_end(self, state, logger):
        self.metric.update(state.loss.detach())

    def epoch_end(self, state, logger):
        if rank() == 0:
            mark_split(0)
            logger.log_metrics({"train/mean_loss": self.metric.compute()})


class GatherKept(Callback):
    """The bug (Lightning #19680, here in Composer): an ``all_gather`` at the epoch's end on
    a path one rank skips: only ranks that kept outputs gather them (rank 1 kept none).

    On a gloo group of its own, as :class:`Rank0Collective` does.
    """

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")
        self.kept: list[torch.Tensor] = []

    def batch_end(self, state, logger):
        if rank() == 0:  # e.g. the outputs above a threshold: none on rank 1
            self.kept.append(state.loss.detach())

    def epoch_end(self, state, logger):
        if self.kept:
            mark_split(0)
            dist.all_gather(torch.stack(self.kept), group=self.group)
        self.kept.clear()


class StopOnRank0(Callback):
    """The bug (transformers #17478, here in Composer): rank 0 alone stops training at batch 5,
    as an early stopper does when it decides from one rank's un-gathered metric."""

    def batch_end(self, state, logger):
        if rank() == 0 and int(state.timestamp.batch) == 5:
            mark_split(0)
            state.stop_training()


class SaveOnRank0(Callback):
    """The bug: ``trainer.save_checkpoint`` on rank 0 only (at batch 5); Composer's save
    gathers from every rank."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def batch_end(self, state, logger):
        if rank() == 0 and int(state.timestamp.batch) == 5:
            mark_split(0)
            self.trainer.save_checkpoint(os.path.join(harness.OUT, "rank0_only.pt"))


class AuxLossOnRank1(ComposerClassifier):
    """The bug: a loss term returned only when a rank's batch has something for it (an
    auxiliary or load-balancing loss): from train batch 5, rank 1's loss dict has ``aux``,
    rank 0's does not. Composer all-reduces each key of the loss dict after every batch."""

    batches = 0

    def loss(self, outputs, batch):
        total = super().loss(outputs, batch)
        self.batches += 1  # one microbatch per batch
        if rank() == 1 and self.batches >= 5:
            if self.batches == 5:
                mark_split(1)
            return {"total": total, "aux": total.detach() * 0.0}
        return {"total": total}


def loss_key_on_rank1() -> None:
    """Every watchdog setting at its default, as in :func:`hang`; the loss keys differ."""
    watchdog = HangWatchdog(report_dir=reports("loss_key_on_rank1"))
    fit(sharded(64), [watchdog], max_duration="2ep", classifier=AuxLossOnRank1)
    raise AssertionError("loss_key_on_rank1: the fit ended; the watchdog should have ended it")


def check_batch(batch: Any, step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if rank() == 1 and step == 6:
        mark_stall("raised.json")
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckBatches(Callback):
    """The user's callback that checks each train batch once it is loaded."""

    def after_dataloader(self, state, logger):
        check_batch(state.batch, int(state.timestamp.batch))


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6; rank 0 goes on into its next
    collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default; an eval every 4 batches. It ends the job (exit code 70).
    """
    with open(os.path.join(harness.OUT, f"pid{rank()}"), "w") as file:
        file.write(str(os.getpid()))
    watchdog = {"report_dir": reports("data_check_raises"), "teardown_timeout_s": 3}
    callbacks = [] if rankguard_off() else [RankGuard(hang_watchdog=watchdog)]
    job = trainer(sharded(64), [*callbacks, CheckBatches()], sharded(32), eval_interval="4ba")
    try:
        job.fit()
    finally:
        destroy_process_group_waits()
    raise AssertionError("the fit ended; rank 1's data check should have raised")


def reports(scenario: str) -> str:
    return os.path.join(harness.OUT, f"reports_{scenario}")


def healthy_slow_eval() -> None:
    settings = hang_settings.HEALTHY
    watchdog = HangWatchdog(report_dir=reports("healthy_slow_eval"), **settings)
    pace = Pace(hang_settings.TRAIN_STEP_S, hang_settings.EVAL_BATCH_S)
    fit(sharded(64), [watchdog, pace], sharded(32), eval_interval="4ba")
    # The longest interval seen per phase kind and the deadlines: the watchdog calibrated.
    core = watchdog.runner.guards[0]
    COUNTERS["peaks"] = dict(core.history.peaks)
    COUNTERS["deadlines"] = core.deadlines


def hang(scenario: str, culprit: Callback, settings: dict, eval_interval: str) -> None:
    """2 epochs of 8 train batches per rank, an eval of 4 batches every ``eval_interval``."""
    # rankguard first: it sees EVAL_END before the culprit blocks in it.
    watchdog = HangWatchdog(report_dir=reports(scenario), **settings)
    callbacks = [watchdog, culprit]
    fit(sharded(64), callbacks, sharded(32), max_duration="2ep", eval_interval=eval_interval)
    raise AssertionError(f"{scenario}: the fit ended; the watchdog should have ended the process")


SCENARIOS: dict[str, Callable[[], None]] = {
    "healthy_slow_eval": healthy_slow_eval,
    # 4 train steps before the first eval calibrate the deadlines: two stages.
    "post_eval_stall": lambda: hang(
        "post_eval_stall", StallAfterEval(), hang_settings.TWO_STAGE, "4ba"
    ),
    # Every watchdog setting at its default: the proven deadlock ends the job (exit 70).
    "rank0_collective": lambda: hang("rank0_collective", Rank0Collective(), {}, "4ba"),
    "metric_on_rank0": lambda: hang("metric_on_rank0", MetricOnRank0(), {}, "4ba"),
    "epoch_end_all_gather": lambda: hang("epoch_end_all_gather", GatherKept(), {}, "4ba"),
    "stop_one_rank": lambda: hang("stop_one_rank", StopOnRank0(), {}, "4ba"),
    "save_on_rank0": lambda: hang("save_on_rank0", SaveOnRank0(), {}, "4ba"),
    "loss_key_on_rank1": loss_key_on_rank1,
    "data_check_raises": data_check_raises,
    "unmatched_collective": lambda: hang(
        "unmatched_collective", UnmatchedCollective(), hang_settings.HANG, "2ba"
    ),
}


def setup(names: list[str]) -> None:
    # The verdict in the output, with the Unix time of each line (the stages' latency).
    logging.basicConfig(format="%(created).3f %(name)s %(levelname)s: %(message)s")


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = {"data_check_raises"}
