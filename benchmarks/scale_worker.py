"""One rank of benchmarks/scale.py and tests/checkpoint/test_multinode.py (torchrun, per node).

Default: measures each guard's cross-rank checks, one guard at a time on its
own side channel, at every event where it exchanges (the events a real
training fires, with real loaders, a real model and a real checkpoint
folder), ``--repeats`` times: wall and CPU time (``time.process_time``, all
of this process's threads, the store server's included on rank 0), store
exchanges, bytes sent and received; then the straggler monitor's interval
exchange, which runs on a background thread (the main thread's time at the
batch that posts it and at the one that collects the verdict); then the hang
watchdog's status exchanges from its real background thread. Rank 0 writes
every rank's figures to ``OUT``. ``--only straggler_monitor`` measures that
monitor alone.

With ``--uneven`` the upper half of the ranks hold a longer eval set; the
fit-start checks of every guard run once and rank 0 records the error every
rank raised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.callbacks import (
    Event,
    EventFacts,
    LoaderFacts,
    RankGuardError,
    ResumeFacts,
    SideChannel,
)
from rankguard.callbacks.registry import GUARDS, build_guard, build_guards
from tests.e2e.common import Points

#: The events at which each guard exchanges, in the order a training fires them.
CHECKS: dict[str, tuple[str, ...]] = {
    "data_consistency_guard": ("fit_start", "eval_start"),
    "drop_last_guard": ("fit_start",),
    "batch_parity_guard": ("fit_start", "eval_start", "eval_end", "epoch_end"),
    "shared_dir_barrier": ("fit_start", "checkpoint_save_start"),
    # The pattern at each save; then a resumed fit's check (no exchange at a fresh fit's start).
    "resume_guard": ("fit_start", "checkpoint_save_start", "resumed"),
    "checkpoint_planner": ("fit_start",),
    "data_stall_monitor": ("interval",),
}
EVAL_BATCHES = 4


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


class Meter:
    """Wall time, CPU time and side-channel traffic of one timed call."""

    def __init__(self, channel: SideChannel) -> None:
        self.channel = channel
        self.samples: dict[str, list[dict[str, float]]] = {}

    def time(
        self, key: str, call: Callable[[], object], then: Callable[[], object] | None = None
    ) -> None:
        """Times ``call``; ``then`` (untimed) waits for what it left to a background thread."""
        c = self.channel
        before = (c.exchanges, c.bytes_sent, c.bytes_received, c.decide_s)
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if then is not None:
            then()
        sample = {
            "wall_s": wall,
            "cpu_s": cpu,
            "exchanges": c.exchanges - before[0],
            "sent": c.bytes_sent - before[1],
            "received": c.bytes_received - before[2],
            "decide_s": c.decide_s - before[3],
        }
        self.samples.setdefault(key, []).append(sample)

    def medians(self) -> dict[str, dict[str, float]]:
        return {
            key: {field: statistics.median(s[field] for s in samples) for field in samples[0]}
            for key, samples in self.samples.items()
        }


def measure_guard(name: str, facts: EventFacts, folder: str, repeats: int) -> dict:
    """Times ``name``'s exchanging events; returns medians per event."""
    settings = {"interval": 10} if name == "data_stall_monitor" else {}
    guard = build_guard(GUARDS[name], settings)
    channel = SideChannel.from_environment(timeout_s=120, name=f"scale/{name}")
    guard.bind(channel)
    meter = Meter(channel)
    train, evals = facts.loaders
    eval_facts = EventFacts(loader=evals, step=1)
    train_facts = EventFacts(loader=train, step=1)
    save_facts = EventFacts(step=1, model=facts.model, directories=[folder])
    for _ in range(repeats):
        for event in CHECKS[name]:
            if event == "fit_start":
                meter.time(event, lambda: guard.handle(Event.FIT_START, facts))
            elif event == "eval_start":
                meter.time(event, lambda: guard.handle(Event.EVAL_START, eval_facts))
            elif event == "eval_end":
                for _ in range(EVAL_BATCHES):
                    guard.handle(Event.EVAL_BATCH_END, eval_facts)
                meter.time(event, lambda: guard.handle(Event.EVAL_END, eval_facts))
            elif event == "epoch_end":
                meter.time(event, lambda: guard.handle(Event.EPOCH_END, train_facts))
            elif event == "checkpoint_save_start":
                meter.time(event, lambda: guard.handle(Event.CHECKPOINT_SAVE_START, save_facts))
            elif event == "resumed":  # from a checkpoint holding the last save's digests
                guard.load_state_dict(guard.state_dict())
                resume = ResumeFacts("bench", folder, {"step": 8}, train.loader, folder=folder)
                resumed = EventFacts(step=8, resume=resume)
                meter.time(event, lambda r=resumed: guard.handle(Event.RESUMED, r))
            elif event == "interval":  # the 10th train batch start exchanges
                guard.handle(Event.FIT_START, facts)
                for _ in range(settings["interval"] - 1):
                    guard.handle(Event.TRAIN_BATCH_START, EventFacts(step=1))
                # Posted to the interval exchange's thread: counted once its verdict is in.
                meter.time(
                    event,
                    lambda: guard.handle(Event.TRAIN_BATCH_START, EventFacts()),
                    lambda: guard._pending.result(120),
                )
    guard.close()
    return meter.medians()


