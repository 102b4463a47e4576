"""A real 2-rank Lightning job (CPU, gloo) that hangs on purpose, watched by the HangWatchdog.

Usage::

    python tests/e2e/lightning_hang_job.py OUT_DIR SCENARIO [SCENARIO ...]

Lightning's DDP launcher re-executes this script for rank 1 with the same
arguments, so both ranks run the same scenarios in order, each a fresh
``Trainer`` in the same two processes. ``resume_calibrated`` resumes from the
checkpoint ``healthy_slow_eval`` saves, so it must follow it. Each rank writes its pid to
``OUT_DIR/pid{rank}`` at start and, after every scenario that returns,
``OUT_DIR/rank{rank}.json`` (outcome, rankguard warnings, counters). A hang
scenario never returns: the watchdog reports into ``OUT_DIR/reports_<scenario>/``
and ends every rank with exit code 75 (70 for a proven deadlock: ``sync_dist_key``,
``should_stop_one_rank``, ``rank0_collective``, ``epoch_end_all_gather``,
``save_on_rank0``), so it must come last. Rank 1 writes the moment it starts to
stall (Unix time) to ``OUT_DIR/stall_<scenario>.json``; the rank that splits the
others off writes it to ``OUT_DIR/split.json``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from rankguard.integrations.lightning import HangWatchdog
from tests.e2e.common import WarningCollector
from tests.e2e.hang_settings import EVAL_BATCH_S, HANG, HEALTHY, TRAIN_STEP_S

OUT = ""


class PacedModule(L.LightningModule):
    """Linear(4, 1) whose train and val steps take a known time; records train-to-train gaps."""

    def __init__(self, train_s: float = 0.0, val_s: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.train_s, self.val_s = train_s, val_s
        self.counters: dict[str, float] = {"train_steps": 0, "val_steps": 0}
        self._last_end: float | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.train_s)
        self.counters["train_steps"] += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        if self._last_end is not None:
            gap = now - self._last_end
            longest = self.counters.get("longest_train_gap_s", 0.0)
            self.counters["longest_train_gap_s"] = max(longest, gap)
        self._last_end = now

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(self.val_s)
        if not self.trainer.sanity_checking:
            self.counters["val_steps"] += 1
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(n)
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(data, batch_size=4)


def stall_after_validation() -> None:
    """The bug: rank 1 never comes back from validation (a hook that blocks, here a sleep)."""
    path = os.path.join(OUT, "stall_stall_after_validation.json")
    with open(path, "w") as file:
        json.dump({"rank": 1, "t": time.time()}, file)
    time.sleep(3600)


class StallAfterValidation(L.Callback):
    """On rank 1 only, blocks in the first ``on_validation_end`` after the sanity check."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1 and not trainer.sanity_checking:
            stall_after_validation()


def reports(scenario: str) -> str:
    return os.path.join(OUT, f"reports_{scenario}")


def trainer(callbacks: list[L.Callback], **settings: Any) -> L.Trainer:
    defaults = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp",
        "use_distributed_sampler": False,  # every rank gets the same 8 train, 4 val batches
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(callbacks=callbacks, **{**defaults, **settings})


SAVING = {"enable_checkpointing": True}


def checkpoints() -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), save_last=True)


def healthy_slow_eval() -> dict[str, Any]:
    watchdog = HangWatchdog(report_dir=reports("healthy_slow_eval"), **HEALTHY)
    module = PacedModule(TRAIN_STEP_S, EVAL_BATCH_S)
    # The sanity check (2 val batches) runs before the first train step; the checkpoint at
    # the end of the epoch holds the watchdog's calibration.
    job = trainer([watchdog, checkpoints()], max_epochs=1, val_check_interval=4, **SAVING)
    job.fit(module, loader(32), loader(16))
    # The longest interval seen per phase kind and the deadlines: the watchdog calibrated.
    core = watchdog.runner.guards[0]
    return {**module.counters, "peaks": dict(core.history.peaks), "deadlines": core.deadlines}


