"""One rank of benchmarks/straggler.py (launched by torchrun, 2 ranks on one node).

For each slowdown factor in turn, trains a DDP model (gloo, CPU) through a
hand-written loop that fires rankguard's events (``tests/e2e/straggler_loop.py``);
rank 1's forward takes ``factor`` times as long as rank 0's. Rank 0 writes, per
factor, the batch at which the straggler warning came (or ``None``) and every
verdict's lowest score to ``OUT`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import re

import torch
import torch.distributed as dist

from rankguard.callbacks import StragglerMonitor
from tests.e2e.straggler_loop import ddp, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--factors", default="1.1,1.25,1.5,2")
    parser.add_argument("--forward-s", type=float, default=0.02)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--settings", default="{}", help="StragglerMonitor settings as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks on two shared cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    settings = json.loads(args.settings)
    results = []
    for factor in (float(f) for f in args.factors.split(",")):
        model = ddp(args.forward_s * (factor if rank == 1 else 1.0))
        run = train([StragglerMonitor(**settings)], model, steps=args.steps)
        named = [b for b, m in run["records"] if m.startswith("rankguard straggler_monitor")]
        scores = [m["rankguard/straggler_score_min"] for m in run["metrics"]]
        reported = [
            float(s.group(1))
            for _, m in run["records"]
            if (s := re.search(r"\(score (\d\.\d+) <", m))
        ]
        results.append(
            {
                "factor": factor,
                "named_at": named[0] if named else None,
                "score_reported": reported[0] if reported else None,
                "scores": scores,
            }
        )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": args.steps, "settings": settings, "results": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
