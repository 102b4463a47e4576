"""One rank of benchmarks/scale.py and tests/test_multinode.py (launched by torchrun per node).

Runs the fit-start checks of RankGuard's guards and a status-sized exchange
``REPEATS`` times through the side channel, then rank 0 writes per-rank
timings and bytes to ``OUT``. With ``--uneven`` the upper half of the ranks
hold a longer eval set, and rank 0 records the error every rank raised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.callbacks import Event, EventFacts, LoaderFacts, RankGuardError, SideChannel
from rankguard.callbacks.registry import build_guards
from tests.e2e.common import Points


def loaders(rank: int, world: int, uneven: bool) -> list[LoaderFacts]:
    train = Points(64 * world)
    n_eval = 16 * world * (2 if uneven and rank >= world // 2 else 1)
    evals = Points(n_eval)
    return [
        LoaderFacts(
            "train", DataLoader(train, 4, sampler=DistributedSampler(train, world, rank)), True
        ),
        LoaderFacts(
            "eval", DataLoader(evals, 4, sampler=DistributedSampler(evals, world, rank)), False
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--uneven", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = SideChannel.from_environment(timeout_s=120)
    guards = build_guards({})
    for guard in guards:
        guard.bind(channel)
    facts = EventFacts(loaders=loaders(rank, world, args.uneven))
    check_s, status_s, error = [], [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        try:
            for guard in guards:
                guard.handle(Event.FIT_START, facts)
        except RankGuardError as exc:
            error = f"{type(exc).__name__}: {exc}"
        check_s.append(time.perf_counter() - start)
    check_bytes = (channel.bytes_sent, channel.bytes_received)
    status = {"phase": "train batch 2001", "step": 2001, "idle_s": 0.5, "host": os.uname()[1]}
    for _ in range(args.repeats):
        start = time.perf_counter()
        channel.exchange("status", {**status, "rank": rank}, lambda v: len(v))
        status_s.append(time.perf_counter() - start)
    mine = {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "check_s": statistics.median(check_s),
        "status_s": statistics.median(status_s),
        "check_bytes": check_bytes,
        "status_bytes": (
            channel.bytes_sent - check_bytes[0],
            channel.bytes_received - check_bytes[1],
        ),
        "error": error,
    }
    everyone = channel.all_gather("report", mine)  # measurement only, after the timed part
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "ranks": [everyone[r] for r in range(world)]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
