"""Every private ``torch`` name rankguard reads (``callbacks/core/torch_private.py``).

Each test calls a reach against the installed torch (both worlds: 2.7 and 2.13) and
fails when torch renames or moves what it reads.
"""

from __future__ import annotations

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


def test_replicate_settings_are_read_before_and_after_the_first_forward():
    for o in run_ranks(_replicate, 2, timeout_s=60):
        assert o.error is None, o.error
        settings, ranks, plain = o.value
        assert settings == [
            {"process_group": None, "device_mesh": None, "broadcast_buffers": False},
            {"device_mesh": None, "broadcast_buffers": True},
        ]
        assert ranks == [0, 1] and plain is None
