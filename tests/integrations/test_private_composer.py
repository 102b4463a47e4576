"""Every private name of Composer rankguard reads, against the installed Composer.

Each test fails if Composer renames or moves what a function of
``rankguard.integrations.private.composer`` reads (Composer's world only).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.e2e.common import Points

composer = pytest.importorskip("composer")

from composer import Trainer  # noqa: E402
from composer.core import Callback, Event  # noqa: E402
from composer.models import ComposerClassifier  # noqa: E402

from rankguard.integrations.private import composer as private  # noqa: E402


class Reads(Callback):
    """Records what each reach returns at INIT and BEFORE_LOAD."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def init(self, state, logger) -> None:
        self.seen["trainer"] = private.constructing_trainer()

    def before_load(self, state, logger) -> None:
        self.seen["load_path"] = private.trainer_load_path()
        self.seen["resume"] = private.resume_request()


def trainer(callbacks, **kwargs):
    return Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=DataLoader(Points(8), batch_size=4),
        max_duration="2ba",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=callbacks,
        **kwargs,
    )


def test_the_trainer_under_construction_and_its_arguments_are_read_from_its_init(tmp_path):
    first = trainer([], save_folder=str(tmp_path), save_interval="2ba")
    first.fit()
    first.close()
    path = str(tmp_path / "ep0-ba2-rank0.pt")

    reads = Reads()
    resumed = trainer([reads], load_path=path)
    assert reads.seen["trainer"] is resumed
    assert reads.seen["load_path"] == path
    assert reads.seen["resume"] == (f"load_path={path!r}", None)
    resumed.close()

    reads = Reads()
    auto = trainer([reads], save_folder=str(tmp_path), autoresume=True, run_name="r")
    assert reads.seen["trainer"] is auto
    assert reads.seen["resume"] == ("autoresume=True", str(tmp_path))
    auto.close()


def test_nothing_is_read_outside_a_trainer_init():
    assert private.constructing_trainer() is None
    assert private.trainer_load_path() is None
    assert private.resume_request() is None
    assert private.trainer_init_locals() == {}


def test_an_event_value_is_read_from_the_member_itself():
    # run_event tests `event._value_` inline: it must be the member's own value string.
    for event in Event:
        assert vars(event)[private.EVENT_VALUE] == event.value
        assert getattr(event, private.EVENT_VALUE) is event._value_
    assert [private.event_value(e) for e in (Event.BATCH_START, Event.AFTER_LOSS)] == [
        "batch_start",
        "after_loss",
    ]
