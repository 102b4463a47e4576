"""Resuming Composer from a checkpoint (tests/frameworks/test_resume_e2e.py)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
)

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import (
    Points,
    own_node,
    rankguard_off,
)
from tests.e2e.composer_concerns import harness
from tests.e2e.composer_concerns.harness import BATCH, COUNTERS, CountBatches, fit, rank, sharded

#: The run the resume scenarios save and resume; each fit trains 4 batches more.
RESUME_RUN = "resume"


def resume_fit(batches: int, folder: str = "ckpt", train: DataLoader | None = None) -> None:
    """Trains up to ``batches`` with ``autoresume``, saving every 4 batches into ``folder``.

    Every guard (none with ``E2E_RANKGUARD=off``); ``COUNTERS["resume_checked"]``: whether
    the resume check ran (a verdict), with the checkpoint it found on this rank.
    """
    guard = None if rankguard_off() else RankGuard()
    fit(
        train if train is not None else sharded(64),
        [*([guard] if guard else []), CountBatches()],
        max_duration=f"{batches}ba",
        save_folder=folder,
        save_interval="4ba",
        run_name=RESUME_RUN,
        autoresume=True,
    )
    check = (
        next((g for g in guard.runner.guards if g.name == "resume_guard"), None) if guard else None
    )
    COUNTERS["resume_checked"] = check is not None and check.verdict is not None


def lagging_copies() -> None:
    """Each rank a node with its own copy of ``ckpt``: node 1's lacks the newest (ba8).

    Composer knows a node by ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (its local rank 0 copies
    the checkpoint for the node); ``/proc/self/cwd`` is one path that each process sees
    on its own disk, as a node-local path is on every node.
    """
    disk = os.path.join(harness.OUT, f"node{rank()}")
    names = ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"][: 2 - rank()]
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    before = {k: os.environ[k] for k in env}
    with own_node(rank(), Path(disk)):
        os.makedirs(os.path.join(disk, "ckpt"))
        for name in names:
            shutil.copy(os.path.join(harness.OUT, "ckpt", name), os.path.join(disk, "ckpt", name))
        os.symlink(names[-1], os.path.join(disk, "ckpt", "latest-rank0.pt"))
        os.environ.update(env)
        os.chdir(disk)
        try:
            resume_fit(12, folder="/proc/self/cwd/ckpt")
        finally:
            os.chdir(harness.OUT)
            os.environ.update(before)


class RankShard(IterableDataset):
    """Each rank's own shard of JSON lines; its position is a byte offset in that shard.

    ``state_dict(num_samples, from_beginning)`` is Composer's dataset resumption
    interface: Composer saves it with the checkpoint and loads it into the dataset.
    """

    def __init__(self, n: int) -> None:
        self.lines = [json.dumps(x.tolist()) + "\n" for x in Points(n, seed=rank()).x]
        self.offset = 0

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.offset = state["offset"]

    def __iter__(self):
        COUNTERS.setdefault("start_offset", self.offset)
        at = 0
        for line in self.lines:
            at += len(line)
            if at > self.offset:  # the first line that ends after the offset
                self.offset = at
                x = torch.tensor(json.loads(line))
                yield x, int(x.sum() > 0)


def data_position() -> None:
    """Saves at batch 4, resumes with ``autoresume`` (rank 0's dataset state on both ranks)."""
    for batches in (4, 8):
        resume_fit(batches, "ckpt_data", DataLoader(RankShard(64), batch_size=BATCH))


SCENARIOS: dict[str, Callable[[], None]] = {
    "resume_first_fit": lambda: resume_fit(8),  # saves ep0-ba4 and ep0-ba8
    "resume_healthy": lambda: resume_fit(12),  # from ep0-ba8 in the shared folder
    "resume_node_lagging": lagging_copies,
    "resume_data_position": data_position,
}


def setup(names: list[str]) -> None:
    os.environ.setdefault("NODE_RANK", "0")
    os.chdir(harness.OUT)  # checkpoints go to OUT/ckpt


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = set()
