"""The Lightning adapter's decisions, each a pure function (``rankguard.integrations.lightning``).

Read from stand-ins for Lightning's objects: each function reads only the public
attributes named here. ``tests/integrations/test_adapters.py`` has the loaders'
names and counts (``_flatten``, ``_planned``) and ``resume_folder``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")

from rankguard.integrations.lightning.adapter import unsupported
from rankguard.integrations.lightning.facts import (
    data_parallel,
    first_optimizer,
    fit_loaders,
    position,
    val_batch,
)
from rankguard.integrations.lightning.words import ENFORCE_UNSUPPORTED


def trainer(val=None, planned=(), sanity=(), sanity_checking=False, optimizers=()):
    return SimpleNamespace(
        val_dataloaders=val,
        num_val_batches=list(planned),
        num_sanity_val_batches=list(sanity),
        sanity_checking=sanity_checking,
        optimizers=list(optimizers),
    )


def test_lightning_refuses_only_an_enforced_drop_last():
    def guard(name, **settings):
        return SimpleNamespace(name=name, **settings)

    assert unsupported([guard("hang_watchdog"), guard("drop_last_guard", mode="check")]) is None
    assert unsupported([guard("batch_parity_guard", mode="enforce")]) is None
    assert unsupported([guard("drop_last_guard")]) is None  # a guard without the setting
    enforced = [guard("hang_watchdog"), guard("drop_last_guard", mode="enforce")]
    assert unsupported(enforced) == ENFORCE_UNSUPPORTED
    assert unsupported([]) is None


def test_fit_start_knows_the_train_loader_then_each_val_loader_lightning_loaded():
    train = SimpleNamespace(name="train")
    assert fit_loaders(trainer(), train) == [train]  # val not loaded yet: EVAL_START checks it
    assert fit_loaders(trainer(), None) == []
    a, b = object(), object()
    loaders = fit_loaders(trainer(val=[a, b], planned=[2, float("inf")]), train)
    assert loaders[0] is train
    assert [(f.name, f.loader, f.num_batches, f.is_train) for f in loaders[1:]] == [
        ("val/0", a, 2, False),
        ("val/1", b, None, False),
    ]
    # After the sanity check: its own planned counts.
    (val,) = fit_loaders(trainer(val=a, planned=[5], sanity=[1], sanity_checking=True), None)
    assert (val.name, val.num_batches) == ("val", 1)


def test_a_val_batch_names_its_loader_or_none_past_the_known_ones():
    first, second = SimpleNamespace(name="val/0"), SimpleNamespace(name="val/1")
    assert val_batch([first, second], 1, 7) == {"loader": second, "batch_index": 7}
    assert val_batch([first], 0, 0) == {"loader": first, "batch_index": 0}
    assert val_batch([first], 1, 3) == {"loader": None, "batch_index": 3}
    assert val_batch([], 0, 3) == {"loader": None, "batch_index": 3}


def test_the_guards_read_the_first_optimizer():
    sgd, adam = object(), object()
    assert first_optimizer(trainer(optimizers=[sgd, adam])) is sgd
    assert first_optimizer(trainer()) is None


def test_the_replica_check_reads_the_strategys_wrapper_of_the_module():
    wrapper = object()  # a DistributedDataParallel under strategy="ddp"
    assert data_parallel(SimpleNamespace(strategy=SimpleNamespace(model=wrapper))) is wrapper


def test_an_error_is_placed_at_the_trainers_step_and_epoch_or_zero():
    assert position(SimpleNamespace(global_step=12, current_epoch=3)) == (12, 3)
    assert position(None) == (0, 0)  # an exception hook is handed whatever the trainer is
    assert position(SimpleNamespace(global_step=4)) == (4, 0)
