"""Lightning's resumes on two simulated nodes (tests/frameworks/test_resume_e2e.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import (
    DataLoader,
    IterableDataset,
)

from rankguard.callbacks.resume.position import digest
from rankguard.integrations.lightning import (
    RankGuard,
)
from tests.e2e.common import Points, Recorder, own_node, rankguard_off
from tests.e2e.lightning_concerns import harness
from tests.e2e.lightning_concerns.checkpoint import Module
from tests.e2e.lightning_concerns.harness import COUNTERS, Outcome, rank, trainer

#: The first fit's checkpoint folder (shared by both nodes), and the copy of it a node took
#: right after its step-4 save (the node-local copy that lagged).
RESUME_DIR = "resume/ckpt"
LAGGED_COPY = "resume/ckpt_at_step4"


class CountBatches(L.Callback):
    """Counts the train batches this fit ran."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        COUNTERS["train_batches"] = COUNTERS.get("train_batches", 0) + 1


class CopyAfterStep(L.Callback):
    """Rank 0 copies the checkpoint folder after step ``step``'s save, once (a sync that died)."""

    def __init__(self, src: str, dst: str, step: int) -> None:
        self.src, self.dst, self.step = src, dst, step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == self.step:
            shutil.copytree(self.src, self.dst)


class OffsetStream(IterableDataset):
    """This rank's share of a stream (samples rank, rank + 2, ...), read on from ``next_index``."""

    def __init__(self, rank: int) -> None:
        self.points, self.next_index = Points(512), rank

    def __iter__(self) -> Iterator[Any]:
        while self.next_index < len(self.points):
            self.next_index += 2
            yield self.points[self.next_index - 2]


class StreamLoader(DataLoader):
    """A resumable loader: Lightning saves and loads its ``state_dict`` (where its stream is)."""

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.dataset.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.dataset.next_index = state["next_index"]


def resume_fit(
    dirpath: str,
    train: DataLoader,
    max_steps: int,
    ckpt_path: str | None = None,
    callbacks: tuple[L.Callback, ...] = (),
) -> None:
    """Fits 2 nodes of 1 rank to ``max_steps``; a ModelCheckpoint saves every 4 steps and last."""
    COUNTERS.clear()
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True
    )
    # Every guard but the two that time steps: a step here takes a millisecond, on cores shared
    # with other jobs, and their calls are not what these scenarios are about.
    quiet = {"data_stall_monitor": False, "straggler_monitor": False}
    guards = [] if rankguard_off() else [RankGuard(**quiet)]
    job = trainer(
        [*guards, CountBatches(), *callbacks, checkpoints],
        devices=1,
        num_nodes=2,
        max_steps=max_steps,
        use_distributed_sampler=True,
        enable_checkpointing=True,
    )
    try:
        job.fit(Module(), train, ckpt_path=ckpt_path)
    finally:
        COUNTERS["global_step"] = job.global_step


def points_loader() -> DataLoader:
    """Map-style, 16 batches of 4 per rank an epoch (Lightning adds a DistributedSampler)."""
    return DataLoader(Points(128), batch_size=4)


def lagging_copy() -> None:
    """Each rank plays a node with its own copy of the checkpoint folder; node 1's lagged."""
    node = rank()
    with own_node(node, Path(harness.OUT) / f"lagging_node{node}") as disk:
        shutil.copytree(LAGGED_COPY if node == 1 else RESUME_DIR, disk / "ckpt")
        copied = sorted(os.listdir(disk / "ckpt"))
        try:
            resume_fit(str(disk / "ckpt"), points_loader(), 12, ckpt_path="last")
        finally:
            COUNTERS["copied"] = copied


def stream_loader() -> StreamLoader:
    return StreamLoader(OffsetStream(rank()), batch_size=4)


class PositionAtSave(L.Callback):
    """Records this rank's train loader position (its digest) at each save, as it is written."""

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        position = digest(trainer.train_dataloader.state_dict())
        COUNTERS.setdefault("position_at_save", []).append(position)


def stream_first_fit() -> None:
    """Fits over the stream; records what each checkpoint keeps of the guard and the loader."""
    folder = "resume/stream"
    try:
        resume_fit(folder, stream_loader(), 8, callbacks=(PositionAtSave(),))
    finally:
        for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
            ckpt = torch.load(os.path.join(folder, name), weights_only=False)
            kept = ckpt["callbacks"].get("RankGuard", {}).get("resume_guard", {})
            COUNTERS[f"{name} guard"] = kept.get("saved", {}).get("data/train loader")
            COUNTERS[f"{name} loader"] = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]


def stream_resume() -> None:
    """Resumes the stream from last.ckpt; records where this rank's stream ended."""
    train = stream_loader()
    try:
        resume_fit("resume/stream", train, 12, ckpt_path="last")
    finally:
        COUNTERS["next_index"] = train.dataset.next_index


SCENARIOS: dict[str, Callable[[], None]] = {
    # 8 of 16 batches of an epoch; saves at steps 4 and 8 (and last.ckpt), a copy after step 4.
    "resume_first_fit": lambda: resume_fit(
        RESUME_DIR, points_loader(), 8, callbacks=(CopyAfterStep(RESUME_DIR, LAGGED_COPY, 4),)
    ),
    "resume_lagging_copy": lagging_copy,
    # From the shared folder, mid-epoch, a DistributedSampler: nothing to say.
    "resume_healthy": lambda: resume_fit(RESUME_DIR, points_loader(), 12, ckpt_path="last"),
    "resume_stream_first_fit": stream_first_fit,
    "resume_stream": stream_resume,
}


def setup(names: list[str]) -> Callable[[str], Outcome]:
    os.chdir(harness.OUT)  # the checkpoint folders go to OUT/resume
    recorder = Recorder(harness.OUT)
    return lambda name: (recorder.outcome(SCENARIOS[name], COUNTERS), None)


#: Whether ``OUT/rank<r>.json`` holds this concern's records alone, not a report around them.
RECORDS_ALONE = True
