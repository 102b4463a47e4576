"""Hangs and desyncs: a rank stalled after eval, early stopping decided on rank 0 alone, a
data check that raises on one rank (each ends the job, so it comes last)."""

from __future__ import annotations

import json
import os
import time

import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from rankguard.integrations.transformers import RankGuard
from tests.e2e.common import (
    destroy_process_group_waits,
    gloo_training_args,
    rankguard_off,
    seed_everything,
    seeded_split,
    tiny_bert,
)
from tests.e2e.hang_settings import HANG
from tests.e2e.hf_trainer_concerns import harness
from tests.e2e.hf_trainer_concerns.harness import train


class StallAfterEval(TrainerCallback):
    """The bug: rank 1 never comes back from its first evaluation (here a sleep)."""

    def on_evaluate(self, args, state, control, **kwargs):
        if dist.get_rank() == 1:
            (harness.OUT / "stall.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
            while True:
                time.sleep(3600)


def post_eval_stall() -> None:
    settings = {**HANG, "report_dir": str(harness.OUT / "reports")}
    train("post_eval_stall", RankGuard(hang_watchdog=settings), *seeded_split(), StallAfterEval())


class StopOnRank0(TrainerCallback):
    """The bug (transformers #17478): early stopping decided on rank 0 alone, at step 3.

    As ``EarlyStoppingCallback`` does when the metric it reads was not gathered.
    """

    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() == 0 and state.global_step == 3:
            (harness.OUT / "split.json").write_text(json.dumps({"rank": 0, "t": time.time()}))
            control.should_training_stop = True


def early_stop_one_rank() -> None:
    """``RankGuard()`` with every setting at its default; reports in ``./rankguard_reports``."""
    seed_everything(0)
    train_set, _ = seeded_split()
    args = gloo_training_args(
        harness.OUT / "early_stop_one_rank",
        per_device_train_batch_size=4,
        max_steps=12,
        eval_strategy="no",
        save_strategy="no",
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
    (harness.OUT / f"train_returned{dist.get_rank()}.json").write_text(
        json.dumps({"t": time.time()})
    )


def check_batch(batch: dict, step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if dist.get_rank() == 1 and step == 6:
        (harness.OUT / "raised.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckedTrainer(Trainer):
    """A Trainer whose train step first checks the batch (the user's subclass)."""

    def training_step(self, model, inputs, *args, **kwargs):
        check_batch(inputs, self.state.global_step)
        return super().training_step(model, inputs, *args, **kwargs)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6 (after the eval at step 6);
    rank 0 goes on into its next collective; rank 1's teardown (the script's ``finally``)
    then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default.
    """
    (harness.OUT / f"pid{os.environ['RANK']}").write_text(
        str(os.getpid())
    )  # before the process group
    seed_everything(0)
    watchdog = {
        "report_dir": str(harness.OUT / "reports_data_check_raises"),
        "teardown_timeout_s": 3,
    }
    guard = None if rankguard_off() else RankGuard(hang_watchdog=watchdog)
    checked = {"trainer_class": CheckedTrainer, "max_steps": 8}  # evals at steps 3 and 6
    try:
        train("data_check_raises", guard, *seeded_split(), **checked)
    finally:
        destroy_process_group_waits()


SCENARIOS = {
    "post_eval_stall": post_eval_stall,
    "early_stop_one_rank": early_stop_one_rank,
    "data_check_raises": data_check_raises,
}
