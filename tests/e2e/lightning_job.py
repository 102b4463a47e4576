"""A real 2-rank Lightning job (CPU, gloo) that runs rankguard scenarios of every concern.

Run: ``python lightning_job.py OUT SCENARIO...`` (Lightning's DDP launcher
re-executes it for rank 1 with the same arguments); the checkpoint scenarios
one torchrun per simulated node (``benchmarks/launch.py::launch_nodes``).

Each scenario is a fresh ``Trainer`` in the same processes. After each, every
rank writes ``OUT/rank<r>.json``: a report whose ``scenarios`` hold each
record, or for the hang and checkpoint scenarios the records alone. A hang
scenario never returns, so it comes last; an error in the last scenario is
re-raised, so the process exits non-zero as a real job would.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
    get_worker_info,
    random_split,
)

from rankguard.callbacks.resume.position import digest
from rankguard.integrations.lightning import (
    BatchParityGuard,
    CheckpointPlanner,
    DataStallMonitor,
    DropLastGuard,
    HangWatchdog,
    RankGuard,
    SharedDirBarrier,
)
from tests.e2e import hang_settings
from tests.e2e.common import Points, Recorder, WarningCollector, own_node, rankguard_off
from tests.e2e.straggler_common import (
    BATCHES,
    STRAGGLER,
    SlowForward,
    SlowReads,
    forward_delay,
)
from tests.e2e.straggler_common import STALL as STRAGGLER_STALL

OUT = ""  # the output folder given on the command line
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


# --- Batch parity and drop_last (test_batches_e2e.py) ---------------------------------------------


class LyingSampler(Sampler[int]):
    """Claims ``claimed`` samples but yields ``actual`` (as a broken streaming sampler does).

    Each batch from sample ``slow_after`` on takes 1.5 s more to fetch.
    """

    def __init__(self, claimed: int, actual: int, slow_after: int | None = None) -> None:
        self.claimed = claimed
        self.actual = actual
        self.slow_after = slow_after

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[int]:
        for i in range(self.actual):
            if self.slow_after is not None and i >= self.slow_after and i % BATCH == 0:
                time.sleep(1.5)
            yield i


def lying_loader(claimed: int, actual: int, slow_after: int | None = None) -> DataLoader:
    sampler = LyingSampler(claimed, actual, slow_after)
    return DataLoader(dataset(max(claimed, actual)), batch_size=BATCH, sampler=sampler)


def per_rank(rank0: int, rank1: int) -> Callable[[int], DataLoader]:
    return lambda rank: loader(rank0 if rank == 0 else rank1)


def fits(
    callbacks: Callable[[], list[L.Callback]],
    train: Callable[[int], Any],
    val: Callable[[int], Any],
    settings: dict[str, Any] | None = None,
    sync_dist: bool = True,
) -> Scenario:
    """A :class:`Scenario` from per-rank train and val loaders."""
    module = functools.partial(TinyModule, sync_dist=sync_dist)
    return Scenario(callbacks, lambda rank: (train(rank), val(rank)), settings or {}, module)


EQUAL = per_rank(16, 16)  # 4 batches on every rank
UNEVEN_VAL = per_rank(8, 16)  # 2 batches on rank 0, 4 on rank 1
NO_SANITY = {"num_sanity_val_steps": 0}

GENERAL: dict[str, Scenario] = {
    # The failure without rankguard: on gloo with one val metric sync per epoch, both
    # ranks finish and nothing says rank 1 ran twice the val batches of rank 0.
    "uneven_val_no_guard": fits(lambda: [], EQUAL, UNEVEN_VAL, NO_SANITY),
    # Healthy runs: equal data, every guard, the sanity check on (2 steps).
    "healthy": fits(lambda: [RankGuard()], EQUAL, EQUAL),
    "healthy_distributed_sampler": fits(
        lambda: [RankGuard()],
        lambda rank: loader(32, shared=True),
        lambda rank: [loader(16, shared=True), loader(24, shared=True)],
        {"use_distributed_sampler": True},
    ),
    # Lightning's DistributedSampler pads a val set of 15 to 16 samples: a warning.
    "eval_padding_distributed_sampler": fits(
        lambda: [RankGuard()],
        lambda rank: loader(32, shared=True),
        lambda rank: loader(15, shared=True),
        {"use_distributed_sampler": True, "num_sanity_val_steps": 0},
    ),
    # Gradient accumulation (Lightning's no_sync on every micro-batch but the last), a
    # replica check at every batch: equal throughout.
    "healthy_accumulation": fits(
        lambda: [RankGuard(replica_guard={"interval": 1})],
        EQUAL,
        EQUAL,
        {"accumulate_grad_batches": 2},
    ),
    # Manual optimization, rank 1 skips its second step: caught at the check after it.
    "replica_skipped_step": Scenario(
        lambda: [RankGuard(replica_guard={"interval": 1})],
        lambda rank: (EQUAL(rank), EQUAL(rank)),
        NO_SANITY,
        SkipsStepModule,
    ),
    # Uneven val batch counts: caught before the first val batch.
    "uneven_val": fits(lambda: [BatchParityGuard()], EQUAL, UNEVEN_VAL, NO_SANITY),
    # Val is first due in epoch 2, so the val loaders are unknown at fit start and the
    # check runs at the start of validation.
    "uneven_val_first_due_in_epoch_2": fits(
        lambda: [BatchParityGuard()],
        EQUAL,
        UNEVEN_VAL,
        {"num_sanity_val_steps": 0, "check_val_every_n_epoch": 2, "max_epochs": 2},
    ),
    "uneven_val_warn": fits(
        lambda: [BatchParityGuard(on_violation="warn")], EQUAL, UNEVEN_VAL, NO_SANITY
    ),
    # With the sanity check (2 steps, equal on both ranks) the val loaders are
    # known at fit start, where the planned counts differ.
    "uneven_val_after_sanity": fits(lambda: [RankGuard()], EQUAL, UNEVEN_VAL),
    "uneven_train": fits(lambda: [BatchParityGuard()], per_rank(16, 24), EQUAL),
    "drop_last_differs": fits(
        lambda: [DropLastGuard()], lambda rank: loader(18, drop_last=rank == 0), EQUAL
    ),
    "drop_last_differs_rankguard": fits(
        lambda: [RankGuard()], lambda rank: loader(18, drop_last=rank == 0), EQUAL
    ),
    # Two val loaders (a list): 2 vs 3 batches, then 2 vs 4 batches.
    "two_val_loaders_uneven": fits(
        lambda: [BatchParityGuard()],
        EQUAL,
        lambda rank: [loader(8 if rank == 0 else 12), loader(8 if rank == 0 else 16)],
    ),
    # Both ranks claim 4 val batches (len 16 samples); rank 0 yields 2, rank 1 yields 4:
    # with the count before the first batch off, caught by the after-eval check with the
    # counts that actually ran.
    "lying_len": fits(
        lambda: [BatchParityGuard(eval_end_timeout_s=5, max_count_samples=0)],
        EQUAL,
        lambda rank: lying_loader(claimed=16, actual=8 if rank == 0 else 16),
        NO_SANITY,
    ),
    # As above, but rank 1 is slow in its extra batches and no val metric is synced (a
    # sync at val epoch end would hold rank 0 until rank 1 is done): rank 0 reaches the
    # after-eval check first and names rank 1 once 0.5 s pass.
    "lying_len_slow_rank": fits(
        lambda: [BatchParityGuard(eval_end_timeout_s=0.5, max_count_samples=0)],
        EQUAL,
        lambda rank: lying_loader(claimed=16, actual=8 if rank == 0 else 16, slow_after=8),
        NO_SANITY,
        sync_dist=False,
    ),
    # Rank 1's sampler yields 4 batches, its __len__ says 2: Lightning stops at the planned
    # count, so rank 1's last 2 would silently never run. Counted before the first batch.
    "lying_len_capped_by_lightning": fits(
        lambda: [BatchParityGuard(eval_end_timeout_s=5)],
        EQUAL,
        lambda rank: lying_loader(claimed=8, actual=8 if rank == 0 else 16),
        NO_SANITY,
    ),
}


# --- Data consistency and stalls (test_data_e2e.py) -----------------------------------------------

STALL = {"threshold": 0.5, "window": 3, "interval": 5}
SLOW_ITEM_S = 0.15  # rank 1's reads in the stall scenario
COMPUTE_S = 0.05  # a training step's compute in the stall scenarios


class ComputingModule(TinyModule):
    """TinyModule whose training step takes ``COMPUTE_S`` longer, like a real model's.

    Lightning's own work between two batches (~1 ms here, more on a busy machine)
    counts as data wait; against the 3 ms step of a 5-parameter model it is a third.
    """

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(COMPUTE_S)
        return super().training_step(batch, batch_idx)


def split_loaders(train_idx: list[int], val_idx: list[int]) -> tuple[DataLoader, DataLoader]:
    """A train/val split of one 64-sample dataset (Lightning adds a DistributedSampler)."""
    data = dataset(64)
    return DataLoader(Subset(data, train_idx), BATCH), DataLoader(Subset(data, val_idx), BATCH)


def numpy_split(rank: int, seed_numpy: bool) -> tuple[DataLoader, DataLoader]:
    """The llama-recipes split: torch is seeded, the numpy shuffle may not be."""
    del rank
    torch.manual_seed(0)
    if seed_numpy:
        random.seed(0)
        np.random.seed(0)
    order = np.random.permutation(64).tolist()
    return split_loaders(order[:48], order[48:])


def torch_random_split(rank: int) -> tuple[DataLoader, DataLoader]:
    """``random_split`` without a generator after torch was seeded per rank."""
    torch.manual_seed(17 + rank)
    train, val = random_split(dataset(64), [48, 16])
    return DataLoader(train, BATCH), DataLoader(val, BATCH)


class SlowOnRank(Dataset):
    """``dataset(n)`` whose items take ``delay_s`` to read on rank ``slow_rank`` only."""

    def __init__(self, n: int, rank: int, slow_rank: int | None) -> None:
        self.data = dataset(n)
        self.delay_s = SLOW_ITEM_S if rank == slow_rank else 0.0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[i]


def stall(rank: int, slow_rank: int | None) -> tuple[DataLoader, DataLoader]:
    """10 train batches of 1 per rank; ``slow_rank`` reads each in 150 ms."""
    return DataLoader(SlowOnRank(10, rank, slow_rank), batch_size=1), DataLoader(dataset(4), BATCH)


class WorkerDiesOnRank(Dataset):
    """``dataset(n)`` whose loader worker is killed (SIGKILL) reading ``at`` on ``dying_rank``."""

    def __init__(self, n: int, rank: int, at: int, dying_rank: int) -> None:
        self.data = dataset(n, own=True)
        self.at = at if rank == dying_rank else None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]


def dead_worker(rank: int) -> tuple[DataLoader, DataLoader]:
    """Rank 1's only loader worker dies reading item 24 (train batch 7 of 8)."""
    L.seed_everything(0, verbose=False)  # earlier scenarios seeded torch per rank
    train = DataLoader(WorkerDiesOnRank(32, rank, at=24, dying_rank=1), BATCH, num_workers=1)
    return train, DataLoader(dataset(4), BATCH)


