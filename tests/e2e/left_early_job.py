"""A rank whose loop ends early, without an error: its shard of the data is shorter.

Run by one torchrun, 2 ranks::

    torchrun --nproc-per-node=2 left_early_job.py OUT SCENARIO

Rank 0's shard holds 5 batches, rank 1's 8 (an iterable dataset split without equal
shards). Rank 0's loop ends after step 5, its fit with it. Rank 1's sixth step is long
(12 s: a large model's forward), longer than rank 0 stays in its close for the others
(7 s with ``exchange_period_s=1``); rank 1 then all-reduces its gradients. The hang
watchdog runs alone (``HangWatchdog``): ``RankGuard()``'s batch-parity check would hold
rank 0 at its pass's end until rank 1's pass ends too, and name the uneven pass itself.

- ``exit``: after its fit rank 0 destroys its process group and exits 0, as a script
  does. On gloo rank 1's all-reduce then fails at once (the peer's socket closed); on
  NCCL it would wait for the timeout.
- ``export``: after its fit rank 0 exports the model for 10 minutes (its process stays,
  as it does when NCCL's teardown waits): rank 1's all-reduce waits for it.
- ``healthy``: equal shards; after its last batch, inside the fit, rank 1 alone runs 12 s
  of its own code (a local evaluation, no collective). Nothing is reported; both exit 0.

Each rank writes ``OUT/rank{N}.json`` when its fit ends (``left``: Unix time).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rankguard.integrations.torch import HangWatchdog

BATCHES = {"exit": (5, 8), "export": (5, 8), "healthy": (5, 5)}
STEP_S = 0.2
#: Rank 1's sixth step (its forward), or its own code after its last batch (``healthy``).
LONG_STEP_S = 12.0
WATCHDOG = {"exchange_period_s": 1.0}


def shard(rank: int, scenario: str) -> Iterator[torch.Tensor]:
    """This rank's batches."""
    for _ in range(BATCHES[scenario][rank]):
        yield torch.randn(2, 4)


def train(out: Path, rank: int, scenario: str) -> int:
    """The fit; returns the steps it ran."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = HangWatchdog(**WATCHDOG, report_dir=str(out / "reports"))
    with guard.fit(model) as run:
        for batch in run.train(shard(rank, scenario)):
            if run.step == 6:
                time.sleep(LONG_STEP_S)
            model(batch).sum().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(STEP_S)
        if scenario == "healthy" and rank == 1:
            time.sleep(LONG_STEP_S)  # its own code, inside the fit
    return run.step


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    step = train(out, rank, scenario)
    (out / f"rank{rank}.json").write_text(json.dumps({"left": time.time(), "step": step}))
    if scenario == "export" and rank == 0:
        time.sleep(600)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
