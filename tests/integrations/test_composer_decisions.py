"""What the Composer adapter decides (``rankguard.integrations.composer.decisions``).

``loss_keys``, ``loss_rows``, ``countable`` and ``resumed_from`` are tested in
``tests/integrations/test_adapters.py``; here, whether a save is due (Composer's
world only).
"""

from __future__ import annotations

import pytest
import torch

composer = pytest.importorskip("composer")

from composer.callbacks import CheckpointSaver  # noqa: E402
from composer.core import Event, State  # noqa: E402
from composer.devices import DeviceCPU  # noqa: E402
from composer.models import ComposerClassifier  # noqa: E402

from rankguard.integrations.composer.decisions import saves_at  # noqa: E402


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
