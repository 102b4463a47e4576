"""The record of collectives on NCCL and PyTorch's flight recorder, on one CUDA rank.

Part 1 (one CUDA device): a world-size-1 NCCL group; the record is installed
(``CollectiveRecorder``), a few collectives are issued (blocking, ``async_op=True``,
on a second group, a barrier, then one FSDP2 step), and the script prints what the
record holds (each group's count from ``_get_sequence_number_for_group``, the last
calls with their lines) and what the flight recorder keeps (``flight_recorder()``:
entries, or why none); then three DDP steps of a model with buffers: its buffer
broadcasts and gradient buckets as the record tells them, each beside the flight
recorder's entry of its number (``agrees``: op and size match). Part 2 (``--gloo``,
CPU): the 2-process desyncs of ``benchmarks/detection.py`` that no stack shows (an
async collective on one rank, an extra metric reduction), with the watchdog's short
settings, printing time to report, exit codes and the rank and line named.

Usage: ``PYTHONPATH=src:. python benchmarks/collective_record_gpu.py [--gloo]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
logger = logging.getLogger("collective_record_gpu")


def nccl_part() -> dict:
    """Issues collectives on a 1-rank NCCL group with the record on; returns what was seen."""
    # Before the process group: torch 2.7 reads the first, 2.8+ the second.
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    import torch
    import torch.distributed as dist

    from rankguard.callbacks.hang.collective_files import flight_recorder
    from rankguard.callbacks.hang.collectives import CollectiveRecorder, sequence_reader
    from rankguard.callbacks.hang.stacks import library_paths

    found: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        found["skipped"] = "no CUDA device"
        return found
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        side = dist.new_group(backend="nccl")
        recorder = CollectiveRecorder(tmp, 0, library_paths())
        found["installed"] = recorder.install()
        found["world_sequence_reader"] = sequence_reader(dist.group.WORLD) is not None
        t = torch.ones(1024, device="cuda")
        dist.all_reduce(t)  # returns at once on NCCL: the stream waits, not the thread
        work = dist.all_reduce(t, group=side, async_op=True)
        dist.broadcast(t, src=0)
        dist.all_gather_into_tensor(torch.empty(1024, device="cuda"), t)
        work.wait()
        dist.barrier()
        torch.cuda.synchronize()
        found["counts"] = recorder.counts()
        found["record"] = [
            {
                "group": g.name,
                "count": g.count,
                "last": [f"#{i.seq} {i.op} {i.dtype}[{i.numel}] at {i.where}" for i in g.last],
            }
            for g in recorder.snapshot()
        ]
        entries, source = flight_recorder()
        found["flight_recorder"] = source
        found["flight_entries"] = len(entries)
        found["flight_sample"] = [
            {
                k: e.get(k)
                for k in (
                    "record_id",
                    "collective_seq_id",
                    "profiling_name",
                    "state",
                    "input_sizes",
                )
            }
            for e in entries[:6]
        ]
        found["fsdp2"] = fsdp2_record(recorder)
        found["ddp"] = ddp_record(recorder)
        recorder.close(keep=False)
        dist.destroy_process_group()
    return found


def fsdp2_record(recorder) -> dict:
    """One FSDP2 step on the CUDA rank: the collectives FSDP2 issued, as the record holds them."""
    import torch
    import torch.distributed as dist

    from rankguard.callbacks.hang.collective_compare import describe_issued

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # torch < 2.6
        return {"skipped": str(exc)}
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    before = recorder.counts()
    loss = model(torch.randn(4, 64, device="cuda")).sum()  # all-gathers in the forward
    loss.backward()  # reduce-scatters in the backward
    torch.cuda.synchronize()
    return {
        "wrapped": sorted(
            n for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n)
        ),
        "counts_before": before,
        "counts_after": recorder.counts(),
        "last": [f"#{i.seq} {describe_issued(i)}" for g in recorder.snapshot() for i in g.last],
    }


def ddp_record(recorder) -> dict:
    """Three DDP steps with buffers on the CUDA rank: what the record tells of DDP's C++ calls.

    Each told call (a buffer broadcast, a gradient bucket) beside the flight recorder's
    entry of its number, where it keeps one: the told op and size should agree with it.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from rankguard.callbacks.hang.collective_compare import describe_issued
    from rankguard.callbacks.hang.collective_files import flight_recorder
    from rankguard.callbacks.hang.collective_infer import flight_calls

    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8)
    ).cuda()
    model = DistributedDataParallel(net, device_ids=[0], bucket_cap_mb=0.05)
    for _ in range(3):
        model(torch.randn(4, 64, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    (group, *_) = recorder.snapshot()
    flight = flight_calls(flight_recorder()[0], group.name)
    told = []
    for i in group.last:
        if i.origin is None:
            continue
        truth = flight.get(i.seq)
        agrees = None if truth is None else (truth.op, truth.numel) == (i.op, i.numel)
        told.append({"told": f"#{i.seq} {describe_issued(i)}", "agrees": agrees})
    return {"told": told, "flight_entries": len(flight)}


def gloo_part() -> str:
    """The 2-process CPU desyncs that only the record proves (``detection.py``, short mode)."""
    cmd = [
        sys.executable,
        str(HERE / "detection.py"),
        "--modes",
        "short",
        "--scenarios",
        "async_one_rank,metric_reductions",
        "--cap",
        "60",
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
    return proc.stdout + proc.stderr[-3000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo", action="store_true", help="also the 2-process gloo desyncs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("NCCL, one rank:\n%s", json.dumps(nccl_part(), indent=1, default=str))
    if args.gloo:
        logger.info("gloo, 2 processes (benchmarks/detection.py, short):\n%s", gloo_part())


if __name__ == "__main__":
    main()
