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
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import (
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
) -> None:
    """Evaluates every 3 steps and saves every 4, for 6 steps (one epoch of 48 samples).

    ``trainer_class``: the user's subclass; ``max_steps``: more steps (a second epoch).
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
    )
    trainer = trainer_class(
        model=tiny_bert(),
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        callbacks=[c for c in (guard, Count(), *extra) if c is not None],
    )
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
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


def straggler() -> None:
    """Rank 1's forward takes 1.5x as long (tests/e2e/straggler_common.py), 20 steps."""
    import torch

    from tests.e2e.straggler_common import BATCHES, STRAGGLER, forward_delay

    COUNTERS.clear()
    seed_everything(0)
    torch.set_num_threads(1)  # two ranks on two shared cores
    model = tiny_bert()
    delay = forward_delay(dist.get_rank(), slow=True)
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
