"""The Hugging Face Trainer's private names rankguard reads, against the installed transformers.

Each function of ``rankguard.integrations.private.transformers`` runs inside a real
Trainer here (today's transformers 5 and Composer's world's 4.57): a test fails if
the Trainer stops calling its hooks from its own methods or renames the loop's locals.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
pytest.importorskip("transformers", reason="needs rankguard[transformers]")

from transformers import Trainer, TrainerCallback, TrainingArguments

from rankguard.integrations.private.transformers import (
    LoopPosition,
    calling_trainer,
    loop_position,
    trainer_frame,
)
from tests.e2e.common import tiny_bert, token_dataset


def trainer(tmp_path, callback, **args) -> Trainer:
    settings = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "per_device_train_batch_size": 4,
        "max_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        **args,
    }
    return Trainer(
        model=tiny_bert(),
        args=TrainingArguments(**settings),
        train_dataset=token_dataset(16),  # 4 batches an epoch
        callbacks=[callback],
    )


class Reads(TrainerCallback):
    """Records what each private read finds, from the hooks (as the adapter calls them)."""

    def __init__(self) -> None:
        self.found: dict[str, object] = {}
        self.positions: list[LoopPosition] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.found["on_train_begin"] = calling_trainer()

    def on_step_begin(self, args, state, control, **kwargs):
        self.positions.append(self._from_a_method())

    def _from_a_method(self) -> LoopPosition:  # as the adapter's _resumed calls it
        return loop_position()

    def on_step_end(self, args, state, control, **kwargs):
        self.found["on_step_end"] = calling_trainer()


def test_calling_trainer_finds_the_trainer_calling_a_hook(tmp_path):
    reads = Reads()
    hf = trainer(tmp_path, reads)
    hf.train()
    assert reads.found == {"on_train_begin": hf, "on_step_end": hf}
    assert calling_trainer() is None  # not inside a Trainer
    assert trainer_frame(None) is None


def test_loop_position_reads_the_epoch_the_skipped_batches_and_the_epochs_loader(tmp_path):
    reads = Reads()
    hf = trainer(
        tmp_path, reads, max_steps=-1, num_train_epochs=2, save_strategy="steps", save_steps=2
    )
    hf.train()
    assert [p.epoch for p in reads.positions] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {p.skipped for p in reads.positions} == {0}  # a fresh start skips nothing
    assert all(hasattr(p.loader, "__iter__") for p in reads.positions)
    assert len(reads.positions[0].loader) == 4

    # Resumed from step 2 of the first epoch: the loop skips 2 batches, from a loader
    # that starts at the third (skip_first_batches), not the train loader.
    reads.positions.clear()
    hf.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    first = reads.positions[0]
    assert (first.epoch, first.skipped) == (0, 2)
    assert first.loader is not None and len(list(iter(first.loader))) == 2


def test_loop_position_outside_a_trainer_finds_nothing():
    assert loop_position() == LoopPosition(epoch=-1, skipped=None, loader=None)