class IgnoresRank(IterableDataset):
    """A custom iterable that never looks at the rank: every rank yields all 32 samples."""

    def __iter__(self) -> Iterator[Any]:
        return iter(dataset(32))


def rank_guard() -> list[L.Callback]:
    return [RankGuard()]


def stall_monitor() -> list[L.Callback]:
    return [DataStallMonitor(**STALL)]


PER_RANK_DATA = {"use_distributed_sampler": False, "num_sanity_val_steps": 0}
DATA: dict[str, Scenario] = {
    # Checked at fit start (no sanity check): both loaders and the generators' seeding.
    "unseeded_numpy_split": Scenario(rank_guard, lambda r: numpy_split(r, False), NO_SANITY),
    "seeded_numpy_split": Scenario(rank_guard, lambda r: numpy_split(r, True), NO_SANITY),
    # With the sanity check, the val loader is checked before its first sanity batch.
    "unseeded_random_split": Scenario(rank_guard, torch_random_split),
    "stall_healthy": Scenario(
        stall_monitor, lambda r: stall(r, None), PER_RANK_DATA, ComputingModule
    ),
    "stall_rank1": Scenario(stall_monitor, lambda r: stall(r, 1), PER_RANK_DATA, ComputingModule),
    # A custom iterable that never looks at the rank: both ranks read the same batches.
    "iterable_ignores_rank": Scenario(
        rank_guard, lambda r: (DataLoader(IgnoresRank(), BATCH), DataLoader(dataset(4), BATCH))
    ),
    # Rank 1 alone fails: the job's last scenario.
    "dead_worker": Scenario(rank_guard, dead_worker, PER_RANK_DATA),
}


