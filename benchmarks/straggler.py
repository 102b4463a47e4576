"""How fast StragglerMonitor names a rank, by how much slower it computes.

Two ranks (one torchrun, gloo, CPU) train a DDP model through a hand-written
loop that fires rankguard's events; rank 1's forward pass takes 1.1x, 1.25x,
1.5x and 2x as long as rank 0's (a sleep in its forward: the host waiting for
a slower device). For each factor it prints the batch at which every rank
logged the straggler warning (or that none came), the score the warning
reported, the expected score (1 / factor) and the lowest score of each
verdict. Default settings but ``interval=50`` unless ``--settings`` says
otherwise (left to rankguard, an interval of these 25 ms batches would stretch
to 5 s, 200 batches): with ``interval=50``, ``warmup_steps=20`` and
``window=3`` a rank that stays below the threshold is named at batch 175 (the
third slow verdict, collected half an interval after the third interval's
exchange at batch 150).

Usage: ``python benchmarks/straggler.py [--steps 200] [--settings '{"threshold": 0.8}']``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from launch import launch_nodes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", default="1.1,1.25,1.5,2")
    parser.add_argument("--forward-s", default="0.02", help="rank 0's forward time (seconds)")
    parser.add_argument("--steps", default="200")
    parser.add_argument(
        "--settings", default='{"interval": 50}', help="StragglerMonitor settings as JSON"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "straggler.json"
        worker_args = [str(out), "--factors", args.factors, "--forward-s", args.forward_s]
        worker_args += ["--steps", args.steps, "--settings", args.settings]
        results = launch_nodes(HERE / "straggler_worker.py", worker_args, 1, 2, timeout=1800)
        if not out.exists():
            raise SystemExit(f"the run failed:\n{results[0].stderr[-3000:]}")
        report = json.loads(out.read_text())
    settings = report["settings"] or "defaults"
    print(f"StragglerMonitor ({settings}), {report['steps']} batches, 2 ranks, gloo on CPU")
    header = ("slowdown", "expected", "named at batch", "score reported")
    print("{:>8} | {:>8} | {:>14} | {:>14} | scores per verdict".format(*header))
    for r in report["results"]:
        named = "not named" if r["named_at"] is None else str(r["named_at"])
        reported = "-" if r["score_reported"] is None else f"{r['score_reported']:.2f}"
        scores = ", ".join(f"{s:.2f}" for s in r["scores"])
        print(
            f"{r['factor']:>7g}x | {1 / r['factor']:>8.2f} | {named:>14} | {reported:>14} | "
            f"{scores}"
        )


if __name__ == "__main__":
    main()
