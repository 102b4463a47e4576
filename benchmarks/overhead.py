"""Overhead of RankGuard() on healthy 2-rank training: Composer, Lightning, a loop, the HF Trainer.

Runs interleaved fits with and without ``RankGuard()`` (ABBA order) in one
launch per framework (``torch``: a hand-written DDP loop with
``rankguard.integrations.torch``; ``transformers``: the Hugging Face
``Trainer``) and prints the median wall-time ratio; the time spent inside
rankguard's event dispatch during the guarded fits (a direct, noise-free
measure of its share); the per-step CPU time inside the adapter (its per-step
entry points: dispatch plus the adapter's own translation, fit start and end
left out; the training thread's CPU time, which other processes on the cores
do not inflate), the figure to compare between adapters; the per-step CPU time
in the straggler monitor's forward hooks; and the per-step cost of the guards'
hooks measured in-process, with and without the straggler monitor. Targets:
ratio <= 1.01 with steps of >= 10 ms; every adapter's per-step time within
10% of Composer's. On a
2-core machine running 2 ranks, fit-to-fit noise is several percent: read
the ratio together with the measured share.

Usage: ``python benchmarks/overhead.py [--rounds 3] [--steps 200] [--frameworks composer,torch]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_framework(framework: str, rounds: int, steps: int, config: str = "{}") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        job = [str(HERE / "overhead_job.py"), framework, str(rounds), str(steps), str(out)]
        bin_dir = Path(sys.executable).parent
        if framework == "composer":
            cmd = [str(bin_dir / "composer"), "-n", "2", *job]
        elif framework in ("torch", "transformers"):
            cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", *job]
        else:
            cmd = [sys.executable, *job]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANKGUARD_BENCH_CONFIG": config}
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(
                f"{framework} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def hook_costs_us(steps: int = 2000, repeats: int = 40) -> dict[str, float]:
    """Per-step cost of RankGuard's per-step work at world size 1, in microseconds.

    Every loop runs one forward of a Linear model per step (given at FIT_START,
    so the straggler monitor hooks it and stays on), with the 4 per-step events
    around it or not. Loops are interleaved ``repeats`` times; the fastest of
    each is kept, and the loop without rankguard is subtracted. Timed in this
    thread's CPU time (``time.thread_time``): time the thread spends descheduled
    on a busy machine is not rankguard's cost.

    Returns:
        ``events``: the 4 events through every guard; ``events_without_straggler``:
        the same with ``straggler_monitor=False``; ``forward_hooks``: the
        monitor's forward hooks, per hooked forward.
    """
    import torch

    from rankguard.callbacks.events import Event, EventFacts
    from rankguard.callbacks.forward_clock import ForwardClock
    from rankguard.callbacks.guard import GuardRunner
    from rankguard.callbacks.registry import build_guards

    model, x = torch.nn.Linear(4, 4), torch.zeros(1, 4)
    before = (Event.DATA_FETCH_START, Event.DATA_FETCH_END, Event.TRAIN_BATCH_START)

    def loop(config: dict | None = None, hooks_only: bool = False) -> float:
        runner = None if config is None else GuardRunner(build_guards(config))
        clock = ForwardClock()
        if hooks_only:
            clock.attach(model)
        if runner is not None:
            runner.fire(Event.FIT_START, EventFacts(model=model))
        start = time.thread_time()
        for step in range(steps):
            facts = EventFacts(step=step)
            if runner is not None:
                for event in before:
                    runner.fire(event, facts)
            model(x)
            if runner is not None:
                runner.fire(Event.TRAIN_BATCH_END, facts)
        elapsed = time.thread_time() - start
        clock.detach()
        if runner is not None:
            runner.close()
        return elapsed / steps * 1e6

    variants = {
        "bare": lambda: loop(),
        "hooks": lambda: loop(hooks_only=True),
        "all": lambda: loop({}),
        "without": lambda: loop({"straggler_monitor": False}),
    }
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            best[name] = min(best[name], run())
    return {
        "events": best["all"] - best["hooks"],
        "events_without_straggler": best["without"] - best["bare"],
        "forward_hooks": best["hooks"] - best["bare"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--frameworks", default="composer,lightning,torch,transformers")
    parser.add_argument(
        "--config",
        default="{}",
        help="RankGuard settings as JSON, e.g. '{\"hang_watchdog\": false}'",
    )
    args = parser.parse_args()
    header = ("framework", "steps", "ms/step", "without s", "with s", "ratio")
    print("{:<10} {:>5} {:>8} {:>10} {:>8} {:>7}".format(*header))
    for framework in args.frameworks.split(","):
        t = run_framework(framework, args.rounds, args.steps, args.config)
        without, with_ = statistics.median(t["without"]), statistics.median(t["with"])
        print(
            f"{framework:<10} {t['steps']:>5} {1000 * without / t['steps']:>8.1f} "
            f"{without:>10.2f} {with_:>8.2f} {with_ / without:>7.3f}"
        )
        print(f"  runs without: {[round(x, 2) for x in t['without']]}")
        print(f"  runs with:    {[round(x, 2) for x in t['with']]}")
        inside = statistics.median(t["inside_rankguard"])
        print(
            f"  time inside rankguard's event dispatch on rank 0: {1000 * inside:.1f} ms per "
            f"fit = {100 * inside / with_:.3f}% of the fit, {1e6 * inside / t['steps']:.0f} us/step"
        )
        per_step = statistics.median(t["inside_adapter"]) / t["steps"]
        print(f"  per-step CPU time inside the adapter on rank 0: {1e6 * per_step:.1f} us/step")
        hooks = statistics.median(t["inside_hooks"]) / t["steps"]
        print(f"  per-step CPU time in the straggler monitor's forward hooks: {1e6 * hooks:.1f} us")
    costs = hook_costs_us()
    print(f"per-step hook cost (4 events, all guards): {costs['events']:.1f} us")
    print(
        "per-step hook cost (4 events, all guards but straggler_monitor): "
        f"{costs['events_without_straggler']:.1f} us"
    )
    print(f"straggler_monitor forward hooks: {costs['forward_hooks']:.1f} us per hooked forward")


if __name__ == "__main__":
    main()