# --- Checkpoints on two simulated nodes (test_checkpoint_e2e.py) ----------------------------------

COUNTERS: dict[str, Any] = {}
KiB = 1024
#: Host memory per node: below a full save of the module with Adam (DDP or FSDP2),
#: above a sharded one (hand count in tests/frameworks/test_checkpoint_e2e.py).
BUDGET = 40 * KiB
#: A save folder on each node's own disk: the test mounts node 1's own directory at
#: ``OUT/local`` for node 1's processes (``benchmarks/launch.py::node_disk``).
NODE_LOCAL = "local/ckpt"


class Module(L.LightningModule):
    """``Linear(4, 512), Linear(512, 1)`` with Adam; FSDP2-shards itself under ModelParallel."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 1))

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        COUNTERS["train_steps"] = COUNTERS.get("train_steps", 0) + 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class MetricCounter(Logger):
    """Counts rankguard's metrics as Lightning loggers receive them (on every rank)."""

    name, version = "counter", 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        del params, args, kwargs

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            if key.startswith("rankguard/"):
                COUNTERS[f"{key} count"] = COUNTERS.get(f"{key} count", 0) + 1
                COUNTERS[key] = value


def save(
    name: str,
    guard: L.Callback,
    strategy: Any = "ddp",
    every_n_train_steps: int = 2,
    dirpath: str | None = None,
    weights_only: bool = False,
    ckpt_path: str | None = None,
) -> None:
    """Trains 8 batches of 4 per rank on 2 nodes of 1 rank, a real ModelCheckpoint saving."""
    COUNTERS.clear()
    L.seed_everything(0, verbose=False)  # every generator, the same on every rank
    checkpoints = ModelCheckpoint(
        dirpath=dirpath or f"ckpt/{name}",  # relative: resolved against each rank's cwd
        every_n_train_steps=every_n_train_steps,
        save_top_k=-1,
        save_weights_only=weights_only,
    )
    job = trainer(
        [guard, checkpoints],
        devices=1,
        num_nodes=2,
        strategy=strategy,
        use_distributed_sampler=True,
        enable_checkpointing=True,
        logger=MetricCounter(),
    )
    job.fit(Module(), DataLoader(Points(64), batch_size=4), ckpt_path=ckpt_path)


