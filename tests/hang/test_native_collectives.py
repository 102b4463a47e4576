"""The collectives DDP and FSDP issue, told by the record: real gloo ranks, and the pure parts.

DDP's buffer broadcast (a C++ call, wrapped) and its gradient all-reduces (issued from C++,
told from its forwards' marks), FSDP2's all-gathers and reduce-scatters (the hooks that
issued them), in both worlds (torch 2.7 and 2.13); a healthy run's records agree on every
rank, so nothing told differs where nothing does.
"""

from __future__ import annotations

import pytest
import torch

from rankguard.callbacks.hang.collective_compare import Issued, Mark, differences
from rankguard.callbacks.hang.collective_files import read_files
from rankguard.callbacks.hang.collective_infer import (
    Buckets,
    buckets_of,
    flight_calls,
    group_record,
)
from rankguard.callbacks.hang.collective_sources import coalesced_buckets
from rankguard.callbacks.hang.collectives import CollectiveRecorder
from rankguard.callbacks.hang.stacks import library_paths
from tests.mp import run_ranks

# -- DDP's buffer broadcast: the buckets C++ flattens, one broadcast each ----------------------


def _coalesced(rank, world_size, limit):
    import torch.distributed as dist

    tensors = [torch.ones(3), torch.ones(2, dtype=torch.int64), torch.ones(5), torch.ones(1)]
    before = dist.group.WORLD._get_sequence_number_for_group()
    dist._broadcast_coalesced(dist.group.WORLD, tensors, limit, 0)
    return dist.group.WORLD._get_sequence_number_for_group() - before


def test_a_coalesced_broadcast_is_told_as_the_broadcasts_cpp_issues():
    # One bucket per dtype under the limit; float32 closes at 16 bytes (4 floats) above it.
    assert coalesced_buckets(_tensors(), 1 << 20) == [(torch.float32, 9), (torch.int64, 2)]
    assert coalesced_buckets(_tensors(), 16) == [
        (torch.float32, 8),
        (torch.int64, 2),
        (torch.float32, 1),
    ]
    for limit, told in ((1 << 20, 2), (16, 3)):
        outcomes = run_ranks(_coalesced, 2, limit, timeout_s=60)
        assert [(o.error, o.value) for o in outcomes] == [(None, told)] * 2


def _tensors():
    return [torch.ones(3), torch.ones(2, dtype=torch.int64), torch.ones(5), torch.ones(1)]


# -- DDP: the buffers before each forward, the buckets after it ----------------------------


def _ddp(rank, world_size, report_dir, skip_at):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 64)
    )
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)  # two buckets once rebuilt
    phase = ["fit_start", 0, None]
    recorder = CollectiveRecorder(report_dir, rank, library_paths(), phase=lambda: tuple(phase))
    assert recorder.install()
    try:
        for step in range(1, 6):
            phase[:] = ["train_batch_start", step, None]
            loss = model(torch.randn(4, 8)).sum()
            if rank == 1 and step == skip_at:
                break
            loss.backward()
            dist.all_reduce(loss.detach())  # the user's own, between DDP's
        records = recorder.snapshot()
        logged = model._get_ddp_logging_data()
        return records, logged.get("rebuilt_bucket_sizes"), dist.get_rank()
    finally:
        recorder.close(keep=True)


