"""Checkpoints saved and resumed: node-local disks, a first run and its resumes (a shared
folder, a lagging copy, each rank's own data position)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import VOCAB, own_node, rankguard_off, seed_everything, seeded_split
from tests.e2e.hf_trainer_concerns import harness
from tests.e2e.hf_trainer_concerns.harness import COUNTERS, QUICK, train


def node_local_resume() -> None:
    """Each rank plays a node whose local disk is ``hf_node<r>/``: a save, then a resume."""
    rank = dist.get_rank()
    with own_node(rank, harness.OUT / f"hf_node{rank}") as disk:
        seed_everything(0)
        output_dir = disk / "out"  # the same folder name on every node, each node's own
        train("node_local_resume", RankGuard(**QUICK), *seeded_split(), output_dir=output_dir)
        saved = sorted(p.name for p in (output_dir / "checkpoint-4").iterdir())
        seed_everything(0)
        try:  # the next run resumes: checked before the Trainer loads anything
            guard = RankGuard(**QUICK)
            train("resume", guard, *seeded_split(), output_dir=output_dir, resume=True)
        finally:
            COUNTERS["saved"] = saved


class StepsRun(TrainerCallback):
    """Counts the train steps that ran to their end (``steps_run``)."""

    def on_step_end(self, args, state, control, **kwargs):
        COUNTERS["steps_run"] = COUNTERS.get("steps_run", 0) + 1


class TimeLimit(TrainerCallback):
    """The job's time ran out after step 9, on every rank: it stops without a last save."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 9:
            control.should_training_stop = True


def resume_guard() -> RankGuard | None:
    return None if rankguard_off() else RankGuard(**QUICK)


#: The resume scenarios' run: 12 steps (2 epochs); the first stops after 9, its checkpoints
#: 4 and 8 (the second epoch's second step).
RESUME_STEPS = 12


def resume_first() -> None:
    """The first run the resumes start from: it saves checkpoint-4 and checkpoint-8."""
    seed_everything(0)
    output_dir = harness.OUT / "resume_first"
    train("resume_first", resume_guard(), *seeded_split(), TimeLimit(), max_steps=RESUME_STEPS)
    COUNTERS["saved"] = {
        p.name: sorted(f.name for f in p.iterdir()) for p in sorted(output_dir.iterdir())
    }


def resume_healthy() -> None:
    """``resume_from_checkpoint=True`` in the first run's folder (shared by the ranks)."""
    seed_everything(0)
    output_dir = harness.OUT / "resume_first"
    train(
        "resume_healthy",
        resume_guard(),
        *seeded_split(),
        StepsRun(),
        output_dir=output_dir,
        resume=True,
        max_steps=RESUME_STEPS,
    )


def resume_lagging_copy() -> None:
    """Each rank plays a node that resumes from its own copy of the first run's folder
    (copied to its local disk before the restart); node 1's copy lags: no checkpoint-8."""
    rank = dist.get_rank()
    source = harness.OUT / "resume_first"
    with own_node(rank, harness.OUT / f"lag_node{rank}") as disk:
        lagging = {"checkpoint-8"} if rank == 1 else set()
        shutil.copytree(
            source,
            disk / "out",
            ignore=lambda d, names: lagging & set(names) if Path(d) == source else [],
        )
        copied = sorted(p.name for p in (disk / "out").iterdir())
        seed_everything(0)
        try:
            train(
                "resume_lagging_copy",
                resume_guard(),
                *seeded_split(),
                StepsRun(),
                output_dir=disk / "out",
                resume=True,
                max_steps=RESUME_STEPS,
            )
        finally:
            COUNTERS["copied"] = copied


class ShardStream(IterableDataset):
    """This rank's own shard of a token stream, read from where its state says.

    It keeps its place (``state_dict``: the shard and the row) and drops rows whose first
    token is below 6 (the user's filter), so each shard's row differs after the same batches.
    """

    def __init__(self, rank: int) -> None:
        self.shard, self.row = f"shard-{rank}", 0

    def __iter__(self):
        while True:
            gen = torch.Generator().manual_seed(1000 * int(self.shard[6:]) + self.row)
            ids = torch.randint(1, VOCAB, (4,), generator=gen).tolist()
            self.row += 1
            if ids[0] >= 6:
                yield {"input_ids": ids, "labels": sum(ids) % 2}

    def state_dict(self) -> dict:
        return {"shard": self.shard, "row": self.row}

    def load_state_dict(self, state: dict) -> None:
        self.shard, self.row = state["shard"], state["row"]


class KeepDataPosition(TrainerCallback):
    """The user's callback (the accelerate#4164 shape): the stream's place in each checkpoint,
    one file written by the main process, read back on every rank at a resume."""

    def __init__(self, dataset: ShardStream) -> None:
        self.dataset = dataset

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (folder / "data_position.json").write_text(json.dumps(self.dataset.state_dict()))

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:  # resumed: the Trainer loaded the checkpoint's state
            folder = Path(get_last_checkpoint(args.output_dir))
            self.dataset.load_state_dict(json.loads((folder / "data_position.json").read_text()))


def resume_data_position() -> None:
    """A first run and its resume, each rank reading its own stream (``dispatch_batches=False``;
    ``ignore_data_skip``: the stream keeps its place itself)."""
    output_dir = harness.OUT / "resume_data_position"
    each_reads_its_own = {
        "accelerator_config": {"dispatch_batches": False},
        "ignore_data_skip": True,
    }
    for resume in (None, True):
        seed_everything(0)
        stream = ShardStream(int(os.environ["RANK"]))  # before the Trainer joins the group
        callbacks = (
            KeepDataPosition(stream),
            StepsRun(),
            *([TimeLimit()] if resume is None else []),
        )
        train(
            "resume_data_position",
            resume_guard(),
            stream,
            seeded_split()[1],
            *callbacks,
            output_dir=output_dir,
            resume=resume,
            max_steps=RESUME_STEPS,
            **each_reads_its_own,
        )
        COUNTERS["position"] = stream.state_dict()


SCENARIOS = {
    "node_local_resume": node_local_resume,
    "resume_first": resume_first,
    "resume_healthy": resume_healthy,
    "resume_lagging_copy": resume_lagging_copy,
    "resume_data_position": resume_data_position,
}
