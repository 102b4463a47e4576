"""What the Composer adapter decides (``rankguard.integrations.composer.decisions``).

``loss_keys``, ``loss_rows``, ``countable`` and ``resumed_from`` are tested in
``tests/integrations/test_adapters.py``; here, whether a save is due and which
exception is ending the run (Composer's world only).
"""

from __future__ import annotations

import sys

import pytest
import torch

composer = pytest.importorskip("composer")

from composer.callbacks import CheckpointSaver  # noqa: E402
from composer.core import Event, State  # noqa: E402
from composer.devices import DeviceCPU  # noqa: E402
from composer.models import ComposerClassifier  # noqa: E402

from rankguard.integrations.composer.decisions import (  # noqa: E402
    escaping_exception,
    saves_at,
    unsaved_at_stop,
)


class Saver:
    """A checkpoint saver whose ``save_interval`` answers as told, and records who asked."""

    def __init__(self, answer: bool, asked: list[Saver]) -> None:
        self.answer, self.asked = answer, asked

    def save_interval(self, state, event) -> bool:
        self.asked.append(self)
        return self.answer


def test_a_save_is_due_when_a_saver_says_so_and_the_rest_are_not_asked():
    asked: list[Saver] = []
    no, yes, later = Saver(False, asked), Saver(True, asked), Saver(True, asked)
    assert saves_at([no, yes, later], None, Event.BATCH_CHECKPOINT)
    assert asked == [no, yes]  # stops at the first that saves
    assert not saves_at([no], None, Event.BATCH_CHECKPOINT)
    assert not saves_at([], None, Event.BATCH_CHECKPOINT)


def test_asking_composers_saver_first_leaves_its_own_answer_as_it_was(tmp_path):
    saver = CheckpointSaver(folder=str(tmp_path), save_interval="2ba")
    model = ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2)
    state = State(
        model=model,
        rank_zero_seed=0,
        run_name="r",
        device=DeviceCPU(),
        callbacks=[saver],
        max_duration="8ba",
    )
    seen = []
    for _ in range(4):  # Composer's BATCH_CHECKPOINT after each batch
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_batch(samples=4, tokens=0)
        due = saves_at([saver], state, Event.BATCH_CHECKPOINT)  # rankguard asks first
        assert saver.save_interval(state, Event.BATCH_CHECKPOINT) is due  # then the saver
        seen.append((int(state.timestamp.batch), due))
    assert seen == [(1, False), (2, True), (3, False), (4, True)]


def test_an_agreed_stop_makes_its_batch_the_end_of_training_where_a_time_string_saver_saves(
    tmp_path,
):
    interval = CheckpointSaver(folder=str(tmp_path / "a"), save_interval="100ba")
    custom = CheckpointSaver(folder=str(tmp_path / "b"), save_interval=lambda state, event: False)
    state = State(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        rank_zero_seed=0,
        run_name="r",
        device=DeviceCPU(),
        callbacks=[interval, custom],
        max_duration="8ba",
    )
    for _ in range(3):
        state.previous_timestamp = state.timestamp
        state.timestamp = state.timestamp.to_next_batch(samples=4, tokens=0)
    assert not interval.save_interval(state, Event.BATCH_CHECKPOINT)  # 3 of 8: no save
    state.stop_training()  # the adapter's call at the agreed BATCH_END
    assert interval.save_interval(state, Event.BATCH_CHECKPOINT)  # the end of training
    interval.last_checkpoint_batch = state.timestamp.batch  # as its save records it
    assert unsaved_at_stop([interval, custom], 3) == [custom]
    assert unsaved_at_stop([interval], 4) == [interval]


def test_the_exception_ending_the_run_is_the_one_being_handled_else_the_last_one(monkeypatch):
    for name in ("last_exc", "last_value"):  # pytest keeps a failed test's error there
        monkeypatch.delattr(sys, name, raising=False)
    assert escaping_exception() is None  # close() after a fit that ended well
    handled = RuntimeError("in fit")
    try:
        raise handled
    except RuntimeError:  # the caller's `finally: trainer.close()`
        assert escaping_exception() is handled
    printed = ValueError("printed at exit")  # atexit: Python kept the traceback's error
    monkeypatch.setattr(sys, "last_value", printed, raising=False)
    assert escaping_exception() is printed
    newer = KeyError("3.12's sys.last_exc")
    monkeypatch.setattr(sys, "last_exc", newer, raising=False)
    assert escaping_exception() is newer
