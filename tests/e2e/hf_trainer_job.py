"""The Hugging Face ``Trainer`` (a 2-layer BERT built from a config) with rankguard, on 2 ranks.

Usage::

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 2 tests/e2e/hf_trainer_job.py \
        OUT_DIR SCENARIO...

Each scenario is a fresh model and ``Trainer`` in the same two processes;
outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see ``tests/e2e/common.py``).
``post_eval_stall`` never returns (the watchdog ends every rank with exit code
75), nor does ``early_stop_one_rank`` (a proven deadlock: exit code 70), so either
must come last; rank 1 writes the moment its stall starts to ``OUT_DIR/stall.json``,
rank 0 the moment it decides to stop to ``OUT_DIR/split.json``. ``data_check_raises``
(rank 1's data check raises at step 6, then its teardown waits) ends the job (exit
code 70), so it runs alone; rank 1 writes the moment it raises to ``OUT_DIR/raised.json``,
each rank its pid to ``OUT_DIR/pid{N}``. Nothing needs the network: the model is built
from a config.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import IterableDataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import (
    VOCAB,
    own_node,
    rankguard_off,
    run_scenarios,
    seed_everything,
    seeded_split,
    tiny_bert,
    token_dataset,
    unseeded_split,
)
from tests.e2e.hang_settings import HANG


def _cpu_map_location(load):
    """transformers 4 loads a multi-rank resume's optimizer with ``map_location=args.device``,
    which a CPU-only gloo run (staging only; on GPUs it is ``cuda:N``) has as ``cpu:0``, a
    location torch 2.7 cannot restore: here it is ``cpu``."""

    def load_on_cpu(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    return load_on_cpu


if transformers.__version__ < "5":
    torch.load = _cpu_map_location(torch.load)

COUNTERS: dict[str, Any] = {}
OUT = Path(".")
QUICK = {"hang_watchdog": {"exchange_period_s": 0.5}}


class Count(TrainerCallback):
    """Counts the optimizer steps and eval batches that actually ran on this rank."""

    def on_step_begin(self, args, state, control, **kwargs):
        COUNTERS["steps"] = COUNTERS.get("steps", 0) + 1

    def on_prediction_step(self, args, state, control, **kwargs):
        COUNTERS["eval_batches"] = COUNTERS.get("eval_batches", 0) + 1

    def on_save(self, args, state, control, **kwargs):
        COUNTERS["saves"] = COUNTERS.get("saves", 0) + 1


class StallAfterEval(TrainerCallback):
    """The bug: rank 1 never comes back from its first evaluation (here a sleep)."""

    def on_evaluate(self, args, state, control, **kwargs):
        if dist.get_rank() == 1:
            (OUT / "stall.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
            while True:
                time.sleep(3600)


def train(
    name: str,
    guard: RankGuard | None,
    train_set,
    eval_set,
    *extra: TrainerCallback,
    output_dir: Path | None = None,
    resume: bool | None = None,
    trainer_class: type[Trainer] = Trainer,
    max_steps: int = 6,
    model: Any = None,
    **settings: Any,
) -> None:
    """Evaluates every 3 steps and saves every 4, for 6 steps (one epoch of 48 samples).

    ``trainer_class``: the user's subclass; ``max_steps``: more steps (a second epoch);
    ``model``: the user's own (default: :func:`tiny_bert`); ``settings``: more
    ``TrainingArguments``.
    """
    COUNTERS.clear()
    args = TrainingArguments(
        output_dir=str(output_dir or OUT / name),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=max_steps,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=4,
        logging_steps=2,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **settings,
    )
    trainer = trainer_class(
        model=tiny_bert() if model is None else model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        callbacks=[c for c in (guard, Count(), *extra) if c is not None],
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        if guard is not None:
            guard.close()  # the Trainer calls no hook when train() raises
    logged = [key for entry in trainer.state.log_history for key in entry]
    COUNTERS["rankguard_keys_logged"] = sorted({k for k in logged if k.startswith("rankguard/")})


def healthy() -> None:
    seed_everything(0)
    train("healthy", RankGuard(**QUICK), *seeded_split())


def unseeded() -> None:
    train_set, eval_set = unseeded_split(64, test_size=0.25)  # before the Trainer seeds anything
    train("unseeded_split", RankGuard(**QUICK), train_set, eval_set)


def uneven_eval() -> None:
    # Each rank built its own eval set (16 and 32 samples): 2 and 4 eval batches.
    eval_set = token_dataset(16 if dist.get_rank() == 0 else 32)
    guard = RankGuard(data_consistency_guard=False, **QUICK)
    train("uneven_eval", guard, seeded_split()[0], eval_set)


def node_local_resume() -> None:
    """Each rank plays a node whose local disk is ``hf_node<r>/``: a save, then a resume."""
    rank = dist.get_rank()
    with own_node(rank, OUT / f"hf_node{rank}") as disk:
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


class EMAOnMainProcess(TrainerCallback):
    """The bug: an EMA of the classifier kept in the model, updated "on the main process only".

    ``model.ema`` holds ``requires_grad=False`` copies of the classifier's weights, which DDP
    copies to every rank when it wraps the model and never again; rank 0 alone updates them.
    """

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            with torch.no_grad():
                for average, param in zip(
                    model.ema.parameters(), model.classifier.parameters(), strict=True
                ):
                    average.lerp_(param, 0.1)


def ema_rank0() -> None:
    """A 6-step fit whose EMA rank 0 alone updates; a replica check at every step."""
    import copy

    seed_everything(0)
    model = tiny_bert()
    model.ema = copy.deepcopy(model.classifier).requires_grad_(False)
    guard = RankGuard(replica_guard={"interval": 1}, **QUICK)
    train("replica_ema_rank0", guard, *seeded_split(), EMAOnMainProcess(), model=model)


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
    output_dir = OUT / "resume_first"
    train("resume_first", resume_guard(), *seeded_split(), TimeLimit(), max_steps=RESUME_STEPS)
    COUNTERS["saved"] = {
        p.name: sorted(f.name for f in p.iterdir()) for p in sorted(output_dir.iterdir())
    }


def resume_healthy() -> None:
    """``resume_from_checkpoint=True`` in the first run's folder (shared by the ranks)."""
    seed_everything(0)
    output_dir = OUT / "resume_first"
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
    source = OUT / "resume_first"
    with own_node(rank, OUT / f"lag_node{rank}") as disk:
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
    output_dir = OUT / "resume_data_position"
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