@pytest.mark.slow
def test_a_healthy_ddp_run_tells_its_buffers_and_buckets_alike_on_every_rank(tmp_path):
    outcomes = run_ranks(_ddp, 2, str(tmp_path), None, timeout_s=90)
    assert [o.error for o in outcomes] == [None, None], outcomes
    records = {o.value[2]: o.value[0] for o in outcomes}
    assert differences(records) == []  # told alike: nothing differs where nothing does
    (group,) = records[0]
    calls = [i for i in group.last if i.origin is not None]
    words = [(i.op, i.dtype, i.numel, i.origin, i.phase) for i in calls]
    buffers = "module buffers in {at}'s forward (DDP's broadcast_buffers)"
    assert ("broadcast", "float32", 128, buffers, "train batch 5") in words, words
    assert ("broadcast", "int64", 1, buffers, "train batch 5") in words, words
    # Rebuilt in the second forward: two buckets, their sizes as DDP's logger has them.
    sizes = [int(s) for s in outcomes[0].value[1].split(",")]
    bucket = "gradient bucket {j} of {{at}}'s backward (DDP)"
    told = [(i.numel * 4, i.origin, i.phase) for i in calls if i.op == "all_reduce"]
    assert told[-2:] == [
        (sizes[0], bucket.format(j=0), "train batch 5"),
        (sizes[1], bucket.format(j=1), "train batch 5"),
    ], told
    assert all(i.where is None and i.thread == "MainThread" for i in calls if i.op == "all_reduce")
    # The same from the files a dead rank leaves.
    assert read_files(tmp_path)[1][0].last[-3:] == records[1][0].last[-3:]


@pytest.mark.slow
def test_a_skipped_backward_is_told_as_its_buckets_against_the_next_forwards_buffers(tmp_path):
    outcomes = run_ranks(_ddp, 2, str(tmp_path), 4, timeout_s=90, until=[1])
    rank1 = next(o for o in outcomes if o.rank == 1)
    assert rank1.error is None, rank1.error
    (group,) = rank1.value[0]
    last = group.last[-1]
    assert (last.op, last.phase) == ("broadcast", "train batch 4"), group.last
    assert not [i for i in group.last if i.op == "all_reduce" and i.phase == "train batch 4"]


# -- FSDP2: the hook that issued each all-gather and reduce-scatter ---------------------------


def _fsdp2(rank, world_size, report_dir):
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    phase = ["train_batch_start", 7, None]
    recorder = CollectiveRecorder(report_dir, rank, library_paths(), phase=lambda: tuple(phase))
    assert recorder.install()
    try:
        net(torch.randn(2, 8)).sum().backward()
        return recorder.snapshot()
    finally:
        recorder.close(keep=False)


@pytest.mark.slow
def test_fsdp2_collectives_name_their_module_and_the_pass_that_issued_them(tmp_path):
    outcomes = run_ranks(_fsdp2, 2, str(tmp_path), timeout_s=90)
    assert [o.error for o in outcomes] == [None, None], outcomes
    (group,) = outcomes[0].value
    said = [(i.op.split("_")[0], i.origin, i.phase) for i in group.last]
    gather = "FSDP's all-gather of the parameters of module {!r} for {{at}}'s {}"
    scatter = "FSDP's reduce-scatter of the gradients of module {!r} in {{at}}'s backward"
    assert ("all", gather.format("2", "forward"), "train batch 7") in said, said
    assert ("reduce", scatter.format("2", "backward"), "train batch 7") in said, said
    backward = [o for _, o, _ in said if o.endswith("backward") and "all-gather" in o]
    assert backward, said  # re-gathered for the backward (resharded after the forward)
    assert differences({o.rank: o.value for o in outcomes}) == []


# -- the pure parts -----------------------------------------------------------------------


def _mark(start, end, reduces=True, phase="train batch 5"):
    return Mark(start, end, reduces, 0, phase, "MainThread", 1.0)


def _call(seq, op="all_reduce"):
    return Issued(seq, op, "float32", 1, "train.py:9 (f): dist.all_reduce(t)", "MainThread", 2.0)