def node_local(name: str, guard: L.Callback) -> None:
    """Saves into ``local/ckpt``, made on every node first (as a job script's ``mkdir -p``)."""
    os.makedirs(NODE_LOCAL, exist_ok=True)
    save(name, guard, every_n_train_steps=4, dirpath=NODE_LOCAL)


CHECKPOINT = {
    # Every guard with defaults, the planner raising: a small model fits, nothing is said.
    "checkpointing": lambda: save("checkpointing", RankGuard(checkpoint_planner={"mode": "raise"})),
    "planner_warn": lambda: save(
        "planner_warn", CheckpointPlanner(mode="warn", host_memory_bytes=BUDGET), "ddp", 4
    ),
    "planner_raise": lambda: save(
        "planner_raise", CheckpointPlanner(mode="raise", host_memory_bytes=BUDGET)
    ),
    # DDP keeps a full replica on every rank: nothing to switch, the setting is named.
    "planner_auto_ddp": lambda: save(
        "planner_auto_ddp", CheckpointPlanner(mode="auto", host_memory_bytes=BUDGET)
    ),
    # FSDP2 through ModelParallelStrategy, full saves on rank 0: switched to sharded.
    "planner_auto_fsdp": lambda: save(
        "planner_auto_fsdp",
        RankGuard(checkpoint_planner={"mode": "auto", "host_memory_bytes": BUDGET}),
        ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
        ),
        4,
    ),
    # Weights-only saves (no on_save_checkpoint): the barrier still runs before each one.
    "weights_only": lambda: save(
        "weights_only", SharedDirBarrier(), every_n_train_steps=2, weights_only=True
    ),
    # A node-local save folder: every rank warns, training goes on (rank 0 saves on node 0).
    "node_local_warn": lambda: node_local("node_local_warn", RankGuard()),
    "node_local_raise": lambda: node_local(
        "node_local_raise", RankGuard(shared_dir_barrier={"on_node_local": "raise"})
    ),
    # Resuming from the checkpoint node_local_warn saved on node 0's disk only.
    "resume_node_local": lambda: save(
        "resume_node_local", RankGuard(), ckpt_path=f"{NODE_LOCAL}/epoch=0-step=8.ckpt"
    ),
}


# --- Resumes on two simulated nodes (test_resume_e2e.py) -----------------------------------------

#: The first fit's checkpoint folder (shared by both nodes), and the copy of it a node took
#: right after its step-4 save (the node-local copy that lagged).
RESUME_DIR = "resume/ckpt"
LAGGED_COPY = "resume/ckpt_at_step4"


class CountBatches(L.Callback):
    """Counts the train batches this fit ran."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        COUNTERS["train_batches"] = COUNTERS.get("train_batches", 0) + 1


class CopyAfterStep(L.Callback):
    """Rank 0 copies the checkpoint folder after step ``step``'s save, once (a sync that died)."""

    def __init__(self, src: str, dst: str, step: int) -> None:
        self.src, self.dst, self.step = src, dst, step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == self.step:
            shutil.copytree(self.src, self.dst)


class OffsetStream(IterableDataset):
    """This rank's share of a stream (samples rank, rank + 2, ...), read on from ``next_index``."""

    def __init__(self, rank: int) -> None:
        self.points, self.next_index = Points(512), rank

    def __iter__(self) -> Iterator[Any]:
        while self.next_index < len(self.points):
            self.next_index += 2
            yield self.points[self.next_index - 2]


class StreamLoader(DataLoader):
    """A resumable loader: Lightning saves and loads its ``state_dict`` (where its stream is)."""

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.dataset.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.dataset.next_index = state["next_index"]


