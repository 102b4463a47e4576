"""Checkpoints in Composer on two simulated nodes (tests/frameworks/test_checkpoint_e2e.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from composer import Callback
from composer.loggers import LoggerDestination
from composer.utils import FSDP2Config

from rankguard.integrations.composer import CheckpointPlanner, RankGuard
from tests.e2e.composer_concerns import harness
from tests.e2e.composer_concerns.harness import COUNTERS, CountBatches, count, fit, sharded

KiB = 1024
#: Host memory per node: below a full save of the FSDP2 model with Adam, above a sharded
#: one; and below both for the DDP model, whose full save to a file only copies its
#: largest tensor (8 KiB) to the host. The model: ``Linear(4, 512), Linear(512, 2)`` with
#: Adam (hand count in tests/frameworks/test_checkpoint_e2e.py).
FSDP_BUDGET, DDP_BUDGET = 32 * KiB, 4 * KiB
#: A save folder on each node's own disk: the test mounts node 1's own directory at
#: ``OUT/local`` for node 1's processes (``benchmarks/launch.py::node_disk``).
NODE_LOCAL = "local/ckpt"


class MetricCounter(LoggerDestination):
    """Counts rankguard's metrics as Composer's logger destinations receive them."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            if key.startswith("rankguard/"):
                count(f"{key} count")
                COUNTERS[key] = value


def save(
    name: str,
    guard: Callback,
    fsdp: bool = False,
    save_interval: str = "2ba",
    folder: str | None = None,
    load_path: str | None = None,
) -> None:
    """Trains 8 batches per rank; FSDP is Composer's FSDP2, the FSDP that runs on CPU."""
    fit(
        sharded(64),
        [guard, CountBatches()],
        net=lambda: torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 2)),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        parallelism_config={"fsdp": FSDP2Config(state_dict_type="full")} if fsdp else None,
        save_folder=folder or f"ckpt/{name}",  # relative: resolved against each rank's cwd
        save_interval=save_interval,
        load_path=load_path,
        loggers=[MetricCounter()],
    )


def node_local(name: str, guard: Callback) -> None:
    """Saves into ``local/ckpt``, made on every node first (as a job script's ``mkdir -p``)."""
    os.makedirs(NODE_LOCAL, exist_ok=True)
    save(name, guard, save_interval="4ba", folder=NODE_LOCAL)


SCENARIOS: dict[str, Callable[[], None]] = {
    # Every guard, the planner raising: a small model fits, nothing is said.
    "checkpointing": lambda: save("checkpointing", RankGuard(checkpoint_planner={"mode": "raise"})),
    # FSDP2 saving full checkpoints, gathered on rank 0: too large for the budget.
    "planner_warn": lambda: save(
        "planner_warn",
        CheckpointPlanner(mode="warn", host_memory_bytes=FSDP_BUDGET),
        fsdp=True,
        save_interval="4ba",
    ),
    "planner_raise": lambda: save(
        "planner_raise", CheckpointPlanner(mode="raise", host_memory_bytes=FSDP_BUDGET), fsdp=True
    ),
    # DDP: a sharded save would not fit either, so auto does not choose it.
    "planner_auto_ddp": lambda: save(
        "planner_auto_ddp", CheckpointPlanner(mode="auto", host_memory_bytes=DDP_BUDGET)
    ),
    # FSDP2 saving full checkpoints on rank 0: switched to sharded.
    "planner_auto_fsdp": lambda: save(
        "planner_auto_fsdp",
        RankGuard(checkpoint_planner={"mode": "auto", "host_memory_bytes": FSDP_BUDGET}),
        fsdp=True,
        save_interval="4ba",
    ),
    # A node-local save folder: every rank warns, training goes on (rank 0 saves on node 0).
    "node_local_warn": lambda: node_local("node_local_warn", RankGuard()),
    "node_local_raise": lambda: node_local(
        "node_local_raise", RankGuard(shared_dir_barrier={"on_node_local": "raise"})
    ),
    # Resuming from the checkpoint node_local_warn saved on node 0's disk only.
    "resume_node_local": lambda: save(
        "resume_node_local", RankGuard(), load_path=f"{NODE_LOCAL}/ep0-ba8-rank0.pt"
    ),
}


def setup(names: list[str]) -> None:
    # Composer reads the node rank from NODE_RANK; torchrun names it GROUP_RANK.
    os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    os.chdir(harness.OUT)  # checkpoints go to OUT/ckpt/<scenario>


#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB: set[str] = set()
