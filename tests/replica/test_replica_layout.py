"""Which ranks hold equal copies of which tensors, read from real wrappers on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from rankguard.callbacks.replica.layout import replica_layout, set_key
from tests.mp import run_ranks


class Net(torch.nn.Module):
    """A linear layer, a batch norm (running statistics) and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))


def summary(layout) -> dict:
    """What a rank compares across which ranks, and what it leaves out."""
    return {
        "sets": [(s.ranks, s.kind, s.names) for s in layout.sets],
        "left_out": layout.left_out,
    }


def _layouts(rank, world_size):
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    out["ddp"] = summary(replica_layout(DDP(Net())))
    out["ddp_own_buffers"] = summary(replica_layout(DDP(Net(), broadcast_buffers=False)))
    inner = Net()  # Lightning's module, with its strategy's wrapper beside it
    out["wrapper_apart"] = summary(replica_layout(inner, DDP(inner)))
    out["replicate"] = summary(replica_layout(replicate(Net())))
    out["plain"] = summary(replica_layout(Net()))
    out["world"] = summary(replica_layout(Net(), replicas="world"))
    fsdp = torch.nn.Linear(4, 4)
    fully_shard(fsdp, mesh=init_device_mesh("cpu", (2,)))
    out["fsdp2"] = summary(replica_layout(fsdp))
    hsdp = torch.nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(hsdp, mesh=mesh)
    out["hsdp"] = summary(replica_layout(hsdp))
    out["not_a_module"] = summary(replica_layout(object()))
    dist.barrier()
    return out


PARAMS = ["linear.weight", "linear.bias", "norm.weight", "norm.bias"]
STATS = {"running statistics (each rank's own batches update them)": 3}


@pytest.mark.slow
def test_layouts_of_real_wrappers():
    outcomes = run_ranks(_layouts, 2, timeout_s=120)
    for o in outcomes:
        assert o.error is None, o.error
        got = o.value
        both = (0, 1)
        # DDP: every parameter on every rank of its group; its buffers broadcast at each
        # forward, so not compared; running statistics never.
        assert got["ddp"] == {
            "sets": [(both, "ddp", PARAMS)],
            "left_out": {"buffers (DDP copies rank 0's to every rank at each forward)": 1, **STATS},
        }
        # broadcast_buffers=False: the buffer of its own is compared, the statistics are not.
        assert got["ddp_own_buffers"] == {
            "sets": [(both, "ddp", [*PARAMS, "scale"])],
            "left_out": STATS,
        }
        assert got["wrapper_apart"]["sets"] == [(both, "ddp", PARAMS)]
        assert got["replicate"]["sets"] == [(both, "ddp", PARAMS)]
        assert got["plain"]["sets"] == [] and sum(got["plain"]["left_out"].values()) == 8
        assert got["world"] == {"sets": [(both, "world", [*PARAMS, "scale"])], "left_out": STATS}
        # FSDP2 on a 1-D mesh: each rank its own shard, no replica.
        assert got["fsdp2"] == {
            "sets": [],
            "left_out": {"sharded with no replica (mesh (2,), replicated over none)": 2},
        }
        # HSDP (2 replicas of 1 shard): the replicate dimension.
        assert got["hsdp"] == {"sets": [(both, "mesh", ["weight", "bias"])], "left_out": {}}
        assert got["not_a_module"]["sets"] == []


def test_set_key_is_the_same_for_the_same_ranks_in_any_order():
    assert set_key([3, 1, 2]) == set_key((1, 2, 3)) != set_key((1, 2))