class _Info(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resume_calibrated() -> dict[str, Any]:
    """A second epoch resumed from the healthy run's checkpoint, with a fresh watchdog."""
    watchdog = HangWatchdog(report_dir=reports("resume_calibrated"), **HEALTHY)
    info = _Info()
    log = logging.getLogger("rankguard.callbacks.hang_watchdog")
    log.addHandler(info)
    log.setLevel(logging.INFO)
    module = PacedModule(TRAIN_STEP_S)
    job = trainer([watchdog, checkpoints()], max_epochs=2, val_check_interval=4, **SAVING)
    try:
        job.fit(module, loader(32), loader(16), ckpt_path=os.path.join(OUT, "ckpt", "last.ckpt"))
    finally:
        log.removeHandler(info)
    plans = [m for m in info.messages if "reports at deadlines" in m]
    return {**module.counters, "plans": plans}


def stall_after_validation_end() -> dict[str, Any]:
    # rankguard first: it sees the end of validation before the culprit blocks in it.
    watchdog = HangWatchdog(report_dir=reports("stall_after_validation"), **HANG)
    job = trainer([watchdog, StallAfterValidation()], max_epochs=2, val_check_interval=2)
    job.fit(PacedModule(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class ExtraSyncedKey(PacedModule):
    """The bug (Lightning #19106): rank 1 alone logs a key with ``sync_dist=True`` at step 5."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 5:
            with open(os.path.join(OUT, "split.json"), "w") as file:
                json.dump({"rank": 1, "t": time.time()}, file)
            self.log("extra", loss.detach(), sync_dist=True)
        return loss


def sync_dist_key() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("sync_dist_key"))], max_epochs=2)
    job.fit(ExtraSyncedKey(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class StopOnRank0(L.Callback):
    """The bug (Lightning #379): rank 0 alone sets ``trainer.should_stop`` at step 5.

    As early stopping does when it decides from one rank's un-synced metric.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 5:
            with open(os.path.join(OUT, "split.json"), "w") as file:
                json.dump({"rank": 0, "t": time.time()}, file)
            trainer.should_stop = True


def should_stop_one_rank(alone: bool = False) -> dict[str, Any]:
    """``RankGuard()`` with every setting at its default; reports in ``./rankguard_reports``.

    Rank 0 stops after step 5, so the batch-parity check at its epoch end waits for rank 1,
    which goes on into step 6. With ``alone``, the hang watchdog alone (at its defaults):
    rank 0 leaves fit, while rank 1 waits in the next step's collective.
    """
    from rankguard.integrations.lightning import RankGuard

    guard = HangWatchdog() if alone else RankGuard()
    job = trainer([guard, StopOnRank0()], max_epochs=2)
    job.fit(PacedModule(), loader(32))
    with open(os.path.join(OUT, f"fit_returned{job.global_rank}.json"), "w") as file:
        json.dump({"t": time.time()}, file)
    return {}


def mark_split(rank: int) -> None:
    """Records the moment (Unix time) ``rank`` takes the path the others do not."""
    with open(os.path.join(OUT, "split.json"), "w") as file:
        json.dump({"rank": rank, "t": time.time()}, file)


def reduce_on_rank0_only(group: Any) -> None:
    """The bug (Composer #239, here in Lightning): a collective under ``if rank == 0``."""
    mark_split(0)
    torch.distributed.all_reduce(torch.ones(3), group=group)


class Rank0Collective(L.Callback):
    """At the first train epoch's end, rank 0 alone reduces a tensor.

    On its own gloo group, as :mod:`tests.e2e.composer_hang_job` does: on the
    training group gloo pairs it with rank 1's next one (DDP's gradient
    all-reduce) and fails on the size mismatch, where NCCL would hang.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.group = torch.distributed.new_group(backend="gloo")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and trainer.current_epoch == 0:
            reduce_on_rank0_only(self.group)


def rank0_collective() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer(
        [HangWatchdog(report_dir=reports("rank0_collective")), Rank0Collective()], max_epochs=2
    )
    job.fit(PacedModule(), loader(32))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class GatherKept(PacedModule):
    """The bug (Lightning #19680): ``self.all_gather`` at the validation epoch's end on a path
    one rank skips: only ranks that kept predictions gather them (rank 1 kept none).

    On a gloo group of its own (``self.all_gather(..., group=...)``), for the reason
    :class:`Rank0Collective` gives.
    """

    def setup(self, stage: str) -> None:
        self.group = torch.distributed.new_group(backend="gloo")
        self.kept: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if self.global_rank == 0:  # e.g. the predictions above a threshold: none on rank 1
            self.kept.append(self.layer(batch[0]).detach().mean())

    def on_validation_epoch_end(self) -> None:
        if self.kept and not self.trainer.sanity_checking:
            mark_split(0)
            self.all_gather(torch.stack(self.kept), group=self.group)
        self.kept.clear()


def epoch_end_all_gather() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("epoch_end_all_gather"))], max_epochs=2)
    job.fit(GatherKept(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class SaveOnRank0(L.Callback):
    """The bug: ``trainer.save_checkpoint`` under ``if trainer.is_global_zero`` at step 5.

    Lightning's save is collective (it ends in ``strategy.barrier``): rank 0 waits there.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == 5:
            mark_split(0)
            trainer.save_checkpoint(os.path.join(OUT, "rank0_only.ckpt"))


def save_on_rank0() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("save_on_rank0")), SaveOnRank0()], max_epochs=2)
    job.fit(PacedModule(), loader(32))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


SCENARIOS = {
    "healthy_slow_eval": healthy_slow_eval,
    "resume_calibrated": resume_calibrated,
    "stall_after_validation": stall_after_validation_end,
    "sync_dist_key": sync_dist_key,
    "should_stop_one_rank": should_stop_one_rank,
    "should_stop_leaves_fit": functools.partial(should_stop_one_rank, alone=True),
    "rank0_collective": rank0_collective,
    "epoch_end_all_gather": epoch_end_all_gather,
    "save_on_rank0": save_on_rank0,
}


def main(argv: list[str]) -> None:
    global OUT
    OUT, *names = argv
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for rank 1
    with open(os.path.join(OUT, f"pid{rank}"), "w") as file:
        file.write(str(os.getpid()))
    collector = WarningCollector()
    logging.getLogger("rankguard").addHandler(collector)
    results: dict[str, Any] = {}
    for name in names:
        collector.messages.clear()
        counters = SCENARIOS[name]()
        results[name] = {"outcome": "ok", "warnings": list(collector.messages), **counters}
        path = os.path.join(OUT, f"rank{rank}.json")
        with open(path + ".tmp", "w") as file:
            json.dump(results, file, indent=1)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1:])