def test_buckets_are_told_after_a_reducing_forward_in_order_and_no_further():
    buckets = [Buckets((400, 40), "float32", None)]
    # forward 1 [10..12], its backward issues 13, 14 (buckets) and the user's 15; forward 2.
    marks = [_mark(10, 12), _mark(15, 17, phase="train batch 6")]
    rec = group_record("0", (0, 1), 20, [_call(15)], marks, buckets, last=8, cut=False)
    told = {i.seq: (i.numel, i.origin, i.phase) for i in rec.last if i.origin}
    bucket = "gradient bucket {} of {{at}}'s backward (DDP)"
    assert told == {
        13: (100, bucket.format(0), "train batch 5"),
        14: (10, bucket.format(1), "train batch 5"),
        18: (100, bucket.format(0), "train batch 6"),
        19: (10, bucket.format(1), "train batch 6"),
    }  # 11, 12 (inside forward 1: its rebuild) and 20 (past the last bucket) stay untold
    # no_sync (or eval): no buckets after that forward.
    quiet = group_record("0", (0, 1), 14, [], [_mark(10, 12, False)], buckets, last=8, cut=False)
    assert quiet.last == ()
    # Numbers before the oldest Python call held may hide calls that left the ring.
    cut = group_record("0", (0, 1), 20, [_call(16)], marks, buckets, last=8, cut=True)
    assert {i.seq for i in cut.last if i.origin} == {18, 19}


def test_a_rebuilt_bucket_not_yet_logged_is_told_without_its_size_and_the_used_map_last():
    rebuilt = [Buckets((), "float32", None)]
    unsized = group_record("0", (0, 1), 13, [], [_mark(10, 12)], rebuilt, last=8, cut=False)
    (call,) = unsized.last
    assert (call.dtype, call.numel) == ("?", -1)
    # a rank whose logger had the rebuilt sizes already tells the same bucket with its size:
    # not a difference (seen on a resume mid-epoch, a healthy run)
    logged = [Buckets((12_292,), "float32", None)]
    sized = group_record("0", (0, 1), 13, [], [_mark(10, 12)], logged, last=8, cut=False)
    assert sized.last[0].numel == 3_073
    assert differences({0: (unsized,), 1: (sized,)}) == []
    unused = [Buckets((40,), "float32", 6)]
    rec = group_record("0", (0, 1), 14, [], [_mark(10, 12)], unused, last=8, cut=False)
    assert [(i.op, i.dtype, i.numel) for i in rec.last] == [
        ("all_reduce", "float32", 10),
        ("all_reduce", "int32", 6),
    ]


def test_ddp_logger_data_and_the_flight_recorder_are_read_as_the_record_names_them():
    logged = {"bucket_sizes": "840", "rebuilt_bucket_sizes": "17160, 2816", "dtypes": "float"}
    assert buckets_of(logged) == Buckets((17160, 2816), "float32", None)
    mixed = {"bucket_sizes": "8, 4", "dtypes": "float, c10::Half", "find_unused_parameters": 1}
    assert buckets_of({**mixed, "num_parameter_tensors": 3}) == Buckets((8, 4), None, 3)
    entries = [
        {
            "collective_seq_id": 13,
            "process_group": ["0", "default_pg"],
            "profiling_name": "gloo:all_reduce",
            "input_sizes": [[25]],
            "input_dtypes": ["Float"],
        },
        {"collective_seq_id": 2, "process_group": ["1", "side"], "profiling_name": "nccl:x"},
    ]
    (call,) = flight_calls(entries, "0").values()
    assert (call.seq, call.op, call.dtype, call.numel, call.thread) == (
        13,
        "all_reduce",
        "float32",
        25,
        "",
    )
    # It corrects a told size, keeps what issued it; a number told by nothing else is its.
    buckets = [Buckets((), "float32", None)]
    flight = {13: call, 14: call._replace(seq=14, op="broadcast")}
    rec = group_record(
        "0", (0, 1), 14, [], [_mark(10, 12)], buckets, last=8, cut=False, flight=flight
    )
    first, second = rec.last
    assert (first.numel, first.origin, first.thread) == (
        25,
        "gradient bucket 0 of {at}'s backward (DDP)",
        "MainThread",
    )
    assert (second.op, second.origin) == ("broadcast", None)
