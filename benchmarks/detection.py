"""Time from a hang to its report, with and without rankguard's HangWatchdog.

Each scenario is a plain 2-rank ``torch.distributed`` job (gloo on CPU,
``env://`` rendezvous hosted by rank 0, as under Composer's launcher and
Lightning) training a DDP model, with an eval every few steps that ends in a
metric ``all_reduce``. rankguard's core ``HangWatchdog`` runs behind a
``GuardRunner`` fed the same events the Composer and Lightning adapters send
(``tests/test_hang_e2e.py`` covers the real trainers). Rank 1 hangs:

- ``post-eval stall``: blocks in a hook right after eval (rank 0 goes on and
  waits in DDP's gradient all-reduce);
- ``mid-eval stall``: blocks inside eval batch 2 (rank 0 waits in the metric
  all-reduce);
- ``unmatched collective``: after eval, calls an ``all_reduce`` on a second
  group that rank 0 never calls;
- ``frozen rank``: its whole process stops (SIGSTOP) after train step 25,
  watchdog thread included.

Rank 1 writes the moment it starts to hang. With rankguard the report time
is ``summary.txt``'s mtime and the job ends when the ranks exit with code 75
(``action="abort"``); without it, the job is watched for ``--cap`` seconds for
any rank to exit or to print an error (gloo's default process-group timeout
is 30 minutes). Runs without rankguard run side by side (they only wait).
Exit code -9: killed by the benchmark (the frozen rank, or whatever is left
at the end).

Usage: ``python benchmarks/detection.py [--cap 60]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCENARIOS = {
    "post_eval_stall": "post-eval stall",
    "mid_eval_stall": "mid-eval stall",
    "unmatched_collective": "unmatched collective",
    "frozen_rank": "frozen rank",
}
WATCHDOG = {
    "timeout_s": 10.0,
    "eval_timeout_s": 10.0,
    "post_eval_timeout_s": 5.0,
    "exchange_period_s": 1.0,
}
DEADLINE_S = {  # the deadline of the phase rank 1 hangs in
    "post_eval_stall": WATCHDOG["post_eval_timeout_s"],
    "mid_eval_stall": WATCHDOG["eval_timeout_s"],
    "unmatched_collective": WATCHDOG["post_eval_timeout_s"],
    "frozen_rank": WATCHDOG["timeout_s"],
}
# The freeze comes after status exchanges have seen train steps: a rank frozen before any
# exchange saw it past its first step is held to `first_step_timeout_s` (30 min).
STEPS, EVAL_EVERY, FREEZE_AFTER, STEP_S = 40, 10, 25, 0.05
STARTUP_TIMEOUT_S = 180
EXIT_GRACE_S = 10.0  # a frozen rank never exits: it is killed (-9) this long after the others


# -- worker (one rank) -------------------------------------------------------------------


def worker(scenario: str, out: Path, guarded: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rankguard.callbacks.events import Event, EventFacts, LoaderFacts
    from rankguard.callbacks.guard import GuardRunner
    from rankguard.callbacks.hang_watchdog import HangWatchdog

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = str(out / "reports")
    runner = GuardRunner([HangWatchdog(report_dir=reports, **WATCHDOG)]) if guarded else None
    eval_loader = LoaderFacts("eval", None, is_train=False)

    def fire(event: Event, **facts) -> None:
        if runner is not None:
            runner.fire(event, EventFacts(**facts))

    def mark_hang() -> None:
        (out / "hang.json").write_text(json.dumps({"t": time.time()}))

    def stall() -> None:
        mark_hang()
        time.sleep(3600)

    def evaluate(step: int) -> None:
        fire(Event.EVAL_START, step=step, loader=eval_loader)
        total = torch.zeros(1)
        for index in range(4):
            fire(Event.EVAL_BATCH_START, step=step, loader=eval_loader, batch_index=index)
            if scenario == "mid_eval_stall" and rank == 1 and index == 2:
                stall()
            with torch.no_grad():
                total += model.module(torch.randn(8, 4)).sum()
            time.sleep(STEP_S)
            fire(Event.EVAL_BATCH_END, step=step, loader=eval_loader, batch_index=index)
        dist.all_reduce(total)  # the metric sync
        fire(Event.EVAL_END, step=step, loader=eval_loader)
        if rank == 1 and scenario == "post_eval_stall":
            stall()
        if rank == 1 and scenario == "unmatched_collective":
            mark_hang()
            dist.all_reduce(torch.ones(1), group=side_group)

    fire(Event.FIT_START)
    for step in range(STEPS):
        fire(Event.DATA_FETCH_START, step=step)
        batch = torch.randn(8, 4)
        fire(Event.DATA_FETCH_END, step=step)
        fire(Event.TRAIN_BATCH_START, step=step)
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(STEP_S)
        fire(Event.TRAIN_BATCH_END, step=step + 1)
        if scenario == "frozen_rank" and rank == 1 and step + 1 == FREEZE_AFTER:
            mark_hang()
            os.kill(os.getpid(), signal.SIGSTOP)
        if (step + 1) % EVAL_EVERY == 0:
            evaluate(step + 1)
    fire(Event.FIT_END, step=STEPS)
    if runner is not None:
        runner.close()


# -- driver ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(scenario: str, out: Path, guarded: bool) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, __file__, "--worker", scenario, str(out), str(int(guarded))]
        log = open(out / f"rank{rank}.log", "w")  # closed when the process ends
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def watch(procs: list[subprocess.Popen], out: Path, cap_s: float) -> dict:
    """Waits for the hang, then until every rank exits, ``cap_s`` passes, or the ranks left
    have not followed the first one out within EXIT_GRACE_S; kills what is left."""
    started = time.monotonic()
    hang_t = None
    exits: dict[int, float] = {}
    while True:
        now = time.time()
        if hang_t is None and (out / "hang.json").exists():
            try:
                hang_t = json.loads((out / "hang.json").read_text())["t"]
            except ValueError:
                pass  # being written
        for rank, proc in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = now
        if len(exits) == len(procs):
            break
        if exits and now - min(exits.values()) > EXIT_GRACE_S:
            break
        if hang_t is None and time.monotonic() - started > STARTUP_TIMEOUT_S:
            break
        if hang_t is not None and now - hang_t > cap_s:
            break
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL also ends a stopped process
        proc.wait()
    summary = out / "reports" / "summary.txt"
    return {
        "hang_t": hang_t,
        "exits": {r: t - hang_t for r, t in exits.items()} if hang_t else {},
        "codes": [p.returncode for p in procs],
        "report_s": summary.stat().st_mtime - hang_t if summary.exists() and hang_t else None,
        "summary": summary.read_text().splitlines()[0] if summary.exists() else "",
        "errors": [
            line
            for r in range(len(procs))
            for line in (out / f"rank{r}.log").read_text().splitlines()
            if "Error" in line or "error" in line
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="seconds to wait without rankguard")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {(s, g): Path(tmp) / f"{s}-{g}" for s in SCENARIOS for g in (True, False)}
        for path in dirs.values():
            path.mkdir()
        # Without rankguard the ranks only wait: these run side by side, in the background.
        plain: dict[str, dict] = {}
        watchers = []
        for scenario in SCENARIOS:
            procs, out = (
                start(scenario, dirs[scenario, False], guarded=False),
                dirs[scenario, False],
            )

            def watch_plain(scenario=scenario, procs=procs, out=out) -> None:
                plain[scenario] = watch(procs, out, cap_s=args.cap)

            watchers.append(threading.Thread(target=watch_plain))
            watchers[-1].start()
        guarded = {}
        for scenario in SCENARIOS:  # one at a time: the timing is what is measured
            procs = start(scenario, dirs[scenario, True], guarded=True)
            guarded[scenario] = watch(procs, dirs[scenario, True], cap_s=args.cap)
        for thread in watchers:
            thread.join()
    print(
        "2 ranks, gloo on CPU; watchdog deadlines: train "
        f"{WATCHDOG['timeout_s']:g} s, eval {WATCHDOG['eval_timeout_s']:g} s, after eval "
        f"{WATCHDOG['post_eval_timeout_s']:g} s; status exchange every "
        f"{WATCHDOG['exchange_period_s']:g} s. Times from the start of the hang."
    )
    header = (
        f"{'scenario':<21} | {'deadline':>8} | {'report':>7} | {'job ends (exit codes)':<22} | "
        f"{'without rankguard':<24} | rankguard's verdict"
    )
    print(header)
    print("-" * len(header))
    for scenario, label in SCENARIOS.items():
        g, p = guarded[scenario], plain[scenario]
        report = f"{g['report_s']:.1f} s" if g["report_s"] is not None else "none"
        ends = f"{max(g['exits'].values()):.1f} s" if g["exits"] else "never"
        ends += f" ({','.join(str(c) for c in g['codes'])})"
        if p["exits"] or p["errors"]:
            first = min(p["exits"].values()) if p["exits"] else None
            without = f"exit after {first:.1f} s" if first is not None else "error logged"
        elif p["hang_t"] is None:
            without = "did not reach the hang"
        else:
            without = f"no report within {args.cap:g} s"
        print(
            f"{label:<21} | {DEADLINE_S[scenario]:>6g} s | {report:>7} | {ends:<22} | "
            f"{without:<24} | {g['summary']}"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "1")
    else:
        main()