def resume_fit(
    dirpath: str,
    train: DataLoader,
    max_steps: int,
    ckpt_path: str | None = None,
    callbacks: tuple[L.Callback, ...] = (),
) -> None:
    """Fits 2 nodes of 1 rank to ``max_steps``; a ModelCheckpoint saves every 4 steps and last."""
    COUNTERS.clear()
    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_last=True
    )
    # Every guard but the two that time steps: a step here takes a millisecond, on cores shared
    # with other jobs, and their calls are not what these scenarios are about.
    quiet = {"data_stall_monitor": False, "straggler_monitor": False}
    guards = [] if rankguard_off() else [RankGuard(**quiet)]
    job = trainer(
        [*guards, CountBatches(), *callbacks, checkpoints],
        devices=1,
        num_nodes=2,
        max_steps=max_steps,
        use_distributed_sampler=True,
        enable_checkpointing=True,
    )
    try:
        job.fit(Module(), train, ckpt_path=ckpt_path)
    finally:
        COUNTERS["global_step"] = job.global_step


def points_loader() -> DataLoader:
    """Map-style, 16 batches of 4 per rank an epoch (Lightning adds a DistributedSampler)."""
    return DataLoader(Points(128), batch_size=4)


def lagging_copy() -> None:
    """Each rank plays a node with its own copy of the checkpoint folder; node 1's lagged."""
    node = rank()
    with own_node(node, Path(OUT) / f"lagging_node{node}") as disk:
        shutil.copytree(LAGGED_COPY if node == 1 else RESUME_DIR, disk / "ckpt")
        copied = sorted(os.listdir(disk / "ckpt"))
        try:
            resume_fit(str(disk / "ckpt"), points_loader(), 12, ckpt_path="last")
        finally:
            COUNTERS["copied"] = copied


def stream_loader() -> StreamLoader:
    return StreamLoader(OffsetStream(rank()), batch_size=4)


class PositionAtSave(L.Callback):
    """Records this rank's train loader position (its digest) at each save, as it is written."""

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        position = digest(trainer.train_dataloader.state_dict())
        COUNTERS.setdefault("position_at_save", []).append(position)


def stream_first_fit() -> None:
    """Fits over the stream; records what each checkpoint keeps of the guard and the loader."""
    folder = "resume/stream"
    try:
        resume_fit(folder, stream_loader(), 8, callbacks=(PositionAtSave(),))
    finally:
        for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
            ckpt = torch.load(os.path.join(folder, name), weights_only=False)
            kept = ckpt["callbacks"].get("RankGuard", {}).get("resume_guard", {})
            COUNTERS[f"{name} guard"] = kept.get("saved", {}).get("data/train loader")
            COUNTERS[f"{name} loader"] = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]


def stream_resume() -> None:
    """Resumes the stream from last.ckpt; records where this rank's stream ended."""
    train = stream_loader()
    try:
        resume_fit("resume/stream", train, 12, ckpt_path="last")
    finally:
        COUNTERS["next_index"] = train.dataset.next_index


RESUME: dict[str, Callable[[], None]] = {
    # 8 of 16 batches of an epoch; saves at steps 4 and 8 (and last.ckpt), a copy after step 4.
    "resume_first_fit": lambda: resume_fit(
        RESUME_DIR, points_loader(), 8, callbacks=(CopyAfterStep(RESUME_DIR, LAGGED_COPY, 4),)
    ),
    "resume_lagging_copy": lagging_copy,
    # From the shared folder, mid-epoch, a DistributedSampler: nothing to say.
    "resume_healthy": lambda: resume_fit(RESUME_DIR, points_loader(), 12, ckpt_path="last"),
    "resume_stream_first_fit": stream_first_fit,
    "resume_stream": stream_resume,
}


def setup_resume() -> Callable[[str], Outcome]:
    os.chdir(OUT)  # the checkpoint folders go to OUT/resume
    recorder = Recorder(OUT)
    return lambda name: (recorder.outcome(RESUME[name], COUNTERS), None)


# --- Hangs and deadlocks (test_hang_e2e.py, test_deadlock_e2e.py) ---------------------------------


class PacedModule(TinyModule):
    """TinyModule whose train and val steps take a known time; records train-to-train gaps."""

    def __init__(self, train_s: float = 0.0, val_s: float = 0.0) -> None:
        super().__init__()
        self.train_s, self.val_s = train_s, val_s
        self.longest_gap: dict[str, float] = {}
        self._last_end: float | None = None

    @property
    def counters(self) -> dict[str, Any]:
        return {"train_steps": self.train_steps, "val_steps": self.val_steps, **self.longest_gap}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.train_s)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        if self._last_end is not None:
            gap = now - self._last_end
            longest = self.longest_gap.get("longest_train_gap_s", 0.0)
            self.longest_gap["longest_train_gap_s"] = max(longest, gap)
        self._last_end = now

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        time.sleep(self.val_s)
        super().validation_step(batch, batch_idx)


