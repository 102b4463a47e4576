"""Hangs and deadlocks in Lightning (tests/frameworks/test_hang_e2e.py, test_deadlock_e2e.py)."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rankguard.integrations.lightning import (
    HangWatchdog,
    RankGuard,
)
from tests.e2e import hang_settings
from tests.e2e.common import WarningCollector, destroy_process_group_waits, rankguard_off
from tests.e2e.lightning_concerns import harness
from tests.e2e.lightning_concerns.harness import Outcome, TinyModule, loader, rank, trainer


class PacedModule(TinyModule):
    """TinyModule whose train and val steps take a known time; records train-to-train gaps."""

    def __init__(self, train_s: float = 0.0, val_s: float = 0.0) -> None:
        super().__init__()
        self.train_s, self.val_s = train_s, val_s
        self.longest_gap: dict[str, float] = {}
        self._last_end: float | None = None

    @property
    def counters(self) -> dict[str, Any]:
        return {"train_steps": self.train_steps, "val_steps": self.val_steps, **self.longest_gap}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.train_s)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        if self._last_end is not None:
            gap = now - self._last_end
            longest = self.longest_gap.get("longest_train_gap_s", 0.0)
            self.longest_gap["longest_train_gap_s"] = max(longest, gap)
        self._last_end = now

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        time.sleep(self.val_s)
        super().validation_step(batch, batch_idx)


def mark(name: str, rank: int) -> None:
    """Writes the moment (Unix time) rank ``rank`` splits off or stalls to ``OUT/<name>``."""
    with open(os.path.join(harness.OUT, name), "w") as file:
        json.dump({"rank": rank, "t": time.time()}, file)


def stall_after_validation() -> None:
    """The bug: rank 1 never comes back from validation (a hook that blocks, here a sleep)."""
    mark("stall_stall_after_validation.json", 1)
    time.sleep(3600)


class StallAfterValidation(L.Callback):
    """On rank 1 only, blocks in the first ``on_validation_end`` after the sanity check."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1 and not trainer.sanity_checking:
            stall_after_validation()


def reports(scenario: str) -> str:
    return os.path.join(harness.OUT, f"reports_{scenario}")


SAVING = {"enable_checkpointing": True}


def checkpoints() -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=os.path.join(harness.OUT, "ckpt"), save_last=True)


def healthy_slow_eval() -> dict[str, Any]:
    watchdog = HangWatchdog(report_dir=reports("healthy_slow_eval"), **hang_settings.HEALTHY)
    module = PacedModule(hang_settings.TRAIN_STEP_S, hang_settings.EVAL_BATCH_S)
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
    watchdog = HangWatchdog(report_dir=reports("resume_calibrated"), **hang_settings.HEALTHY)
    info = _Info()
    log = logging.getLogger("rankguard.callbacks.hang_watchdog")
    log.addHandler(info)
    log.setLevel(logging.INFO)
    module = PacedModule(hang_settings.TRAIN_STEP_S)
    job = trainer([watchdog, checkpoints()], max_epochs=2, val_check_interval=4, **SAVING)
    try:
        job.fit(
            module, loader(32), loader(16), ckpt_path=os.path.join(harness.OUT, "ckpt", "last.ckpt")
        )
    finally:
        log.removeHandler(info)
    plans = [m for m in info.messages if "reports at deadlines" in m]
    return {**module.counters, "plans": plans}