def measure_straggler(facts: EventFacts, repeats: int, step_s: float = 0.01) -> dict:
    """The straggler monitor's interval exchange, posted and collected by the main thread.

    Every batch runs the model's forward between TRAIN_BATCH_START and END
    (every interval is scored), then takes ``step_s``
    more and all-reduces one number, which keeps the ranks in step as a
    training's collectives do. Per exchange: the main thread's wall time at
    the batch that posts it and at the one that collects its verdict
    (``interval // 2`` batches later; the first exchange also starts the
    thread and its store connection), bytes, and rank 0's decide time.
    """
    interval = 10
    settings = {"interval": interval, "warmup_steps": 0}
    guard = build_guard(GUARDS["straggler_monitor"], settings)
    channel = SideChannel.from_environment(timeout_s=120, name="scale/straggler_monitor")
    guard.bind(channel)
    guard.handle(Event.FIT_START, facts)
    x = torch.zeros(4, 64)
    post, collect = [], []
    for batch in range(1, repeats * interval + interval // 2 + 1):
        start = time.perf_counter()
        guard.handle(Event.TRAIN_BATCH_START, EventFacts(step=batch))
        took = time.perf_counter() - start
        if batch % interval == 0:
            post.append(took)
        elif batch % interval == interval // 2 and batch > interval:
            collect.append(took)
        facts.model(x)
        time.sleep(step_s)
        dist.all_reduce(torch.zeros(1))
        guard.handle(Event.TRAIN_BATCH_END, EventFacts(step=batch))
    guard.close()
    n = max(channel.exchanges, 1)
    return {
        "interval": {
            "exchanges": channel.exchanges / max(repeats, 1),
            "sent": channel.bytes_sent / n,
            "received": channel.bytes_received / n,
            "decide_s": channel.decide_s / n,
            "post_wall_s": statistics.median(post),
            "collect_wall_s": statistics.median(collect),
            "collect_wall_max_s": max(collect),
        }
    }


def measure_watchdog(facts: EventFacts, folder: str, seconds: float) -> dict:
    """The real watchdog thread's status exchanges over ``seconds``: per-exchange figures."""
    guard = build_guard(GUARDS["hang_watchdog"], {"exchange_period_s": 0.5, "report_dir": folder})
    channel = SideChannel.from_environment(timeout_s=120, name="scale/hang_watchdog")
    guard.bind(channel)
    cpu = time.process_time()
    guard.handle(Event.FIT_START, facts)
    guard.handle(Event.TRAIN_BATCH_START, EventFacts(step=1))
    time.sleep(seconds)
    guard.close()
    n = max(channel.exchanges, 1)
    return {
        "status": {
            "exchanges": channel.exchanges,
            "sent": channel.bytes_sent / n,
            "received": channel.bytes_received / n,
            "decide_s": channel.decide_s / n,
            # The thread sleeps between exchanges: CPU, not wall time, is its cost.
            "cpu_s": (time.process_time() - cpu) / n,
        }
    }


def fit_start_all(facts: EventFacts) -> str | None:
    """Every guard's fit-start checks, as ``RankGuard()`` runs them; the error raised, if any."""
    guards = [g for g in build_guards({}) if g.name != "hang_watchdog"]
    channel = SideChannel.from_environment(timeout_s=120)
    for guard in guards:
        guard.bind(channel)
    try:
        for guard in guards:
            guard.handle(Event.FIT_START, facts)
    except RankGuardError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        for guard in guards:
            guard.close()
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--watchdog-s", type=float, default=5.0)
    parser.add_argument("--folder", default=None, help="checkpoint folder every rank sees")
    parser.add_argument("--only", choices=["straggler_monitor"], default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    folder = args.folder or os.path.join(tempfile.gettempdir(), "rankguard-scale", "ckpt")
    facts = EventFacts(
        loaders=loaders(rank, world, args.uneven),
        model=model,
        optimizer=torch.optim.Adam(model.parameters()),
        directories=[folder],
    )
    mine: dict = {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
    }
    if args.uneven:
        mine["error"] = fit_start_all(facts)
    elif args.only == "straggler_monitor":
        mine["checks"] = {"straggler_monitor": measure_straggler(facts, args.repeats)}
    else:
        walls, cpus = [], []
        for _ in range(args.repeats):
            start = time.perf_counter(), time.process_time()
            mine["error"] = fit_start_all(facts)
            walls.append(time.perf_counter() - start[0])
            cpus.append(time.process_time() - start[1])
        mine["fit_start"] = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}
        mine["checks"] = {name: measure_guard(name, facts, folder, args.repeats) for name in CHECKS}
        mine["checks"]["straggler_monitor"] = measure_straggler(facts, args.repeats)
        # Start every rank's watchdog together: its first exchange waits for all of them.
        SideChannel.from_environment(timeout_s=300, name="scale/start").barrier("watchdog")
        mine["checks"]["hang_watchdog"] = measure_watchdog(facts, folder, args.watchdog_s)
    report = SideChannel.from_environment(timeout_s=300, name="scale/report")
    everyone = report.all_gather("report", mine)  # measurement only, after the timed part
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "ranks": [everyone[r] for r in range(world)]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
