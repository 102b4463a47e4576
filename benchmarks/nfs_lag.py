"""OLMo-core saves whose ``step<N>`` rank 1's NFS client hides for 15 s: five runs, one healthy.

Each run is ``tests/e2e/olmo_core_job.py negative_cache_folder`` on 2 CPU ranks under
torchrun: rank 1's negative lookup cache (``tests/e2e/nfs_view.py``: ``stat`` says
``ENOENT``, ``mkdir`` says ``EEXIST``, the listing leaves it out) hides each renamed
``step<N>`` for ``NEG_CACHE_LAG_S`` after rank 0 made it; 2 steps, saved at steps 0 and 2;
``SharedDirBarrier``'s default ``warn_late_s`` (5 s). Then the same job healthy (nothing
hidden). Prints, per run and rank: the outcome, the saves, rankguard's warnings and what
the cache hid; then one line: saves completed, runs with exactly one warning per rank,
and the healthy run's warnings.

Run: ``.venv/bin/python benchmarks/nfs_lag.py [RUNS] [LAG_S]`` (about 45 s a run at 15 s);
with today's stack (OLMo-core 3.0): ``/work/envs/today/bin/python benchmarks/nfs_lag.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.launch import ROOT, finish, job_env, start

JOB = ROOT / "tests" / "e2e" / "olmo_core_job.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def run(out: Path, scenario: str, lag_s: float) -> tuple[float, list[dict], str]:
    """One launch of the job; returns its wall time, both ranks' records and its output's tail."""
    env = job_env(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]),
        PYTHONUNBUFFERED="1",
        NEG_CACHE_LAG_S=str(lag_s),
        NEG_CACHE_WARN_S="5.0",  # SharedDirBarrier's default warn_late_s
    )
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(JOB), str(out), scenario]
    started = time.monotonic()
    [ended] = finish([start(cmd, env=env, cwd=out)], timeout_s=300)
    wall = time.monotonic() - started
    ranks = []
    for r in (0, 1):
        path = out / f"rank{r}.json"
        ranks.append(json.loads(path.read_text())[scenario] if path.exists() else {})
    return wall, ranks, ended.stdout[-3000:]


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    lag_s = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
    import olmo_core.version

    print(f"OLMo-core {olmo_core.version.VERSION}; rank 1 hides each step<N> for {lag_s:g} s")
    saved = warned_once = 0
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            wall, ranks, tail = run(Path(tmp), "negative_cache_folder", lag_s)
        complete = all(r.get("outcome") == "ok" and r["counters"]["saves"] == 2 for r in ranks)
        once = all(len(r.get("warnings", [])) == 1 for r in ranks)
        saved += complete
        warned_once += once
        print(f"run {i + 1}: {wall:.1f} s, both ranks' 2 saves complete: {complete}")
        for r, record in enumerate(ranks):
            if not record:
                print(f"  rank {r}: no record\n{tail}")
                continue
            counters = record["counters"]
            print(
                f"  rank {r}: {record['outcome']}, saves {counters.get('saves')}, "
                f"hidden {counters.get('hidden')}, {len(record['warnings'])} warning(s)"
            )
            for warning in record["warnings"]:
                print(f"    {warning[:160]}...")
    with tempfile.TemporaryDirectory() as tmp:
        wall, ranks, tail = run(Path(tmp), "negative_cache_folder", 0.0)
    healthy = [len(r.get("warnings", ["no record"])) for r in ranks]
    outcomes = [r.get("outcome") for r in ranks]
    print(f"healthy: {wall:.1f} s, outcomes {outcomes}, warnings per rank {healthy}")
    print(
        f"{saved} of {runs} runs saved both checkpoints on both ranks; {warned_once} of {runs} "
        f"warned exactly once per rank; healthy run: {sum(healthy)} warnings"
    )


if __name__ == "__main__":
    main()