def stall_after_validation_end() -> dict[str, Any]:
    # rankguard first: it sees the end of validation before the culprit blocks in it.
    watchdog = HangWatchdog(report_dir=reports("stall_after_validation"), **hang_settings.HANG)
    job = trainer([watchdog, StallAfterValidation()], max_epochs=2, val_check_interval=2)
    job.fit(PacedModule(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class ExtraSyncedKey(PacedModule):
    """The bug (Lightning #19106): rank 1 alone logs a key with ``sync_dist=True`` at step 5."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 5:
            mark("split.json", 1)
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
            mark("split.json", 0)
            trainer.should_stop = True


def should_stop_one_rank(alone: bool = False) -> dict[str, Any]:
    """``RankGuard()`` with every setting at its default; reports in ``./rankguard_reports``.

    Rank 0 stops after step 5, so the batch-parity check at its epoch end waits for rank 1,
    which goes on into step 6. With ``alone``, the hang watchdog alone (at its defaults):
    rank 0 leaves fit, while rank 1 waits in the next step's collective.
    """
    guard = HangWatchdog() if alone else RankGuard()
    job = trainer([guard, StopOnRank0()], max_epochs=2)
    job.fit(PacedModule(), loader(32))
    with open(os.path.join(harness.OUT, f"fit_returned{job.global_rank}.json"), "w") as file:
        json.dump({"t": time.time()}, file)
    return {}


def reduce_on_rank0_only(group: Any) -> None:
    """The bug (Composer #239, here in Lightning): a collective under ``if rank == 0``."""
    mark("split.json", 0)
    torch.distributed.all_reduce(torch.ones(3), group=group)


class Rank0Collective(L.Callback):
    """At the first train epoch's end, rank 0 alone reduces a tensor.

    On its own gloo group: on the training group gloo pairs it with rank 1's
    next one (DDP's gradient all-reduce) and fails on the size mismatch, where
    NCCL would hang.
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

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().validation_step(batch, batch_idx)
        if self.global_rank == 0:  # e.g. the predictions above a threshold: none on rank 1
            self.kept.append(self.layer(batch[0]).detach().mean())

    def on_validation_epoch_end(self) -> None:
        if self.kept and not self.trainer.sanity_checking:
            mark("split.json", 0)
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
            mark("split.json", 0)
            trainer.save_checkpoint(os.path.join(harness.OUT, "rank0_only.ckpt"))


def save_on_rank0() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("save_on_rank0")), SaveOnRank0()], max_epochs=2)
    job.fit(PacedModule(), loader(32))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


def check_batch(batch: Any, step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if rank() == 1 and step == 6:
        mark("raised.json", 1)
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckedModule(PacedModule):
    """The user's module: its train step first checks the batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        check_batch(batch, self.global_step)
        return super().training_step(batch, batch_idx)


def data_check_raises() -> dict[str, Any]:
    """The field report: rank 1's data check raises at step 6; rank 0 goes on into its next
    collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default. It ends the job (exit code 70).
    """
    watchdog = {"report_dir": reports("data_check_raises"), "teardown_timeout_s": 3}
    job = trainer([] if rankguard_off() else [RankGuard(hang_watchdog=watchdog)])
    try:
        job.fit(CheckedModule(), loader(32), loader(16))
    finally:
        destroy_process_group_waits()
    raise AssertionError("the fit ended; rank 1's data check should have raised")


SCENARIOS: dict[str, Callable[[], dict]] = {
    "healthy_slow_eval": healthy_slow_eval,
    # Resumes from the checkpoint healthy_slow_eval saves, so it must follow it.
    "resume_calibrated": resume_calibrated,
    "stall_after_validation": stall_after_validation_end,
    "sync_dist_key": sync_dist_key,
    "should_stop_one_rank": should_stop_one_rank,
    "should_stop_leaves_fit": functools.partial(should_stop_one_rank, alone=True),
    "rank0_collective": rank0_collective,
    "epoch_end_all_gather": epoch_end_all_gather,
    "save_on_rank0": save_on_rank0,
    "data_check_raises": data_check_raises,
}


def run_hang(fn: Callable[[], dict], collector: WarningCollector) -> Outcome:
    collector.messages.clear()
    counters = fn()
    return {"outcome": "ok", "warnings": list(collector.messages), **counters}, None


def setup(names: list[str]) -> Callable[[str], Outcome]:
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    with open(os.path.join(harness.OUT, f"pid{rank()}"), "w") as file:
        file.write(str(os.getpid()))
    collector = WarningCollector()
    logging.getLogger("rankguard").addHandler(collector)
    return lambda name: run_hang(SCENARIOS[name], collector)


#: Whether ``OUT/rank<r>.json`` holds this concern's records alone, not a report around them.
RECORDS_ALONE = True
