"""A hand-written training loop that fires rankguard's events, for the straggler tests.

Used by ``tests/straggler/test_straggler.py`` (2 ranks through ``run_ranks``) and
``tests/e2e/straggler_nodes_worker.py`` (simulated nodes under torchrun): a
real DDP or FSDP2 model on gloo, its forward taking a set time (see
``tests/e2e/straggler_common.py`` for why a sleep), driven through a
``GuardRunner`` as an adapter would drive it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rankguard.callbacks import Event, EventFacts, Guard, GuardRunner, StragglerError


class Sleeps(torch.nn.Module):
    """A Linear whose forward also takes ``delay_s`` (a slower device, as the host sees it)."""

    def __init__(self, delay_s: float = 0.0, width: int = 4) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.lin(x)


def ddp(delay_s: float) -> torch.nn.Module:
    """A DDP model whose forward takes ``delay_s``."""
    from torch.nn.parallel import DistributedDataParallel

    # BatchNorm's buffers make DDP broadcast them at the start of every forward: a rank
    # that reaches it early waits there for the others.
    return DistributedDataParallel(torch.nn.Sequential(torch.nn.BatchNorm1d(4), Sleeps(delay_s)))


def fsdp2(delay_s: float) -> torch.nn.Module:
    """Three blocks, each its own FSDP2 unit: each all-gathers its weights in its forward."""
    from torch.distributed.fsdp import fully_shard

    blocks = [torch.nn.Sequential(Sleeps(delay_s / 3), torch.nn.ReLU()) for _ in range(3)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(4, 4))
    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


class RootClock:
    """Times the whole model's forward, FSDP's all-gathers inside: what the monitor avoids."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total_s, self._start = 0.0, 0.0
        model.register_forward_pre_hook(self.enter, prepend=True)
        model.register_forward_hook(self.leave)

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        self._start = time.perf_counter()

    def leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.total_s += time.perf_counter() - self._start


class Records(logging.Handler):
    """rankguard's records (warning and above) with the batch they came at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.batch = 0
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.batch, record.getMessage()))


def train(
    guards: list[Guard], model: torch.nn.Module, *, steps: int, slow_data_s: float = 0.0
) -> dict[str, Any]:
    """Trains ``steps`` batches; each fetch first sleeps ``slow_data_s`` (slow reads).

    Returns:
        The outcome (``"ok"`` or ``"StragglerError at batch N: ..."``), the
        records as ``(batch, message)``, the metrics rankguard logged, and the
        mean time of the whole model's forward (``root_s``).
    """
    torch.manual_seed(0)
    root = RootClock(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    runner = GuardRunner(guards, exchange_timeout_s=60)
    records = Records()
    logging.getLogger("rankguard").addHandler(records)
    metrics: list[dict] = []
    outcome = "ok"
    try:
        runner.fire(Event.FIT_START, EventFacts(model=model, optimizer=optimizer), metrics.append)
        for step in range(steps):
            records.batch = step + 1
            facts = EventFacts(step=step)
            runner.fire(Event.DATA_FETCH_START, facts)
            time.sleep(slow_data_s)
            runner.fire(Event.DATA_FETCH_END, facts)
            runner.fire(Event.TRAIN_BATCH_START, facts)
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            runner.fire(Event.TRAIN_BATCH_END, facts)
        runner.fire(Event.FIT_END, EventFacts(step=steps))
    except StragglerError as exc:
        outcome = f"StragglerError at batch {records.batch}: {exc}"
    finally:
        runner.close()
        logging.getLogger("rankguard").removeHandler(records)
    return {
        "outcome": outcome,
        "records": records.records,
        "metrics": metrics,
        "root_s": root.total_s / steps,
    }
