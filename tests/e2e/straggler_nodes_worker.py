"""One rank of the simulated-nodes straggler run (``benchmarks/launch.py::launch_nodes``).

Run by one torchrun per node::

    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=N ... straggler_nodes_worker.py OUT

Each rank's node is its host name plus the node rank torchrun gives it
(``GROUP_RANK``), as rankguard names nodes everywhere: two torchruns on one
machine are two nodes, and on real hosts the host name tells them apart. Two
scenarios run in turn, each a real DDP model on gloo trained by a hand-written
loop (``tests/e2e/straggler_loop.py``): every rank of node 1 computes 1.5x
slower, then rank 1 alone does. Each rank writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from rankguard.callbacks import StragglerMonitor
from tests.e2e.straggler_common import FORWARD_S, SLOW_FACTOR, STRAGGLER
from tests.e2e.straggler_loop import ddp, train

STEPS = 18  # 2 of warm-up and 4 intervals of 4: named at batch 14


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)  # four ranks on two shared cores
    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    results = {}
    for scenario, slow in (("node_1_slow", node == 1), ("rank_1_slow", rank == 1)):
        model = ddp(FORWARD_S * (SLOW_FACTOR if slow else 1.0))
        results[scenario] = train([StragglerMonitor(**STRAGGLER)], model, steps=STEPS)
    results["node"] = node
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # Every rank reaches the end before any tears its group down: on torch 2.13, gloo's
    # teardown on a rank whose peers already exited could hang (its torchrun then never ends).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
