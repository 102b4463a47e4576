"""A hand-written 2-rank DDP loop (llama-recipes style) with rankguard, and an optional fault.

Run it with ``torchrun`` (gloo on CPU; both ranks print to this terminal)::

    torchrun --standalone --nproc-per-node 2 examples/torch_loop.py         # healthy
    torchrun --standalone --nproc-per-node 2 examples/torch_loop.py --fault drop_last
    torchrun --standalone --nproc-per-node 2 examples/torch_loop.py --fault drop_last --no-rankguard

Faults (``examples/faults.py``; where a deadline must pass, the example sets it
to 5 s for the demo):

    uneven_eval       ranks build eval sets of different sizes (16 and 32 samples)
    uneven_train      ranks build train sets of different sizes
    drop_last         rank 0 builds its train loader with drop_last=True, rank 1 without
    unseeded_split    every rank splits with `datasets`' train_test_split and no seed
    slow_data         rank 1's dataset sleeps in __getitem__: DataStallMonitor names rank 1
    straggler         rank 1's forward takes 1.5x as long: StragglerMonitor names rank 1
    post_eval_hang    rank 1 sleeps forever after the first eval: HangWatchdog, exit code 75
    node_local_ckpt   each rank is a node of its own, saving to its own directory (a local disk)
    short_stream      rank 0's eval stream ends 4 samples short of the 16 its __len__ says
    ckpt_over_memory  CheckpointPlanner told the node has 1 MiB for a full save
    replica_drift     rank 0 alone clamps its output layer: ReplicaGuard names the ranks

rankguard takes 6 statements of the loop, each marked ``# rankguard``: the import,
the guard, ``with guard.fit(...)`` around the loop, ``run.train(...)`` and
``run.eval(...)`` around the loaders, ``with run.checkpoint(...)`` around the
save. ``--no-rankguard`` turns every guard off (the wrappers then only pass
the batches through).
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

import numpy
import torch
import torch.distributed as dist
from faults import BATCH_SIZE, FaultSetup, log_with_rank, parse_args, planned_samples, setup
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    default_collate,
)

from rankguard.callbacks import GUARDS  # for --no-rankguard only
from rankguard.integrations.torch import RankGuard  # rankguard

log = logging.getLogger("example")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def collate(rows: list[Any]) -> dict[str, torch.Tensor]:
    """Batches ``(x, label)`` pairs or ``datasets`` rows into ``{"x", "labels"}``."""
    if isinstance(rows[0], dict):
        rows = [(torch.tensor(r["x"]), torch.tensor(r["labels"])) for r in rows]
    x, labels = default_collate(rows)
    return {"x": x, "labels": labels}


def loader(data: Dataset, drop_last: bool = False) -> DataLoader:
    # A stream is already this rank's own; a dataset is split between the ranks.
    sampler = None if isinstance(data, IterableDataset) else DistributedSampler(data, shuffle=False)
    return DataLoader(
        data, batch_size=BATCH_SIZE, sampler=sampler, drop_last=drop_last, collate_fn=collate
    )


def train(fault: FaultSetup, rankguard: dict[str, Any]) -> None:
    rank = dist.get_rank()
    data = fault.data(rank, hf_datasets=True)
    data.describe(rank)
    seed_everything(0)  # the same on every rank, once the data is built
    model = DistributedDataParallel(fault.model(rank))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_loader = loader(data.train, drop_last=data.train_drop_last)
    eval_loader = loader(data.eval)
    ckpt_dir = fault.checkpoint_dir(rank) or str(fault.workdir / "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)  # the loop's own (node_local_ckpt: on its "node")
    started, trained = time.perf_counter(), 0

    guard = RankGuard(**rankguard)  # rankguard
    with guard.fit(  # rankguard: checks the data and the save folder before any batch
        model, optimizer, train_loader, eval_loaders=eval_loader, save_dirs=ckpt_dir
    ) as run:
        for epoch in range(fault.epochs):
            train_loader.sampler.set_epoch(epoch)
            model.train()
            for batch in run.train(train_loader):  # rankguard: was `train_loader`
                loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                trained += 1
            log.info("rank %d trained %d of its %d train batches", rank, trained, len(train_loader))

            model.eval()
            seen, eval_loss = 0, torch.zeros(())
            with torch.no_grad():
                for batch in run.eval(eval_loader):  # rankguard: was `eval_loader`
                    logits = model(batch["x"])
                    eval_loss += torch.nn.functional.cross_entropy(logits, batch["labels"])
                    seen += len(batch["labels"])
            dist.all_reduce(eval_loss)  # the eval loss, summed over ranks
            planned = planned_samples(eval_loader)
            log.info("rank %d evaluated %d of its %d eval samples", rank, seen, planned)
            if fault.hangs_after_eval(rank):
                log.info("rank %d: sleeping forever after eval (injected fault)", rank)
                while True:
                    time.sleep(3600)

            with run.checkpoint(ckpt_dir):  # rankguard: every rank sees the folder first
                if rank == 0:
                    state = {"model": model.module.state_dict(), "optim": optimizer.state_dict()}
                    torch.save(state, f"{ckpt_dir}/epoch{epoch}.pt")
            trained = 0
    log.info("rank %d trained for %.1f s", rank, time.perf_counter() - started)


def main() -> None:
    args = parse_args(__doc__)
    dist.init_process_group("gloo")
    log_with_rank()
    logging.getLogger("rankguard.callbacks.drop_last").setLevel(logging.WARNING)

    fault = setup(args.fault, args.workdir)
    rank = dist.get_rank()
    if fault.node_of(rank) is not None:  # this rank plays a node of its own
        os.environ["NODE_RANK"] = fault.node_of(rank)
    fault.clear_checkpoints(rank)
    fault.make_node_disk(rank)
    off = dict.fromkeys(GUARDS, False)  # every guard off: the wrappers pass batches through
    train(fault, off if args.no_rankguard else fault.rankguard)
    fault.report(rank)
    log.info("training finished")
    # Every rank is done before any tears its group down: on torch 2.13 a rank whose peer
    # (the store's host) left first aborted in teardown (SIGABRT, 3 runs in 14).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
