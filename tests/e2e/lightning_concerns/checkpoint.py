"""Checkpoints in Lightning on two simulated nodes (tests/frameworks/test_checkpoint_e2e.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import (
    DataLoader,
)

from rankguard.integrations.lightning import (
    CheckpointPlanner,
    RankGuard,
    SharedDirBarrier,
)
from tests.e2e.common import Points, Recorder
from tests.e2e.lightning_concerns import harness
from tests.e2e.lightning_concerns.harness import COUNTERS, Outcome, trainer

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


SCENARIOS: dict[str, Callable[[], None]] = {
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


def setup(names: list[str]) -> Callable[[str], Outcome]:
    os.chdir(harness.OUT)  # checkpoints go to OUT/ckpt/<scenario>
    recorder = Recorder(harness.OUT)
    return lambda name: (recorder.outcome(SCENARIOS[name], COUNTERS), None)


#: Whether ``OUT/rank<r>.json`` holds this concern's records alone, not a report around them.
RECORDS_ALONE = True