def straggler() -> None:
    """Rank 1's forward takes 1.5x as long (tests/e2e/straggler_common.py), 20 steps."""
    import torch

    from tests.e2e.straggler_common import BATCHES, STRAGGLER, forward_delay

    COUNTERS.clear()
    seed_everything(0)
    torch.set_num_threads(1)  # two ranks on two shared cores
    model = tiny_bert()
    # Its tiny BERT's own forward takes 5-10 ms on these cores, not always alike on both:
    # 80 ms against 120 ms keeps the score what the 1.5x says (0.67; 0.69 at 6.5 and 5 ms).
    delay = forward_delay(dist.get_rank(), slow=True, base_s=0.08)
    # Inside the model's forward: its embeddings take the time a bigger model would.
    model.bert.embeddings.register_forward_pre_hook(lambda module, args: time.sleep(delay))
    args = TrainingArguments(
        output_dir=str(OUT / "straggler"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        max_steps=BATCHES,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=4,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    guard = RankGuard(straggler_monitor=STRAGGLER, **QUICK)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(4 * 2 * BATCHES))
    trainer.add_callback(guard)
    try:
        trainer.train()
    finally:
        guard.close()
    logged = [key for entry in trainer.state.log_history for key in entry]
    COUNTERS["rankguard_keys_logged"] = sorted({k for k in logged if k.startswith("rankguard/")})


def post_eval_stall() -> None:
    settings = {**HANG, "report_dir": str(OUT / "reports")}
    train("post_eval_stall", RankGuard(hang_watchdog=settings), *seeded_split(), StallAfterEval())


class StopOnRank0(TrainerCallback):
    """The bug (transformers #17478): early stopping decided on rank 0 alone, at step 3.

    As ``EarlyStoppingCallback`` does when the metric it reads was not gathered.
    """

    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() == 0 and state.global_step == 3:
            (OUT / "split.json").write_text(json.dumps({"rank": 0, "t": time.time()}))
            control.should_training_stop = True


def early_stop_one_rank() -> None:
    """``RankGuard()`` with every setting at its default; reports in ``./rankguard_reports``."""
    seed_everything(0)
    train_set, _ = seeded_split()
    args = TrainingArguments(
        output_dir=str(OUT / "early_stop_one_rank"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        max_steps=12,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    guard = RankGuard()
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=train_set, callbacks=[guard, StopOnRank0()]
    )
    try:
        trainer.train()
    finally:
        guard.close()
    (OUT / f"train_returned{dist.get_rank()}.json").write_text(json.dumps({"t": time.time()}))


def check_batch(batch: dict, step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if dist.get_rank() == 1 and step == 6:
        (OUT / "raised.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckedTrainer(Trainer):
    """A Trainer whose train step first checks the batch (the user's subclass)."""

    def training_step(self, model, inputs, *args, **kwargs):
        check_batch(inputs, self.state.global_step)
        return super().training_step(model, inputs, *args, **kwargs)


def destroy_process_group_waits() -> None:
    """NCCL's communicator teardown waiting for a peer (here a long sleep): the process stays."""
    time.sleep(600)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6 (after the eval at step 6);
    rank 0 goes on into its next collective; rank 1's teardown (the script's ``finally``)
    then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default.
    """
    (OUT / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))  # before the process group
    seed_everything(0)
    watchdog = {"report_dir": str(OUT / "reports_data_check_raises"), "teardown_timeout_s": 3}
    guard = None if rankguard_off() else RankGuard(hang_watchdog=watchdog)
    checked = {"trainer_class": CheckedTrainer, "max_steps": 8}  # evals at steps 3 and 6
    try:
        train("data_check_raises", guard, *seeded_split(), **checked)
    finally:
        destroy_process_group_waits()


SCENARIOS = {
    "healthy": healthy,
    "unseeded_split": unseeded,
    "uneven_eval": uneven_eval,
    "node_local_resume": node_local_resume,
    "replica_ema_rank0": ema_rank0,
    "resume_first": resume_first,
    "resume_healthy": resume_healthy,
    "resume_lagging_copy": resume_lagging_copy,
    "resume_data_position": resume_data_position,
    "straggler": straggler,
    "post_eval_stall": post_eval_stall,
    "early_stop_one_rank": early_stop_one_rank,
    "data_check_raises": data_check_raises,
}


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    run_scenarios(SCENARIOS, COUNTERS)


if __name__ == "__main__":
    main()
