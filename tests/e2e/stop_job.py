"""A preemption reaching one node only: a hand-written loop on two simulated nodes.

Run by one torchrun per node (``benchmarks/launch.py::start_nodes``)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=N ... stop_job.py OUT

Once rank 1 (node 1) is past step ``READY_AT`` it writes ``OUT/ready``; the test then
sends SIGTERM to node 1's torchrun only, which passes it on to rank 1. Every rank's
``run.train`` ends after the same step; the save after the loop runs on every rank and
each writes ``OUT/rank{N}.json`` (its step, ``run.stopped``, the time); the process
then exits with 75. Log lines carry their Unix time.

``RANKGUARD=off`` runs the same loop without rankguard (``benchmarks/preemption.py``): the
same signal at the same step, the same save after the loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rankguard.integrations.torch import RankGuard

READY_AT = 10
STEP_S = 0.05
STEPS = 4000  # ~200 s of steps: the stop comes long before


class Bare:
    """``guard.fit(...)`` and its ``run`` without rankguard (``RANKGUARD=off``)."""

    step = 0
    stopped = None
    exit_code = 0

    @contextlib.contextmanager
    def fit(self, model: torch.nn.Module, save_dirs: str) -> Iterator[Bare]:
        Path(save_dirs).mkdir(parents=True, exist_ok=True)
        yield self

    def train(self, data: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        for self.step, batch in enumerate(data, start=1):
            yield batch

    def checkpoint(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    data = [torch.randn(2, 4) for _ in range(STEPS)]
    guard: RankGuard | Bare = (
        Bare()
        if os.environ.get("RANKGUARD") == "off"
        else RankGuard(hang_watchdog={"report_dir": str(out / "reports")})
    )
    with guard.fit(model, save_dirs=str(out / "ckpt")) as run:
        for batch in run.train(data):
            model(batch).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            time.sleep(STEP_S)
            if rank == 1 and run.step == READY_AT:
                (out / "ready").write_text(str(time.time()))
        with run.checkpoint():  # the user's save after the loop, on every rank
            torch.save({"model": model.state_dict(), "step": run.step}, out / "ckpt" / f"{rank}.pt")
        result = {"step": run.step, "stopped": run.stopped, "exit_code": run.exit_code}
    result["saved_at"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
