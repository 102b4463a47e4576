"""One rank of ``benchmarks/straggler_device.py --ranks`` (torchrun, 2 ranks, gloo).

Both ranks train the same DDP model on ``cuda:0`` (one GPU shared; NCCL refuses
two ranks on one device, gloo does not) or on the CPU without one. Its forward
runs its blocks ``reps`` times: 2 on a healthy rank, 3 on rank 1 in the slow
scenario (1.5x the kernels). Each run records, per rank, what
``StragglerMonitor`` scored (device time on CUDA) and, on the same batches,
today's host-time measure (a host-only clock on the same modules). Rank 0
writes both to ``OUT`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from rankguard.callbacks import Event, EventFacts, GuardRunner, StragglerMonitor
from rankguard.callbacks.straggler.forward_clock import ForwardClock


class HostClock(ForwardClock):
    """The host's time inside the hooked forwards whatever the device (the code before issue 22)."""

    def attach(self, model: torch.nn.Module) -> int:
        hooked = super().attach(model)
        self.timer = None
        return hooked


class Blocks(torch.nn.Module):
    """``depth`` Linear+GELU blocks run ``reps`` times per forward (same weights each time)."""

    def __init__(self, width: int, depth: int, reps: int) -> None:
        super().__init__()
        self.reps = reps
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            for block in self.blocks:
                x = block(x)
        return x


class Warnings(logging.Handler):
    """rankguard's warnings with the batch they came at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.batch = 0
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((self.batch, record.getMessage()))


def run(args: argparse.Namespace, device: torch.device, slow: bool) -> dict[str, Any]:
    """Trains one scenario; returns this rank's device and host measures."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    reps = 3 if slow and rank == 1 else 2
    model = DistributedDataParallel(Blocks(args.width, args.depth, reps).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    settings = json.loads(args.settings)
    monitor = StragglerMonitor(**settings)
    runner = GuardRunner([monitor], exchange_timeout_s=120)
    host = HostClock()
    host.attach(model)
    records = Warnings()
    logging.getLogger("rankguard").addHandler(records)
    metrics: list[dict] = []
    x = torch.randn(args.batch, args.width, device=device)
    start = time.perf_counter()
    try:
        runner.fire(Event.FIT_START, EventFacts(model=model, optimizer=optimizer), metrics.append)
        for step in range(args.steps):
            records.batch = step + 1
            facts = EventFacts(step=step)
            runner.fire(Event.TRAIN_BATCH_START, facts)
            host.begin_batch()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            host.end_batch(step >= monitor.warmup_steps)
            runner.fire(Event.TRAIN_BATCH_END, facts)
        runner.fire(Event.FIT_END, EventFacts(step=args.steps))
    finally:
        runner.close()
        host.detach()
        logging.getLogger("rankguard").removeHandler(records)
    elapsed = time.perf_counter() - start
    forward = [
        m["rankguard/straggler_forward_s"] for m in metrics if "rankguard/straggler_forward_s" in m
    ]
    host_forward = host.ready()
    interval = monitor.interval
    return {
        "device_forward_s": statistics.median(forward) if forward else None,
        "score_min": [m["rankguard/straggler_score_min"] for m in metrics],
        "named_at": [
            b for b, m in records.records if "Straggler: rank" in m or "Straggler: node" in m
        ],
        "host_forward_s": statistics.median(host_forward),
        "host_intervals": [
            statistics.median(host_forward[i : i + interval])
            for i in range(0, len(host_forward), interval)
        ],
        "step_ms": 1000 * elapsed / args.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--width", type=int, help="default: 2048 on CUDA, 256 on CPU")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, help="default: 8192 on CUDA, 256 on CPU")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--settings", default='{"interval": 10, "warmup_steps": 10}')
    args = parser.parse_args()
    dist.init_process_group("gloo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    args.width = args.width or (2048 if cuda else 256)  # a forward of milliseconds on each
    args.batch = args.batch or (8192 if cuda else 256)
    if not cuda:
        torch.set_num_threads(1)  # two ranks on shared cores
    report: dict[str, Any] = {"device": str(device), "args": vars(args), "runs": {}}
    for name, slow in (("healthy", False), ("rank 1 1.5x kernels", True)):
        mine = run(args, device, slow)
        both: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(both, mine)
        report["runs"][name] = both
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
