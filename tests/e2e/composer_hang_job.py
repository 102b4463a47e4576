"""A real 2-rank Composer job that hangs on purpose, watched by rankguard's HangWatchdog.

Run: ``composer -n 2 composer_hang_job.py OUT SCENARIO...``.

Scenarios run in order, each a fresh Trainer in the same processes. Healthy
ones record their outcome per rank in ``OUT/rank{N}.json`` (see
tests/e2e/common.py); a hang scenario never returns: the watchdog reports
into ``OUT/reports_<scenario>/`` and ends every rank with exit code 75 (70 for
a proven deadlock: ``rank0_collective``, ``metric_on_rank0``,
``epoch_end_all_gather``, ``save_on_rank0``; ``stop_one_rank`` on gloo ends in
gloo's own abort first), so it must come last. The moment rank 1 starts to
stall is written (Unix time) to ``OUT/stall_<scenario>.json`` just before it
stalls; the rank that splits the others off writes it to ``OUT/split.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
import torchmetrics
from composer import Callback, Evaluator, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader

from rankguard.integrations.composer import HangWatchdog
from tests.e2e.common import Points, Recorder
from tests.e2e.hang_settings import EVAL_BATCH_S, HANG, HEALTHY, TRAIN_STEP_S, TWO_STAGE

OUT = ""
COUNTERS: dict[str, float] = {}


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
        COUNTERS["train_batches"] = COUNTERS.get("train_batches", 0) + 1

    def eval_batch_end(self, state, logger):
        COUNTERS["eval_batches"] = COUNTERS.get("eval_batches", 0) + 1


def mark_stall(scenario: str) -> None:
    """Records when this rank starts to stall (Unix time), for the detection-latency check."""
    path = os.path.join(OUT, f"stall_{scenario}.json")
    with open(path, "w") as file:
        json.dump({"rank": dist.get_global_rank(), "t": time.time()}, file)


def stall_after_eval() -> None:
    """The bug: rank 1 never comes back from eval (a hook that blocks, here a sleep)."""
    mark_stall("post_eval_stall")
    time.sleep(3600)


class StallAfterEval(Callback):
    """On rank 1 only, blocks at the first EVAL_END (after rankguard saw it)."""

    def eval_end(self, state, logger):
        if dist.get_global_rank() == 1:
            stall_after_eval()


def reduce_on_side_group(group) -> None:
    """The bug: a collective only rank 1 calls (on a group rank 0 never uses after eval)."""
    mark_stall("unmatched_collective")
    torch.distributed.all_reduce(torch.ones(1), group=group)


class UnmatchedCollective(Callback):
    """Both ranks make an extra gloo group at fit start; after eval only rank 1 reduces on it."""

    def __init__(self) -> None:
        self.group = None

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")

    def eval_end(self, state, logger):
        if dist.get_global_rank() == 1:
            reduce_on_side_group(self.group)


def reduce_on_rank0_only(group) -> None:
    """The bug: a collective under ``if rank == 0`` (a metric summed "on the main process")."""
    with open(os.path.join(OUT, "split.json"), "w") as file:
        json.dump({"rank": 0, "t": time.time()}, file)
    torch.distributed.all_reduce(torch.ones(3), group=group)


class Rank0Collective(Callback):
    """At the first epoch's end, rank 0 alone reduces a tensor.

    On its own gloo group: on the training group gloo would pair it with
    Composer's next collective on rank 1 and crash on the size mismatch.
    """

    def __init__(self) -> None:
        self.group = None

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")

    def epoch_end(self, state, logger):
        if dist.get_global_rank() == 0:
            reduce_on_rank0_only(self.group)


def mark_split(rank: int) -> None:
    """Records the moment (Unix time) ``rank`` takes the path the others do not."""
    with open(os.path.join(OUT, "split.json"), "w") as file:
        json.dump({"rank": rank, "t": time.time()}, file)


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
        if dist.get_global_rank() == 0:
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
        if dist.get_global_rank() == 0:  # e.g. the outputs above a threshold: none on rank 1
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
        if dist.get_global_rank() == 0 and int(state.timestamp.batch) == 5:
            mark_split(0)
            state.stop_training()


class SaveOnRank0(Callback):
    """The bug: ``trainer.save_checkpoint`` on rank 0 only (at batch 5); Composer's save
    gathers from every rank."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def batch_end(self, state, logger):
        if dist.get_global_rank() == 0 and int(state.timestamp.batch) == 5:
            mark_split(0)
            self.trainer.save_checkpoint(os.path.join(OUT, "rank0_only.pt"))


