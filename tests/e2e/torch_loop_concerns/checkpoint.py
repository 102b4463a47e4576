"""Checkpoints: FSDP2's sharded saves, per-rank folders, node-local disks saved and resumed."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import own_node, seed_everything, seeded_split
from tests.e2e.torch_loop_concerns import harness
from tests.e2e.torch_loop_concerns.harness import COUNTERS, QUICK, BagOfTokens, count, loader


def fsdp2() -> None:
    """FSDP2 (``fully_shard``) with sharded saves through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    COUNTERS.clear()
    seed_everything(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = BagOfTokens()
    for module in (model.embed, model.head, model):
        fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_set, _ = seeded_split()
    train_loader, ckpt = loader(train_set), harness.OUT / "dcp"
    guard = RankGuard(checkpoint_planner={"mode": "auto"}, **QUICK)
    saves = {"save_dirs": ckpt, "state_dict_type": "sharded"}
    with guard.fit(model, optimizer, train_loader, **saves) as run:
        for batch in run.train(train_loader):
            loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with run.checkpoint(ckpt):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt / "last")
    planner = next(g for g in guard.runner.guards if g.name == "checkpoint_planner")
    COUNTERS.update(steps=run.step, plan=planner.plan.action, reason=planner.plan.reason)
    COUNTERS["files"] = sorted(p.name for p in (ckpt / "last").iterdir())


def per_rank_ckpt() -> None:
    """Each rank saves into a folder of its own that does not exist yet (``ckpt_rank<r>/``)."""
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    ckpt = harness.OUT / "per_rank" / f"ckpt_rank{dist.get_rank()}"
    with RankGuard(**QUICK).fit(model, save_dirs=ckpt) as run, run.checkpoint():
        torch.save(model.module.state_dict(), ckpt / "model.pt")
    COUNTERS["files"] = sorted(
        str(p.relative_to(harness.OUT)) for p in harness.OUT.glob("per_rank/*/*")
    )


def resume_node_local() -> None:
    """Each rank plays a node whose local disk is ``node<r>/``; the loop saves, then resumes."""
    rank = dist.get_rank()
    with own_node(rank, harness.OUT / f"node{rank}") as disk:
        COUNTERS.clear()
        seed_everything(0)
        ckpt = disk / "ckpt"  # the same folder name on every node, each node's own
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        guard = RankGuard(**QUICK)
        with guard.fit(model, save_dirs=ckpt) as run, run.checkpoint():
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt / "last.pt")
        COUNTERS["saved"] = len(list(ckpt.iterdir()))
        with guard.load(ckpt / "last.pt"):  # the resume, as the next run would do it
            model.module.load_state_dict(torch.load(ckpt / "last.pt"))
            count("loaded")


SCENARIOS = {
    "fsdp2": fsdp2,
    "per_rank_ckpt": per_rank_ckpt,
    "resume_node_local": resume_node_local,
}
