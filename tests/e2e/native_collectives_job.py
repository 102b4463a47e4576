"""Desyncs that DDP, FSDP2 and a background save produce, in a hand-written loop on 2 ranks.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/native_collectives_job.py OUT_DIR SCENARIO

One scenario a launch: each never returns (the desync ends every rank with exit code 70).

- ``ddp_buffers``: DDP with module buffers (``BatchNorm1d``, ``broadcast_buffers=True``);
  rank 1's loss guard skips its backward at step 5 (a ``continue``), so its next forward's
  buffer broadcast meets rank 0's gradient all-reduce (modelscope/ms-swift#10183).
- ``fsdp2_forward``: FSDP2 (``fully_shard``, layers of one size); rank 1 runs a forward
  more at step 3 (a debug prediction under autograd), so its all-gathers meet rank 0's
  backward all-gathers and reduce-scatters (pytorch/torchtitan#4777).
- ``async_save``: ``torch.distributed.checkpoint.async_save`` every step, back to back,
  and the training thread's barrier after it (KempnerForge#104): the save's thread and
  the training thread issue on the default group in another order on each rank.

Each rank writes the moment of the split to ``OUT_DIR/split{rank}.json`` (``split.json``:
rank 1's). ``E2E_RANKGUARD=off`` runs the same loop without rankguard;
``E2E_PG_TIMEOUT_S`` sets the process group's timeout (what a user without rankguard
meets: gloo's timeout, 30 min by default).
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import rankguard_off, run_scenarios, seed_everything

COUNTERS: dict[str, int] = {}
OUT = Path(".")
WIDTH = 16


def mark(name: str) -> None:
    """Writes the moment of the split (this rank's, and ``split.json`` for rank 1's)."""
    rank = dist.get_rank()
    at = json.dumps({"rank": rank, "t": time.time()})
    (OUT / f"split{rank}.json").write_text(at)
    if rank == 1:
        (OUT / name).write_text(at)


def loader(n: int = 256) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, WIDTH, generator=gen)
    data = TensorDataset(x, (x.sum(dim=1) > 0).long())
    return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))


def guarded(model, optimizer, train_loader, scenario: str):
    """``guard.fit(...)`` with every setting at its default and a report folder, or none."""
    if rankguard_off():
        return nullcontext(None)
    guard = RankGuard(hang_watchdog={"report_dir": str(OUT / f"reports_{scenario}")})
    return guard.fit(model, optimizer, train_loader)


def batches(run, train_loader):
    return train_loader if run is None else run.train(train_loader)


def ddp_buffers() -> None:
    """DDP with buffers; rank 1's loss guard skips its backward at step 5."""
    seed_everything(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 2),
    )
    model = DistributedDataParallel(net, broadcast_buffers=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = loader()
    with guarded(model, optimizer, train_loader, "ddp_buffers") as run:
        for step, (x, y) in enumerate(batches(run, train_loader), start=1):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if dist.get_rank() == 1 and step == 5:
                loss = loss * float("nan")  # one rank's batch gives a non-finite loss
            if not torch.isfinite(loss):
                mark("split.json")
                continue  # the loss guard skips this rank's backward
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            COUNTERS["steps"] = step


def fsdp2_forward() -> None:
    """FSDP2, 3 layers of one size; rank 1 runs a forward more (a debug prediction) at step 3."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    seed_everything(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    train_loader = loader()
    with guarded(net, optimizer, train_loader, "fsdp2_forward") as run:
        for step, (x, _) in enumerate(batches(run, train_loader), start=1):
            loss = net(x).pow(2).mean()
            if dist.get_rank() == 1 and step == 3:
                mark("split.json")
                COUNTERS["debug"] = int(net(x[:1]).argmax())  # a prediction to log, rank 1 only
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            COUNTERS["steps"] = step


def async_save() -> None:
    """A background save every step and the training thread's barrier after it."""
    import torch.distributed.checkpoint as dcp

    seed_everything(0)
    model = DistributedDataParallel(torch.nn.Linear(WIDTH, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = loader()
    saves = []
    with guarded(model, optimizer, train_loader, "async_save") as run:
        for step, (x, y) in enumerate(batches(run, train_loader), start=1):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            state = {"model": model.state_dict()}
            if step == 1:
                mark("split.json")
            saves.append(dcp.async_save(state, checkpoint_id=OUT / "ckpt" / f"step{step}"))
            if dist.get_rank() == 1:
                time.sleep(0.2)  # rank 1 logs its step first
            dist.barrier()  # every rank past the save's start
            COUNTERS["steps"] = step
    for save in saves:
        save.result()


SCENARIOS = {"ddp_buffers": ddp_buffers, "fsdp2_forward": fsdp2_forward, "async_save": async_save}


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    timeout = os.environ.get("E2E_PG_TIMEOUT_S")
    kwargs = {"timeout": timedelta(seconds=float(timeout))} if timeout else {}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", **kwargs)
    run_scenarios(SCENARIOS, COUNTERS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
