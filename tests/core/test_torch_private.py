"""Every private ``torch`` name rankguard reads (``callbacks/core/torch_private.py``).

Each test calls a reach against the installed torch (both worlds: 2.7 and 2.13) and
fails when torch renames or moves what it reads.
"""

from __future__ import annotations

import pytest
import torch

from rankguard.callbacks.core import torch_private
from tests.mp import run_ranks


def _reaches(rank, world_size):
    import torch.distributed as dist

    store = torch_private.default_store()
    store.set(f"probe{rank}", b"x")
    read = torch_private.sequence_reader(dist.group.WORLD)
    before = read()
    dist.all_reduce(torch.ones(1))
    dist.barrier()
    return {
        "store": store.get(f"probe{rank}"),
        "timeout_s": torch_private.group_timeout_s("cpu"),
        "sequence": (before, read()),
    }


def test_process_group_reaches_read_the_store_timeout_and_count():
    outcomes = run_ranks(_reaches, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
        # init_process_group's default timeout (30 min); one all_reduce and one barrier issued
        assert o.value == {"store": b"x", "timeout_s": 1800.0, "sequence": (0, 2)}


def test_flight_recorder_dumps_are_there():
    names = [name for name, dump in torch_private.flight_recorder_dumps() if callable(dump)]
    assert names, "no flight recorder dump function in this torch"
    assert set(names) <= set(torch_private.FLIGHT_RECORDER_DUMPS)


def test_forward_hook_dicts_hold_registered_hooks_by_id():
    module = torch.nn.Linear(2, 2)
    pre = module.register_forward_pre_hook(lambda m, args: None)
    post = module.register_forward_hook(lambda m, args, out: None, always_call=True)
    pres, posts, always = torch_private.forward_hook_dicts(module)
    assert pre.id in pres and post.id in posts and always.get(post.id) is True


def _abort(rank, world_size):
    import torch.distributed as dist

    store = torch_private.default_store()
    aborted = torch_private.abort_process_groups()
    store.set(f"after{rank}", b"x")  # the store outlives the groups: the ranks still meet
    store.wait([f"after{1 - rank}"])
    return aborted, dist.is_initialized(), torch_private.abort_process_groups()


def test_aborting_the_process_groups_leaves_the_store_answering():
    outcomes = run_ranks(_abort, 2, timeout_s=60)
    assert [(o.error, o.value) for o in outcomes] == [(None, (True, False, False))] * 2


def _ddp_reaches(rank, world_size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    module = torch_private.coalesced_broadcast_module()
    broadcast = getattr(module, torch_private.COALESCED_BROADCAST)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 64))
    model = DistributedDataParallel(layers, bucket_cap_mb=0.01)
    first = torch_private.ddp_logged(model)
    rebuilt = []
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        rebuilt.append(torch_private.ddp_rebuilt(model))
    logged = torch_private.ddp_logged(model)
    return {
        "module": module is dist and callable(broadcast),
        "first": (first["bucket_sizes"], first["dtypes"]),
        "rebuilt": rebuilt,
        "rebuilt_sizes": logged.get("rebuilt_bucket_sizes"),
    }


@pytest.mark.slow
def test_ddp_reaches_read_its_coalesced_broadcast_and_its_buckets():
    outcomes = run_ranks(_ddp_reaches, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
        # 4,480 float32 parameters: one first bucket, two once rebuilt in the second forward
        assert o.value["module"] and o.value["first"] == ("17920", "float")
        assert o.value["rebuilt"] == [False, True, True]
        sizes = [int(s) for s in o.value["rebuilt_sizes"].split(",")]
        assert len(sizes) == 2 and sum(sizes) == 17920


def _fsdp_name(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    fully_shard(net[1], mesh=mesh)
    fully_shard(net, mesh=mesh)
    net(torch.ones(1, 2)).sum().backward()  # lazy init names each group from the root
    groups = [m._get_fsdp_state()._fsdp_param_group for m in (net, net[1])]
    return [torch_private.fsdp_module_name(g) for g in groups], torch_private.fsdp_module_name(net)


@pytest.mark.slow
def test_fsdp2_parameter_groups_are_named_by_their_module():
    outcomes = run_ranks(_fsdp_name, 2, timeout_s=60)
    for o in outcomes:
        assert o.error is None, o.error
        assert o.value == (["", "1"], None)


def _replicate(rank, world_size):
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate

    before = replicate(torch.nn.Linear(2, 2), broadcast_buffers=False)
    settings = [torch_private.replicate_settings(before)]  # arguments kept until the forward
    after = replicate(torch.nn.Linear(2, 2))
    after(torch.ones(1, 2)).sum().backward()  # the forward builds its DDP
    settings.append(torch_private.replicate_settings(after))
    group = settings[1].pop("process_group")
    dist.barrier()
    return (
        settings,
        dist.get_process_group_ranks(group),
        torch_private.replicate_settings(torch.nn.Linear(2, 2)),
    )


@pytest.mark.slow
def test_replicate_settings_are_read_before_and_after_the_first_forward():
    for o in run_ranks(_replicate, 2, timeout_s=60):
        assert o.error is None, o.error
        settings, ranks, plain = o.value
        assert settings == [
            {"process_group": None, "device_mesh": None, "broadcast_buffers": False},
            {"device_mesh": None, "broadcast_buffers": True},
        ]
        assert ranks == [0, 1] and plain is None
