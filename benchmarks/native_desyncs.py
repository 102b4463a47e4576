"""Desyncs of DDP, FSDP2 and a background save: what a user sees, with rankguard and without.

Runs each scenario of ``tests/e2e/native_collectives_job.py`` (2 ranks, torchrun, gloo on
CPU) twice: with ``RankGuard()`` (a report folder only, every other setting at its
default), and without rankguard (``E2E_RANKGUARD=off``) under a process-group timeout of
``--pg-timeout`` seconds (gloo's default is 30 min; a shorter one shows in minutes what a
user meets at its end). Per run it prints, from the split (rank 1's moment): the seconds
to the first report and to the job's end, each rank's exit code, and what was said first
(rankguard's summary line; without it, each rank's first error line and the user's line
its traceback ends in).

Usage: ``PYTHONPATH=src:. python benchmarks/native_desyncs.py [--pg-timeout 60]
[--scenarios ddp_buffers,fsdp2_forward,async_save]`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from launch import finish, job_env, start  # noqa: E402

SCENARIOS = ("ddp_buffers", "fsdp2_forward", "async_save")
JOB = ROOT / "tests" / "e2e" / "native_collectives_job.py"
_USER_LINE = re.compile(r'File ".*native_collectives_job\.py", line (\d+), in (\w+)')


def run(scenario: str, with_rankguard: bool, pg_timeout_s: float, cap_s: float) -> dict:
    """One launch; what it said and when, from the split."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = job_env(
            PYTHONPATH=os.pathsep.join((str(ROOT / "src"), str(ROOT))),
            PYTHONUNBUFFERED="1",
            E2E_PG_TIMEOUT_S=str(pg_timeout_s),
            E2E_RERAISE="1",  # a rank's error ends its process, as in a user's script
            **({} if with_rankguard else {"E2E_RANKGUARD": "off"}),
        )
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(JOB), str(out), scenario]
        [ended] = finish([start(cmd, env=env, cwd=out)], cap_s)
        split_file = out / "split.json"
        split = json.loads(split_file.read_text())["t"] if split_file.exists() else None
        summary = out / f"reports_{scenario}" / "summary.txt"
        found = {
            "codes": sorted(set(re.findall(r"exitcode\s*:\s*(-?\d+)", ended.stdout))),
            "ended_s": None if split is None else ended.ended_at - split,
            "timed_out": ended.timed_out,
        }
        if summary.exists() and split is not None:
            found["report_s"] = summary.stat().st_mtime - split
            found["said"] = summary.read_text().splitlines()[0]
        else:
            found["said"] = _errors(out, scenario)
        return found


def _errors(out: Path, scenario: str) -> str:
    """Each rank's error (``rank{N}.json``), and the user's line its traceback ends in."""
    said = []
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        result = json.loads(path.read_text()).get(scenario, {}) if path.exists() else {}
        if result.get("outcome") in (None, "ok"):
            said.append(f"rank {rank}: no error")
            continue
        users = _USER_LINE.findall(result.get("traceback", ""))
        where = f" (its last line of the job: line {users[-1][0]}, {users[-1][1]})" if users else ""
        message = result.get("message", "").splitlines()[0][:200]
        said.append(f"rank {rank}: {result['outcome']}: {message}{where}")
    return "; ".join(said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    import torch

    print(
        f"torch {torch.__version__}, gloo, 2 ranks; without rankguard the process group "
        f"times out after {args.pg_timeout:g} s"
    )
    for scenario in args.scenarios.split(","):
        for with_rankguard in (True, False):
            found = run(scenario, with_rankguard, args.pg_timeout, cap_s=args.pg_timeout + 180)
            label = "with   " if with_rankguard else "without"
            ended = "?" if found["ended_s"] is None else f"{found['ended_s']:.1f}"
            report = f"reported {found['report_s']:.1f} s, " if "report_s" in found else ""
            cut = " (capped)" if found["timed_out"] else ""
            print(
                f"{scenario:<14} {label}: {report}ended {ended} s{cut}, exit codes "
                f"{','.join(found['codes']) or '-'}"
            )
            print(f"    {found['said']}")


if __name__ == "__main__":
    main()
