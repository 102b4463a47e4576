"""What every Lightning scenario shares: the launch's state, data, modules, a fresh Trainer.

``OUT`` is set by ``tests/e2e/lightning_job.py`` (read it as ``harness.OUT``); ``COUNTERS`` is
what a scenario records beside its outcome. A concern's ``setup(names)`` returns how one of its
scenarios runs into its record: an :data:`Outcome`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import (
    DataLoader,
    TensorDataset,
)

from tests.e2e.common import WarningCollector

OUT = ""  # the output folder given on the command line
COUNTERS: dict[str, Any] = {}
#: A scenario's record, and the error it raised (re-raised when it was the launch's last).
Outcome = tuple[dict[str, Any], BaseException | None]
BATCH = 4


def dataset(n: int, own: bool = False) -> TensorDataset:
    """``n`` samples, the same on every rank; ``own``: this rank's own (its shard)."""
    rank = int(os.environ.get("LOCAL_RANK", "0")) if own else -1
    g = torch.Generator().manual_seed(n + 1000 * (rank + 1))
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int, shared: bool = False, **kwargs: Any) -> DataLoader:
    """Each rank's own ``n`` samples (the Trainer adds no sampler by default, see
    :func:`trainer`); ``shared``: the same on every rank (for a DistributedSampler)."""
    return DataLoader(dataset(n, own=not shared), batch_size=BATCH, **kwargs)


def trainer(callbacks: list[L.Callback], **settings: Any) -> L.Trainer:
    """A Trainer on 2 CPU ranks (ddp), 1 epoch; each rank's own data unless ``settings`` say."""
    defaults = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp",
        "max_epochs": 1,
        "use_distributed_sampler": False,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(callbacks=callbacks, **{**defaults, **settings})


class TinyModule(L.LightningModule):
    """Linear(4, 1) that counts its steps and logs val loss (``sync_dist=True`` by default)."""

    def __init__(self, sync_dist: bool = True) -> None:
        super().__init__()
        self.sync_dist = sync_dist
        self.layer = torch.nn.Linear(4, 1)
        self.train_steps = 0
        self.val_steps = 0
        self.sanity_val_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_steps += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.trainer.sanity_checking:
            self.sanity_val_steps += 1
        else:
            self.val_steps += 1
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("val_loss", loss, sync_dist=self.sync_dist)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SkipsStepModule(TinyModule):
    """Manual optimization with Adam; rank 1 skips ``optimizer.step()`` at its second batch.

    As a per-rank check does where it decides alone (its loss was not finite, say): the
    gradients were all-reduced in the backward, but rank 1 does not apply them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_steps += 1
        optimizer = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        if not (self.global_rank == 1 and batch_idx == 1):
            optimizer.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class MetricsRecorder(Logger):
    """A real Lightning logger that keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        del params, args, kwargs

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def kept(self, prefix: str) -> list[list[Any]]:
        """``[step, metrics]`` of each call that logged a metric named ``prefix...``."""
        return [
            [step, {k: v for k, v in m.items() if k.startswith(prefix)}]
            for step, m in self.calls
            if any(k.startswith(prefix) for k in m)
        ]


@dataclass
class Scenario:
    """One fit: callbacks, per-rank (train, val) loaders, Trainer settings, the module."""

    callbacks: Callable[[], list[L.Callback]]
    loaders: Callable[[int], tuple[Any, Any]]
    trainer: dict[str, Any] = field(default_factory=dict)
    module: Callable[[], TinyModule] = TinyModule


class NamedWarnings(logging.Handler):
    """Collects every rankguard warning as ``logger: message``, raised errors' too."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def run_fit(name: str, scenario: Scenario, data: bool) -> tuple[dict, BaseException | None]:
    """Fits ``scenario``; records the outcome, warnings, steps run and metrics.

    ``data`` (the data scenarios): Lightning's DistributedSampler unless the
    scenario says otherwise, rankguard's logged metrics, warnings without the
    errors raised; else the callback metrics, named warnings and the time taken.
    """
    metrics = MetricsRecorder()
    settings = {"use_distributed_sampler": True, "logger": metrics} if data else {}
    job = trainer(scenario.callbacks(), **{**settings, **scenario.trainer})
    rank = job.global_rank
    module = scenario.module()
    train, val = scenario.loaders(rank)
    capture = WarningCollector() if data else NamedWarnings()
    logging.getLogger("rankguard").addHandler(capture)
    record: dict[str, Any] = {"outcome": "ok"} if data else {"scenario": name, "outcome": "ok"}
    started = time.monotonic()
    error: BaseException | None = None
    try:
        job.fit(module, train, val)
    except Exception as exc:
        error = exc
        record.update(outcome="error", error_type=type(exc).__name__, error=str(exc))
    finally:
        logging.getLogger("rankguard").removeHandler(capture)
    record.update(
        rank=job.global_rank,
        warnings=capture.messages,
        train_steps=module.train_steps,
        val_steps=module.val_steps,
        sanity_val_steps=module.sanity_val_steps,
    )
    if data:
        record["metrics"] = metrics.kept("rankguard/")
    else:
        record["metrics"] = {k: float(v) for k, v in job.callback_metrics.items()}
        record["elapsed_s"] = round(time.monotonic() - started, 3)
    return record, error


def rank() -> int:
    """This process's global rank: torchrun's, else the one Lightning's launcher gave it."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
