"""Checkpoints written and resumed: ``healthy``'s run continued (``resume``), then the
resume guard's scenarios on a run of their own (``resume_*``; ``resume_first`` comes first).

``healthy`` is the healthy fit every test of the integration reads, and the run ``resume``
continues, so it comes before ``resume``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from olmo_core.train import Trainer
from olmo_core.train.callbacks import Callback

from tests.e2e.common import own_node, rankguard_off
from tests.e2e.olmo_core_concerns import harness
from tests.e2e.olmo_core_concerns.harness import (
    COUNTERS,
    QUICK,
    Count,
    build_trainer,
    counting,
    fit,
)


def healthy() -> None:
    from rankguard.integrations.olmo_core import RankGuard

    fit(build_trainer(harness.OUT / "healthy", counting(RankGuard(**QUICK))))


def resume() -> None:
    """``healthy``'s run continued for 4 more steps from its last checkpoint (step 8)."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    trainer = build_trainer(harness.OUT / "healthy", counting(guard), steps=12)
    state = torch.load(
        harness.OUT / "healthy" / "ckpt" / "step8" / "train" / f"rank{dist.get_rank()}.pt",
        weights_only=False,
    )
    COUNTERS["saved_state"] = sorted(state["callbacks"]["rankguard"])
    watchdog = next(g for g in guard.runner.guards if g.name == "hang_watchdog")
    fit(trainer)
    COUNTERS["resumed_at"] = 8 if trainer.checkpoint_loaded else 0
    COUNTERS["calibrated_from_checkpoint"] = bool(watchdog.heartbeats.restored)


#: The resume scenarios' run: saved at steps 0, 4 and 8, with a per-rank data cursor.
RESUME_RUN = "resume_run"


def resume_guard_of(guard: Callback) -> Any:
    return next(g for g in guard.runner.guards if g.name == "resume_guard")


def resume_first() -> None:
    """A first fit of 8 steps saving at 0, 4 and 8; the resume guard's state at the last save."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    fit(
        build_trainer(
            harness.OUT / RESUME_RUN, counting(guard), eval_sequences=None, rank_cursor=True
        )
    )
    COUNTERS["guard_saved"] = resume_guard_of(guard).state_dict()


def resumed_fit(guard: Callback, trainer: Trainer) -> None:
    """``trainer.fit()``, recording what the resume guard holds as RESUMED starts."""
    resume = resume_guard_of(guard)
    resumed = guard.driver.resumed

    def recorded(facts):
        COUNTERS["loaded_state"] = dict(resume._loaded)
        COUNTERS["resumed"] = {"checkpoint": facts.checkpoint, "asked": facts.asked}
        resumed(facts)

    guard.driver.resumed = recorded
    try:
        fit(trainer)
    finally:
        COUNTERS["verdict"] = resume.verdict and [resume.verdict.error, resume.verdict.warnings]


def resume_healthy() -> None:
    """The same config with 4 more steps, fit again: OLMo-core loads the latest (step8)."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    trainer = build_trainer(
        harness.OUT / RESUME_RUN, counting(guard), eval_sequences=None, steps=12, rank_cursor=True
    )
    state = torch.load(
        harness.OUT / RESUME_RUN / "ckpt" / "step8" / "train" / f"rank{dist.get_rank()}.pt",
        weights_only=False,
    )
    COUNTERS["file_state"] = state["callbacks"]["rankguard"].get("resume_guard")
    resumed_fit(guard, trainer)


def resume_callbacks(rank_guard: type) -> dict[str, Callback]:
    """``Count`` and ``RankGuard``, or ``Count`` alone with ``E2E_RANKGUARD=off``."""
    return {"count": Count()} if rankguard_off() else counting(rank_guard(**QUICK))


def run_resumed(trainer: Trainer) -> None:
    guard = trainer.callbacks.get("rankguard")
    if guard is None:
        fit(trainer)
    else:
        resumed_fit(guard, trainer)


def copy_checkpoints(target: Path, names: list[str], train_files: str = "rank*.pt") -> None:
    """Copies ``names`` of the first fit's save folder to ``target`` (``train/`` as matched)."""
    for name in names:
        source = harness.OUT / RESUME_RUN / "ckpt" / name
        shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("train"))
        (target / name / "train").mkdir()
        for file in (source / "train").glob(train_files):
            shutil.copy2(file, target / name / "train" / file.name)


def resume_lagging_copy() -> None:
    """Each rank plays a node resuming from its own disk's ``ckpt`` (the same path on every
    node, as ``/local/ckpt``); node 1's copy lost the newest, ``step8``."""
    from rankguard.integrations.olmo_core import RankGuard

    rank = dist.get_rank()
    os.environ["OLMO_SHARED_FS"] = "1"
    here = os.getcwd()
    try:
        with own_node(rank, harness.OUT / f"lagging_node{rank}") as disk:
            copy_checkpoints(disk / "ckpt", ["step0", "step4", "step8"][: 3 - rank])
            dist.barrier()  # both copies are in place before the restart
            os.chdir(disk)
            trainer = build_trainer(
                harness.OUT / RESUME_RUN,
                resume_callbacks(RankGuard),
                eval_sequences=None,
                save_folder=Path("ckpt"),
                steps=12,
                rank_cursor=True,
            )
            run_resumed(trainer)
    finally:
        os.chdir(here)
        del os.environ["OLMO_SHARED_FS"]


def resume_rank0_state() -> None:
    """``load_path=`` a copy of step8 that kept ``train/rank0.pt`` alone (the trainer state as
    one file): OLMo-core's load falls back to it on rank 1 (data cursor and random states)."""
    from rankguard.integrations.olmo_core import RankGuard

    copy = harness.OUT / "promoted"
    if dist.get_rank() == 0:
        copy_checkpoints(copy, ["step8"], train_files="rank0.pt")
    dist.barrier()
    trainer = build_trainer(
        harness.OUT / RESUME_RUN,
        resume_callbacks(RankGuard),
        eval_sequences=None,
        save_folder=harness.OUT / "rank0_state" / "ckpt",
        steps=12,
        load_path=str(copy / "step8"),
        rank_cursor=True,
    )
    run_resumed(trainer)


SCENARIOS = {
    "resume_first": resume_first,
    "resume_healthy": resume_healthy,
    "resume_lagging_copy": resume_lagging_copy,
    "resume_rank0_state": resume_rank0_state,
    "healthy": healthy,
    "resume": resume,
}
