"""Replicas that drift apart: ``no_sync`` the wrong way round, HSDP from unseeded weights."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import seed_everything, seeded_split
from tests.e2e.torch_loop_concerns.harness import COUNTERS, QUICK, BagOfTokens, count, loader

#: A replica check every 2 train batches (and at batch 1).
REPLICA = {"replica_guard": {"interval": 2}, **QUICK}


def accumulate(inverted: bool) -> None:
    """DDP, 2 micro-batches a step; ``inverted``: the ``no_sync`` condition the wrong way round.

    The right way, the first micro-batch's forward and backward run under ``no_sync()``
    and the last's synchronize before ``optimizer.step()``; inverted, the last one's
    gradients stay rank-local and every step moves each replica its own way.
    """
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(BagOfTokens())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_loader = loader(seeded_split()[0])
    with RankGuard(**REPLICA).fit(model, optimizer, train_loader) as run:
        for i, batch in enumerate(run.train(train_loader)):
            count("train_batches")
            last = (i + 1) % 2 == 0
            skip_sync = last if inverted else not last
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                out = model(batch["input_ids"])
                torch.nn.functional.cross_entropy(out, batch["labels"]).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
                count("steps")


def hsdp(seeded: bool) -> None:
    """HSDP: ``fully_shard`` on a 2-D mesh, one replica per rank of a 1-rank shard group.

    Not ``seeded``: each rank builds the model from its own random state (``torch.seed()``),
    and ``fully_shard`` copies no rank's weights to the others (DDP would, when built).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    COUNTERS.clear()
    seed_everything(0)
    if not seeded:
        torch.seed()
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")
    )
    model = BagOfTokens()
    for module in (model.embed, model.head, model):
        fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_loader = loader(seeded_split()[0])
    with RankGuard(**REPLICA).fit(model, optimizer, train_loader) as run:
        for batch in run.train(train_loader):
            count("train_batches")
            loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


SCENARIOS = {
    "replica_accumulation": lambda: accumulate(inverted=False),
    "replica_inverted_no_sync": lambda: accumulate(inverted=True),
    "replica_hsdp": lambda: hsdp(seeded=True),
    "replica_hsdp_unseeded": lambda: hsdp(seeded=False),
}
