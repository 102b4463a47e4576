"""StragglerMonitor on the device: its per-step cost; what device time sees and host time missed.

Two parts, on ``cuda:0`` when there is a GPU, else on the CPU:

* **cost** (one process): train steps of an MLP (forward, backward, SGD step)
  with no monitor and with ``StragglerMonitor`` (its 2 per-step events, its
  forward hooks and, on CUDA, its pooled timing events), interleaved
  ``--repeats`` times; prints the fastest loop's step time of each (the least
  disturbed by other processes) and what the monitor adds per step, in wall
  time and in the training thread's CPU time (one intra-op thread on CPU, so
  that thread does all the work).
* **ranks** (``--ranks``, torchrun, 2 ranks, gloo, DDP; on a GPU both ranks
  share ``cuda:0``): a model whose forward takes milliseconds, healthy and
  then with rank 1's forward running 1.5x the kernels. Prints, per run and
  rank, the monitor's forward (the device's time on CUDA) and its scores and
  warning, and side by side today's host-time measure on the same batches
  (the host's time inside the same hooks) and the score it gives.

Usage: ``python benchmarks/straggler_device.py [--ranks] [--steps 300] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from launch import launch_nodes  # noqa: E402

from rankguard.callbacks import Event, EventFacts, GuardRunner, StragglerMonitor  # noqa: E402

#: (width, depth, batch) of the cost run's MLP: a forward of milliseconds on each device.
SHAPES = {"cuda": (2048, 8, 4096), "cpu": (128, 4, 64)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the benchmark's own clock, outside any step


def _loop(device: torch.device, steps: int, monitored: bool) -> tuple[float, float, int]:
    """Milliseconds per step (wall, this thread's CPU) and events in the monitor's pool."""
    width, depth, batch = SHAPES[device.type]
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)
    monitor = StragglerMonitor(interval=50, warmup_steps=0)
    runner = GuardRunner([monitor]) if monitored else None
    if runner is not None:
        runner.fire(Event.FIT_START, EventFacts(model=model, optimizer=optimizer))
    for _ in range(5):  # warm-up: allocator, kernels
        model(x).square().mean().backward()
    _sync(device)
    wall, cpu = time.perf_counter(), time.thread_time()
    for step in range(steps):
        facts = EventFacts(step=step)
        if runner is not None:
            runner.fire(Event.TRAIN_BATCH_START, facts)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if runner is not None:
            runner.fire(Event.TRAIN_BATCH_END, facts)
    _sync(device)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    timer = monitor._clock.timer
    events = timer.created if timer is not None else 0
    if runner is not None:
        runner.close()
    return 1000 * wall / steps, 1000 * cpu / steps, events


def cost(device: torch.device, steps: int, repeats: int) -> None:
    """Prints the per-step cost table."""
    runs: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for _ in range(repeats):
        for monitored in (False, True):
            runs[monitored].append(_loop(device, steps, monitored))

    def fastest(monitored: bool, i: int) -> float:
        return min(r[i] for r in runs[monitored])

    width, depth, batch = SHAPES[device.type]
    print(
        f"StragglerMonitor per-step cost on {device} (MLP {depth}x{width}, batch {batch}, "
        f"{steps} steps x {repeats} interleaved repeats, fastest loop)"
    )
    print(f"{'':>22} | {'off':>9} | {'on':>9} | {'added':>9} | added / step")
    for i, label in ((0, "step, wall (ms)"), (1, "step, thread CPU (ms)")):
        off, on = fastest(False, i), fastest(True, i)
        print(
            f"{label:>22} | {off:>9.3f} | {on:>9.3f} | {1000 * (on - off):>6.1f} us | "
            f"{100 * (on - off) / off:+.2f}%"
        )
    print(f"timing events in the pool: {max(r[2] for r in runs[True])} (0: host time)", flush=True)


def ranks(args: argparse.Namespace) -> None:
    """Runs the 2-rank comparison and prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        worker = [str(out), "--steps", str(args.rank_steps), "--settings", args.settings]
        results = launch_nodes(HERE / "straggler_device_worker.py", worker, 1, 2, timeout=1200)
        if not out.exists():
            raise SystemExit(f"the run failed:\n{results[0].stderr[-3000:]}")
        report = json.loads(out.read_text())
    a = report["args"]
    print(
        f"\n2 ranks on {report['device']}, gloo, DDP, {a['depth']} blocks of {a['width']}, "
        f"batch {a['batch']}, {a['steps']} steps, settings {a['settings']}"
    )
    print(
        f"{'run':>20} | rank | step ms | device fwd ms | device score min per verdict "
        "| named at | host fwd ms | host score"
    )
    for name, per_rank in report["runs"].items():
        host_ref = min(r["host_forward_s"] for r in per_rank)
        for rank, r in enumerate(per_rank):
            dev = r["device_forward_s"]
            scores = ", ".join(f"{s:.2f}" for s in r["score_min"])
            named = ",".join(map(str, r["named_at"])) or "-"
            print(
                f"{name:>20} | {rank:>4} | {r['step_ms']:>7.1f} | "
                f"{'-' if dev is None else f'{1000 * dev:.2f}':>13} | {scores:<28} | "
                f"{named:>8} | {1000 * r['host_forward_s']:>11.2f} | "
                f"{host_ref / r['host_forward_s']:.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per cost loop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", action="store_true", help="also the 2-rank comparison")
    parser.add_argument("--rank-steps", type=int, default=80)
    parser.add_argument("--settings", default='{"interval": 10, "warmup_steps": 10}')
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    cost(device, args.steps, args.repeats)
    if args.ranks:
        ranks(args)


if __name__ == "__main__":
    main()
