"""A rank on another node that goes silent, per phase: seconds to the report and to the end.

Two torchruns (one rank each: neither launcher sees the other node's rank), the loop
job ``tests/e2e/nodes_fault_job.py`` with ``RankGuard()`` and only a report folder
(zero configuration: ``exchange_period_s`` 10 s). Rank 1 is stopped (SIGSTOP: a frozen
process, a lost node's open sockets) or SIGKILLed (the OOM killer; rank 0 then waits at
its next host sync, as under NCCL), per phase: inside its first ``optimizer.step()``
(start-up for the others, whose deadline is 30 min), at its sixth step (mid-training),
in an eval and in a checkpoint save (stopped 13 s into each, after step 4). Times from
rank 1's fault to rank 0's WARNING naming it and to its ERROR before the exit, and the
phase rank 0 last saw it in; the goals: named within 30 s, ended (75) within 90 s. Usage::

    python benchmarks/silent_rank.py [--cap 150] [--cases freeze_first_step,...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from benchmarks.launch import kill_tree, start_nodes  # noqa: E402

JOB = ROOT / "tests" / "e2e" / "nodes_fault_job.py"
#: Each case: the phase rank 1 is in, what happens to it there.
CASES = {
    "freeze_first_step": ("start-up (first step)", "SIGSTOP in its first optimizer.step"),
    "kill_first_step": ("start-up (first step)", "SIGKILL in its first optimizer.step"),
    "freeze": ("mid-training", "SIGSTOP at step 6"),
    "kill": ("mid-training", "SIGKILL at step 6"),
    "freeze_eval": ("eval", "SIGSTOP 13 s into an eval"),
    "freeze_save": ("save", "SIGSTOP 13 s into a checkpoint save"),
}
_LINE = re.compile(r"^(\d+\.\d+) \[rank 0\] (WARNING|ERROR) .*rank 1 frozen or dead")
_SEEN = re.compile(r"last seen: (.*)\)\.$")
_CODE = re.compile(r"rank\s*:\s*0 \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)")


def run(case: str, cap_s: float) -> str:
    """One job; rank 0's node is waited for, then rank 1's (a stopped rank never ends)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = start_nodes(JOB, [tmp, case], 2, 1, env={"RANKGUARD": "defaults"})
        try:
            _, err = procs[0].communicate(timeout=cap_s)
        except Exception:
            err = ""
        finally:
            for proc in procs:
                kill_tree(proc)
        marked = Path(tmp) / "rank1.json"
        if not marked.exists():
            return "rank 1 never reached its fault | - | - | -"
        failed = json.loads(marked.read_text())["failed"]
        times, seen = {}, "-"
        for line in err.splitlines():
            found = _LINE.match(line)
            if found:
                times.setdefault(found.group(2), float(found.group(1)) - failed)
                last = _SEEN.search(line)
                seen = last.group(1) if last else seen
        code = _CODE.search(err)
        named = f"{times['WARNING']:.1f} s" if "WARNING" in times else "not named"
        ended = f"{times['ERROR']:.1f} s" if "ERROR" in times else f"not ended ({cap_s:g} s)"
        return f"{named} | {ended} | {code.group(1) if code else '?'} | {seen}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=150.0, help="seconds before a job is killed")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(
        "Rank 1 on another node goes silent; RankGuard() defaults. "
        "Goal: named <= 30 s, ended <= 90 s."
    )
    print(
        "\n| phase | rank 1 | named | ended | rank 0 exit | last seen |\n|---|---|---|---|---|---|"
    )
    for case in args.cases.split(","):
        phase, what = CASES[case]
        print(f"| {phase} | {what} | {run(case, args.cap)} |", flush=True)


if __name__ == "__main__":
    main()
