"""What every Composer scenario shares: the launch's state, the ranks, a fresh Trainer.

``OUT`` and ``SCENARIO`` are set by ``tests/e2e/composer_job.py`` (read them as
``harness.OUT``); ``COUNTERS`` is what a scenario records beside its outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from composer import Callback, Evaluator, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import (
    DataLoader,
    Dataset,
)

from tests.e2e.common import Points

OUT = ""  # the output folder given on the command line
SCENARIO = ""  # the scenario running
COUNTERS: dict[str, Any] = {}
BATCH = 4


def rank() -> int:
    return dist.get_global_rank()


def per_rank(n_rank0: int, n_rank1: int) -> int:
    return n_rank0 if rank() == 0 else n_rank1


def count(key: str) -> None:
    COUNTERS[key] = COUNTERS.get(key, 0) + 1


class CountBatches(Callback):
    """Counts the train and eval batches that started on this rank."""

    def batch_start(self, state: Any, logger: Any) -> None:
        count("train_batches")

    def eval_batch_start(self, state: Any, logger: Any) -> None:
        count("eval_batches")


def sharded(data: Dataset | int, batch_size: int = BATCH, sampler=None, **kwargs) -> DataLoader:
    """``data`` (``Points(data)`` for a number) sharded over the ranks (or by ``sampler``)."""
    data = Points(data) if isinstance(data, int) else data
    sampler = sampler or dist.get_sampler(data)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, **kwargs)


def trainer(
    train: DataLoader,
    callbacks: list[Callback],
    eval_loader: DataLoader | None = None,
    net: Callable[[], torch.nn.Module] = lambda: torch.nn.Linear(4, 2),
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    classifier: type[ComposerClassifier] = ComposerClassifier,
    **settings: Any,
) -> Trainer:
    """A fresh Trainer of ``net()`` (seeded) on CPU; a callback with a ``trainer`` gets it."""
    COUNTERS.clear()
    torch.manual_seed(0)
    model = classifier(net(), num_classes=2)
    if eval_loader is not None:
        settings = {"eval_interval": "1ep", **settings}
        settings["eval_dataloader"] = Evaluator(label="eval", dataloader=eval_loader)
    job = Trainer(
        model=model,
        optimizers=optimizer(model.parameters()) if optimizer else None,
        train_dataloader=train,
        callbacks=callbacks,
        **{"max_duration": "1ep", "loggers": [], **settings},
        device="cpu",
        progress_bar=False,
        log_to_console=False,
    )
    for callback in callbacks:
        if hasattr(callback, "trainer"):
            callback.trainer = job
    return job


def fit(*args: Any, **kwargs: Any) -> None:
    """Fits :func:`trainer` and closes it."""
    job = trainer(*args, **kwargs)
    try:
        job.fit()
    finally:
        job.close()