def sharded(n: int) -> DataLoader:
    data = Points(n)
    return DataLoader(data, batch_size=4, sampler=dist.get_sampler(data))


def fit(callbacks: list[Callback], **trainer_kwargs) -> None:
    """Fits a fresh Trainer; a callback with a ``trainer`` attribute is given the Trainer."""
    COUNTERS.clear()
    torch.manual_seed(0)
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=sharded(64),  # 8 batches per rank
        eval_dataloader=Evaluator(label="eval", dataloader=sharded(32)),  # 4 batches per rank
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=callbacks,
        **trainer_kwargs,
    )
    for callback in callbacks:
        if hasattr(callback, "trainer"):
            callback.trainer = trainer
    try:
        trainer.fit()
    finally:
        trainer.close()


def reports(scenario: str) -> str:
    return os.path.join(OUT, f"reports_{scenario}")


def healthy_slow_eval() -> None:
    watchdog = HangWatchdog(report_dir=reports("healthy_slow_eval"), **HEALTHY)
    pace = Pace(TRAIN_STEP_S, EVAL_BATCH_S)
    fit([watchdog, pace], max_duration="1ep", eval_interval="4ba")
    # The longest interval seen per phase kind and the deadlines: the watchdog calibrated.
    core = watchdog.runner.guards[0]
    COUNTERS["peaks"] = dict(core.history.peaks)
    COUNTERS["deadlines"] = core.deadlines


def hang(scenario: str, culprit: Callback, settings: dict, eval_interval: str) -> None:
    # rankguard first: it sees EVAL_END before the culprit blocks in it.
    watchdog = HangWatchdog(report_dir=reports(scenario), **settings)
    fit([watchdog, culprit], max_duration="2ep", eval_interval=eval_interval)
    raise AssertionError(f"{scenario}: the fit ended; the watchdog should have ended the process")


SCENARIOS = {
    "healthy_slow_eval": healthy_slow_eval,
    # 4 train steps before the first eval calibrate the deadlines: two stages.
    "post_eval_stall": lambda: hang("post_eval_stall", StallAfterEval(), TWO_STAGE, "4ba"),
    # Every watchdog setting at its default: the proven deadlock ends the job (exit 70).
    "rank0_collective": lambda: hang("rank0_collective", Rank0Collective(), {}, "4ba"),
    "metric_on_rank0": lambda: hang("metric_on_rank0", MetricOnRank0(), {}, "4ba"),
    "epoch_end_all_gather": lambda: hang("epoch_end_all_gather", GatherKept(), {}, "4ba"),
    "stop_one_rank": lambda: hang("stop_one_rank", StopOnRank0(), {}, "4ba"),
    "save_on_rank0": lambda: hang("save_on_rank0", SaveOnRank0(), {}, "4ba"),
    "unmatched_collective": lambda: hang(
        "unmatched_collective", UnmatchedCollective(), HANG, "2ba"
    ),
}


def main() -> None:
    global OUT
    OUT, *names = sys.argv[1:]
    # The verdict in the output, with the Unix time of each line (the stages' latency).
    logging.basicConfig(format="%(created).3f %(name)s %(levelname)s: %(message)s")
    recorder = Recorder(OUT)
    for name in names:
        recorder.run(name, SCENARIOS[name], COUNTERS)


if __name__ == "__main__":
    main()
