"""False-alarm soak: healthy 2-rank runs with realistic jitter, under ``RankGuard()`` defaults.

Runs ``benchmarks/soak_job.py`` (see its docstring for the jitter: slow first
step, GC pauses, a 10x slower first eval, checkpoint saves, eval every 40
steps, one rank 2x slower for 60 steps, loaders re-created each epoch, 3 s
eval-end callbacks) ``--runs`` times per framework, one run at a time, and
prints runs, total steps, hang reports (stage 1), aborts (exit 75), other
rankguard warnings, and the closest call: the healthy interval that came
nearest its deadline, as a share of it. Target: 0 reports and 0 aborts.

``--watchdog '{"floor_s": 2}'`` runs the same soak with other watchdog
settings, e.g. a lower floor, to see how close the calibration alone comes.

Usage: ``python benchmarks/soak.py [--runs 3] [--frameworks composer,lightning]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
JOB = HERE / "soak_job.py"
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
RUN_TIMEOUT_S = 900


def run(framework: str, out: Path, seed: int, watchdog: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [str(JOB), framework, str(out), str(seed), watchdog]
    if framework == "composer":
        cmd = [str(BIN / "composer"), "-n", "2", *args]
    else:
        cmd = [sys.executable, *args]
    started = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=out, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    ranks = []
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return {
        "code": proc.returncode,
        "wall_s": time.monotonic() - started,
        "ranks": ranks,
        "output": proc.stdout + proc.stderr,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per framework")
    parser.add_argument("--frameworks", default="composer,lightning")
    parser.add_argument("--watchdog", default="{}", help="HangWatchdog settings as JSON")
    args = parser.parse_args()
    json.loads(args.watchdog)  # fail early on a typo
    rows = []
    for framework in args.frameworks.split(","):
        totals = {"runs": 0, "steps": 0, "reports": 0, "aborts": 0, "other": 0}
        closest: tuple | None = None
        for seed in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                result = run(framework, Path(tmp), seed, args.watchdog)
            ranks = [r for r in result["ranks"] if r is not None]
            lines = [line for r in ranks for line in r["rankguard"]]
            reports = sum(r["incidents"] for r in ranks)
            aborted = result["code"] == 75 or "Now aborting with exit code 75" in result["output"]
            totals["runs"] += 1
            totals["steps"] += max((r["steps"] for r in ranks), default=0)
            totals["reports"] += reports
            totals["aborts"] += int(aborted)
            totals["other"] += len([x for x in lines if "hang_watchdog: Hang" not in x])
            for r in ranks:
                call = r["closest_call"]
                if call is not None and (closest is None or call[0] > closest[0]):
                    closest = tuple(call)
            print(
                f"{framework} run {seed}: exit {result['code']}, {result['wall_s']:.0f} s, "
                f"steps {[r['steps'] for r in ranks]}, reports {reports}, "
                f"rankguard lines {len(lines)}"
                + ("" if len(ranks) == 2 else " (a rank wrote no result)")
            )
            for line in lines:
                print(f"    {line.splitlines()[0]}")
            if result["code"] not in (0, 75):
                print(result["output"][-3000:])
        rows.append((framework, totals, closest))
    settings = f"watchdog settings {args.watchdog}" if args.watchdog != "{}" else "defaults"
    print(f"\nSoak, 2 ranks on CPU, RankGuard() {settings}:")
    header = (
        f"{'framework':<10} | {'runs':>4} | {'steps':>6} | {'reports':>7} | {'aborts':>6} | "
        f"{'other warnings':>14} | closest call (share of deadline: phase, interval, deadline)"
    )
    print(header)
    print("-" * len(header))
    for framework, t, closest in rows:
        near = "-"
        if closest is not None:
            share, kind, seconds, deadline = closest
            near = f"{100 * share:.0f}%: {kind}, {seconds:.2f} s of {deadline:g} s"
        print(
            f"{framework:<10} | {t['runs']:>4} | {t['steps']:>6} | {t['reports']:>7} | "
            f"{t['aborts']:>6} | {t['other']:>14} | {near}"
        )


if __name__ == "__main__":
    main()