def mark(name: str, rank: int) -> None:
    """Writes the moment (Unix time) rank ``rank`` splits off or stalls to ``OUT/<name>``."""
    with open(os.path.join(OUT, name), "w") as file:
        json.dump({"rank": rank, "t": time.time()}, file)


def stall_after_validation() -> None:
    """The bug: rank 1 never comes back from validation (a hook that blocks, here a sleep)."""
    mark("stall_stall_after_validation.json", 1)
    time.sleep(3600)


class StallAfterValidation(L.Callback):
    """On rank 1 only, blocks in the first ``on_validation_end`` after the sanity check."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1 and not trainer.sanity_checking:
            stall_after_validation()


def reports(scenario: str) -> str:
    return os.path.join(OUT, f"reports_{scenario}")


SAVING = {"enable_checkpointing": True}


def checkpoints() -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), save_last=True)


def healthy_slow_eval() -> dict[str, Any]:
    watchdog = HangWatchdog(report_dir=reports("healthy_slow_eval"), **hang_settings.HEALTHY)
    module = PacedModule(hang_settings.TRAIN_STEP_S, hang_settings.EVAL_BATCH_S)
    # The sanity check (2 val batches) runs before the first train step; the checkpoint at
    # the end of the epoch holds the watchdog's calibration.
    job = trainer([watchdog, checkpoints()], max_epochs=1, val_check_interval=4, **SAVING)
    job.fit(module, loader(32), loader(16))
    # The longest interval seen per phase kind and the deadlines: the watchdog calibrated.
    core = watchdog.runner.guards[0]
    return {**module.counters, "peaks": dict(core.history.peaks), "deadlines": core.deadlines}


class _Info(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resume_calibrated() -> dict[str, Any]:
    """A second epoch resumed from the healthy run's checkpoint, with a fresh watchdog."""
    watchdog = HangWatchdog(report_dir=reports("resume_calibrated"), **hang_settings.HEALTHY)
    info = _Info()
    log = logging.getLogger("rankguard.callbacks.hang_watchdog")
    log.addHandler(info)
    log.setLevel(logging.INFO)
    module = PacedModule(hang_settings.TRAIN_STEP_S)
    job = trainer([watchdog, checkpoints()], max_epochs=2, val_check_interval=4, **SAVING)
    try:
        job.fit(module, loader(32), loader(16), ckpt_path=os.path.join(OUT, "ckpt", "last.ckpt"))
    finally:
        log.removeHandler(info)
    plans = [m for m in info.messages if "reports at deadlines" in m]
    return {**module.counters, "plans": plans}


