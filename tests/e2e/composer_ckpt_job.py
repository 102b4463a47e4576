"""A real Composer job on two simulated nodes of one rank each, saving checkpoints.

Run by ``benchmarks/launch.py::launch_nodes`` (one torchrun per node, so each
rank is a node of its own)::

    torchrun ... composer_ckpt_job.py OUT_DIR SCENARIO [SCENARIO ...]

Each scenario is a fresh ``Trainer`` on CPU (gloo) saving into
``ckpt/<scenario>`` under ``OUT_DIR``. Per rank,
``OUT_DIR/rank<r>.json`` records each scenario's outcome, rankguard's warnings
and counters (train batches, rankguard metrics); see tests/e2e/common.py.

The model is ``Linear(4, 512), Linear(512, 2)`` with Adam (hand count in
tests/frameworks/test_checkpoint_e2e.py); FSDP runs as Composer's FSDP2 (``FSDP2Config``),
the FSDP that runs on CPU (FSDP1 needs CUDA).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from composer import Callback, Trainer
from composer.loggers import LoggerDestination
from composer.models import ComposerClassifier
from composer.utils import FSDP2Config, dist
from torch.utils.data import DataLoader

from rankguard.integrations.composer import CheckpointPlanner, RankGuard
from tests.e2e.common import Points, Recorder

# Composer reads the node rank from NODE_RANK; torchrun names it GROUP_RANK.
os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))

COUNTERS: dict[str, Any] = {}
KiB = 1024
#: Host memory per node: below a full save of the FSDP2 model with Adam, above a sharded
#: one; and below both for the DDP model, whose full save to a file only copies its
#: largest tensor (8 KiB) to the host.
FSDP_BUDGET, DDP_BUDGET = 32 * KiB, 4 * KiB


class CountBatches(Callback):
    """Counts the train batches that ran on this rank."""

    def batch_start(self, state: Any, logger: Any) -> None:
        COUNTERS["train_batches"] = COUNTERS.get("train_batches", 0) + 1


class MetricCounter(LoggerDestination):
    """Counts rankguard's metrics as Composer's logger destinations receive them."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            if key.startswith("rankguard/"):
                COUNTERS[f"{key} count"] = COUNTERS.get(f"{key} count", 0) + 1
                COUNTERS[key] = value


def fit(
    name: str,
    guard: Callback,
    fsdp: bool = False,
    save_interval: str = "2ba",
    folder: str | None = None,
    load_path: str | None = None,
) -> None:
    COUNTERS.clear()
    torch.manual_seed(0)
    model = ComposerClassifier(
        torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 2)), num_classes=2
    )
    data = Points(64)  # 8 batches of 4 per rank
    trainer = Trainer(
        model=model,
        optimizers=torch.optim.Adam(model.parameters(), lr=1e-3),
        train_dataloader=DataLoader(data, batch_size=4, sampler=dist.get_sampler(data)),
        max_duration="1ep",
        device="cpu",
        parallelism_config={"fsdp": FSDP2Config(state_dict_type="full")} if fsdp else None,
        save_folder=folder or f"ckpt/{name}",  # relative: resolved against each rank's cwd
        save_interval=save_interval,
        load_path=load_path,
        progress_bar=False,
        log_to_console=False,
        loggers=[MetricCounter()],
        callbacks=[guard, CountBatches()],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()


def node_local(name: str, guard: Callback) -> None:
    """Saves into ``local/ckpt``, which exists on every node but is each node's own disk.

    The test mounts node 1's own directory at ``OUT_DIR/local`` for node 1's
    processes (``benchmarks/launch.py::node_disk``); as a job script's
    ``mkdir -p`` would, every rank creates the folder first.
    """
    os.makedirs(NODE_LOCAL, exist_ok=True)
    fit(name, guard, save_interval="4ba", folder=NODE_LOCAL)


#: A save folder on each node's own disk (see ``node_local``).
NODE_LOCAL = "local/ckpt"

SCENARIOS = {
    # Every guard, the planner raising: a small model fits, nothing is said.
    "checkpointing": lambda: fit("checkpointing", RankGuard(checkpoint_planner={"mode": "raise"})),
    # FSDP2 saving full checkpoints, gathered on rank 0: too large for the budget.
    "planner_warn": lambda: fit(
        "planner_warn",
        CheckpointPlanner(mode="warn", host_memory_bytes=FSDP_BUDGET),
        fsdp=True,
        save_interval="4ba",
    ),
    "planner_raise": lambda: fit(
        "planner_raise", CheckpointPlanner(mode="raise", host_memory_bytes=FSDP_BUDGET), fsdp=True
    ),
    # DDP: a sharded save would not fit either, so auto does not choose it.
    "planner_auto_ddp": lambda: fit(
        "planner_auto_ddp", CheckpointPlanner(mode="auto", host_memory_bytes=DDP_BUDGET)
    ),
    # FSDP2 saving full checkpoints on rank 0: switched to sharded.
    "planner_auto_fsdp": lambda: fit(
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
    "resume_node_local": lambda: fit(
        "resume_node_local", RankGuard(), load_path=f"{NODE_LOCAL}/ep0-ba8-rank0.pt"
    ),
}


def main() -> None:
    out_dir, *names = sys.argv[1:]
    os.chdir(out_dir)  # checkpoints go to OUT_DIR/ckpt/<scenario>
    recorder = Recorder(out_dir)
    for name in names:
        recorder.run(name, SCENARIOS[name], COUNTERS)


if __name__ == "__main__":
    main()