def stall_after_validation_end() -> dict[str, Any]:
    # rankguard first: it sees the end of validation before the culprit blocks in it.
    watchdog = HangWatchdog(report_dir=reports("stall_after_validation"), **hang_settings.HANG)
    job = trainer([watchdog, StallAfterValidation()], max_epochs=2, val_check_interval=2)
    job.fit(PacedModule(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class ExtraSyncedKey(PacedModule):
    """The bug (Lightning #19106): rank 1 alone logs a key with ``sync_dist=True`` at step 5."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 5:
            mark("split.json", 1)
            self.log("extra", loss.detach(), sync_dist=True)
        return loss


def sync_dist_key() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("sync_dist_key"))], max_epochs=2)
    job.fit(ExtraSyncedKey(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class StopOnRank0(L.Callback):
    """The bug (Lightning #379): rank 0 alone sets ``trainer.should_stop`` at step 5.

    As early stopping does when it decides from one rank's un-synced metric.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 5:
            mark("split.json", 0)
            trainer.should_stop = True


def should_stop_one_rank(alone: bool = False) -> dict[str, Any]:
    """``RankGuard()`` with every setting at its default; reports in ``./rankguard_reports``.

    Rank 0 stops after step 5, so the batch-parity check at its epoch end waits for rank 1,
    which goes on into step 6. With ``alone``, the hang watchdog alone (at its defaults):
    rank 0 leaves fit, while rank 1 waits in the next step's collective.
    """
    guard = HangWatchdog() if alone else RankGuard()
    job = trainer([guard, StopOnRank0()], max_epochs=2)
    job.fit(PacedModule(), loader(32))
    with open(os.path.join(OUT, f"fit_returned{job.global_rank}.json"), "w") as file:
        json.dump({"t": time.time()}, file)
    return {}


def reduce_on_rank0_only(group: Any) -> None:
    """The bug (Composer #239, here in Lightning): a collective under ``if rank == 0``."""
    mark("split.json", 0)
    torch.distributed.all_reduce(torch.ones(3), group=group)


class Rank0Collective(L.Callback):
    """At the first train epoch's end, rank 0 alone reduces a tensor.

    On its own gloo group: on the training group gloo pairs it with rank 1's
    next one (DDP's gradient all-reduce) and fails on the size mismatch, where
    NCCL would hang.
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.group = torch.distributed.new_group(backend="gloo")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and trainer.current_epoch == 0:
            reduce_on_rank0_only(self.group)


def rank0_collective() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer(
        [HangWatchdog(report_dir=reports("rank0_collective")), Rank0Collective()], max_epochs=2
    )
    job.fit(PacedModule(), loader(32))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class GatherKept(PacedModule):
    """The bug (Lightning #19680): ``self.all_gather`` at the validation epoch's end on a path
    one rank skips: only ranks that kept predictions gather them (rank 1 kept none).

    On a gloo group of its own (``self.all_gather(..., group=...)``), for the reason
    :class:`Rank0Collective` gives.
    """

    def setup(self, stage: str) -> None:
        self.group = torch.distributed.new_group(backend="gloo")
        self.kept: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().validation_step(batch, batch_idx)
        if self.global_rank == 0:  # e.g. the predictions above a threshold: none on rank 1
            self.kept.append(self.layer(batch[0]).detach().mean())

    def on_validation_epoch_end(self) -> None:
        if self.kept and not self.trainer.sanity_checking:
            mark("split.json", 0)
            self.all_gather(torch.stack(self.kept), group=self.group)
        self.kept.clear()


def epoch_end_all_gather() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("epoch_end_all_gather"))], max_epochs=2)
    job.fit(GatherKept(), loader(32), loader(16))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


class SaveOnRank0(L.Callback):
    """The bug: ``trainer.save_checkpoint`` under ``if trainer.is_global_zero`` at step 5.

    Lightning's save is collective (it ends in ``strategy.barrier``): rank 0 waits there.
    """

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == 5:
            mark("split.json", 0)
            trainer.save_checkpoint(os.path.join(OUT, "rank0_only.ckpt"))


def save_on_rank0() -> dict[str, Any]:
    """Every watchdog setting at its default: the proven deadlock ends the job (exit 70)."""
    job = trainer([HangWatchdog(report_dir=reports("save_on_rank0")), SaveOnRank0()], max_epochs=2)
    job.fit(PacedModule(), loader(32))
    raise AssertionError("the fit ended; the watchdog should have ended the process")


def check_batch(batch: Any, step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if rank() == 1 and step == 6:
        mark("raised.json", 1)
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckedModule(PacedModule):
    """The user's module: its train step first checks the batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        check_batch(batch, self.global_step)
        return super().training_step(batch, batch_idx)


def destroy_process_group_waits() -> None:
    """NCCL's communicator teardown waiting for a peer (here a long sleep): the process stays."""
    time.sleep(600)


def data_check_raises() -> dict[str, Any]:
    """The field report: rank 1's data check raises at step 6; rank 0 goes on into its next
    collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default. It ends the job (exit code 70).
    """
    watchdog = {"report_dir": reports("data_check_raises"), "teardown_timeout_s": 3}
    job = trainer([] if rankguard_off() else [RankGuard(hang_watchdog=watchdog)])
    try:
        job.fit(CheckedModule(), loader(32), loader(16))
    finally:
        destroy_process_group_waits()
    raise AssertionError("the fit ended; rank 1's data check should have raised")


HANG = {
    "healthy_slow_eval": healthy_slow_eval,
    # Resumes from the checkpoint healthy_slow_eval saves, so it must follow it.
    "resume_calibrated": resume_calibrated,
    "stall_after_validation": stall_after_validation_end,
    "sync_dist_key": sync_dist_key,
    "should_stop_one_rank": should_stop_one_rank,
    "should_stop_leaves_fit": functools.partial(should_stop_one_rank, alone=True),
    "rank0_collective": rank0_collective,
    "epoch_end_all_gather": epoch_end_all_gather,
    "save_on_rank0": save_on_rank0,
    "data_check_raises": data_check_raises,
}


# --- Stragglers (test_straggler_e2e.py) -----------------------------------------------------------


class Classifier(L.LightningModule):
    """Trains ``SlowForward`` (calling it directly, as most modules do); counts batches done."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = SlowForward(delay_s)
        self.batches = 0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.model(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class AtBatch(logging.Handler):
    """Keeps each rankguard record (warning and above) with the batches done when it came."""

    def __init__(self, module: Classifier) -> None:
        super().__init__(logging.WARNING)
        self.module = module
        self.records: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append([self.module.batches, record.getMessage()])


def race(settings: dict[str, Any], slow_compute: bool, slow_data: bool, **kw: Any) -> dict:
    """``BATCHES`` train batches per rank; rank 1 computes or reads slowly if told."""
    metrics = MetricsRecorder()
    callbacks = [RankGuard(**settings), *kw.pop("callbacks", [])]
    job = trainer(callbacks, logger=metrics, num_sanity_val_steps=0, **kw)
    rank = job.global_rank
    module = Classifier(forward_delay(rank, slow_compute))
    train = DataLoader(SlowReads(BATCHES * BATCH, rank, slow_data, seed=rank), batch_size=BATCH)
    val = DataLoader(Points(8), batch_size=BATCH)
    records = AtBatch(module)
    logging.getLogger("rankguard").addHandler(records)
    result: dict[str, Any] = {"outcome": "ok"}
    try:
        job.fit(module, train, val)
    except Exception as exc:
        result = {"outcome": type(exc).__name__, "message": str(exc)}
    finally:
        logging.getLogger("rankguard").removeHandler(records)
    result.update(
        rank=rank,
        train_batches=module.batches,
        logged=records.records,
        metrics=metrics.kept("rankguard/straggler"),
    )
    return result


STRAGGLERS: dict[str, Callable[[], dict]] = {
    # Equal ranks, validated and saved every 6 batches: no warning, scores every interval.
    "straggler_healthy": lambda: race(
        {"straggler_monitor": STRAGGLER},
        False,
        False,
        val_check_interval=6,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(OUT, "ckpt"), every_n_train_steps=6)],
    ),
    "slow_compute": lambda: race({"straggler_monitor": STRAGGLER}, True, False),
    "slow_data": lambda: race(
        {"straggler_monitor": STRAGGLER, "data_stall_monitor": STRAGGLER_STALL}, False, True
    ),
    "slow_compute_raise": lambda: race(
        {"straggler_monitor": {**STRAGGLER, "on_violation": "raise"}}, True, False
    ),
}


# --- The command line ----------------------------------------------------------------------------

Outcome = tuple[dict[str, Any], BaseException | None]


def run_hang(fn: Callable[[], dict], collector: WarningCollector) -> Outcome:
    collector.messages.clear()
    counters = fn()
    return {"outcome": "ok", "warnings": list(collector.messages), **counters}, None


def setup_hang() -> Callable[[str], Outcome]:
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    with open(os.path.join(OUT, f"pid{rank()}"), "w") as file:
        file.write(str(os.getpid()))
    collector = WarningCollector()
    logging.getLogger("rankguard").addHandler(collector)
    return lambda name: run_hang(HANG[name], collector)


def setup_checkpoint() -> Callable[[str], Outcome]:
    os.chdir(OUT)  # checkpoints go to OUT/ckpt/<scenario>
    recorder = Recorder(OUT)
    return lambda name: (recorder.outcome(CHECKPOINT[name], COUNTERS), None)


def setup_straggler() -> Callable[[str], Outcome]:
    torch.set_num_threads(1)  # two ranks on two shared cores
    L.seed_everything(0, verbose=False)
    return lambda name: (STRAGGLERS[name](), None)


#: Each concern's scenarios, and what a launch sets up before the first of them: it
#: returns how one scenario runs into its record (and the error to re-raise if last).
CONCERNS: list[tuple[dict[str, Any], Callable[[], Callable[[str], Outcome]]]] = [
    (GENERAL, lambda: lambda name: run_fit(name, GENERAL[name], data=False)),
    (DATA, lambda: lambda name: run_fit(name, DATA[name], data=True)),
    (CHECKPOINT, setup_checkpoint),
    (RESUME, setup_resume),
    (HANG, setup_hang),
    (STRAGGLERS, setup_straggler),
]
#: Whose ``OUT/rank<r>.json`` holds the records alone, not a report around them.
RECORDS_ALONE = {**HANG, **CHECKPOINT, **RESUME}


def rank() -> int:
    """This process's global rank: torchrun's, else the one Lightning's launcher gave it."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def write(report: dict[str, Any]) -> None:
    path = os.path.join(OUT, f"rank{rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    global OUT
    OUT, *names = argv
    runners = {}
    for scenarios, setup in CONCERNS:
        runners.update(dict.fromkeys(scenarios, setup))
    unknown = [n for n in names if n not in runners]
    if unknown or not names:
        raise SystemExit(f"unknown scenarios {unknown}; valid: {sorted(runners)}")
    os.makedirs(OUT, exist_ok=True)
    report: dict[str, Any] = {"pid": os.getpid(), "finished": False, "scenarios": {}}
    ready: dict[Callable, Callable[[str], Outcome]] = {}
    error: BaseException | None = None
    for name in names:
        if runners[name] not in ready:
            ready[runners[name]] = runners[name]()
        record, error = ready[runners[name]](name)
        report["rank"] = rank()
        report["scenarios"][name] = record
        if name == names[-1]:
            report.update(finished=True, exit_code=0 if error is None else 1, ended_at=time.time())
        write(report["scenarios"] if name in RECORDS_ALONE else report)
    if error is not None:
        raise error
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
