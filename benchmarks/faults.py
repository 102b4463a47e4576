"""A rank that raises or dies: from the fault to every rank's report and to the job's end.

First table: rank 1 of a 2-rank gloo loop (``tests/e2e/nodes_fault_job.py``) raises at
its sixth batch and its teardown then waits (as NCCL's does), or is SIGKILLed while rank
0 waits at its next host sync (as under NCCL). One node (one torchrun, which stops the
other ranks once one exits) and two (one torchrun per node: neither sees the other's
ranks). With rankguard (``RankGuard`` with short deadlines, ``teardown_timeout_s=3``)
and without it, side by side; the job is killed at ``--cap`` seconds.

Second table, per integration installed in this environment: each real job's
``data_check_raises`` scenario (``tests/e2e/*_job.py``; rank 1's data check raises at
step 6, its ``finally`` waits), ``RankGuard`` with only a report folder and
``teardown_timeout_s=3``, and the same job without rankguard (``E2E_RANKGUARD=off``).
Usage::

    python benchmarks/faults.py [--cap 60] [--cases raise,kill] [--integrations-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from importlib.util import find_spec  # noqa: E402

from benchmarks.launch import finish, job_env, start, start_nodes  # noqa: E402
from rankguard.callbacks.hang.faults import is_alive  # noqa: E402

JOB = ROOT / "tests" / "e2e" / "nodes_fault_job.py"
#: A rank's log line that names the fault (its Unix time first, as the job logs).
_NAMED = re.compile(
    r"^(\d+\.\d+) \[rank (\d+)\] ERROR rankguard\.callbacks\.hang_watchdog: rankguard "
    r"hang_watchdog: (Rank 1 raised|Rank 1 is gone|Hang: rank 1)"
)
_CODES = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)")
CASES = {"raise": "rank 1 raises, teardown waits", "kill": "rank 1 SIGKILLed"}


def run(case: str, nodes: int, rankguard: bool, cap_s: float) -> dict:
    """One job; the times are from rank 1's fault."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"RANKGUARD": "on" if rankguard else "off"}
        procs = start_nodes(JOB, [tmp, case], nodes, 2 // nodes, env=env, merge_output=True)
        ended = finish(procs, cap_s)
        failed_file = Path(tmp) / "rank1.json"
        if not failed_file.exists():
            return {"error": "rank 1 never reached its fault"}
        failed = json.loads(failed_file.read_text())["failed"]
        reports = Path(tmp) / "reports"
        post_mortem = ""
        if case == "kill" and rankguard and reports.is_dir():  # what is left to read after
            cli = [sys.executable, "-m", "rankguard.cli", "report", str(reports)]
            post_mortem = subprocess.run(cli, capture_output=True, text=True).stdout
    output = "".join(e.stdout for e in ended)
    named: dict[int, float] = {}
    for match in filter(None, map(_NAMED.match, output.splitlines())):
        named.setdefault(int(match.group(2)), float(match.group(1)))
    codes = dict(_CODES.findall(output))
    timed_out = any(e.timed_out for e in ended)
    return {
        "named": {rank: at - failed for rank, at in named.items()},
        "ends": max(e.ended_at for e in ended) - failed,
        "codes": ",".join(codes.get(str(r), "?") for r in range(2)),
        "timed_out": timed_out,
        "post_mortem": post_mortem,
    }


BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
#: Each framework's job, its launcher, and the module it needs (the loop: the first table).
INTEGRATIONS = {
    "HF Trainer (torchrun)": ("hf_trainer_job.py", TORCHRUN, "transformers"),
    "Lightning (ddp)": ("lightning_job.py", [sys.executable], "lightning"),
    "Composer (composer -n 2)": ("composer_job.py", [str(BIN / "composer"), "-n", "2"], "composer"),
    "OLMo-core (torchrun)": ("olmo_core_job.py", TORCHRUN, "olmo_core"),
}


def run_integration(script: str, launcher: list[str], rankguard: bool, cap_s: float) -> dict:
    """One job's ``data_check_raises``; times from rank 1's raise."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = job_env(
            PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            E2E_RANKGUARD="on" if rankguard else "off",
        )
        cmd = [*launcher, str(ROOT / "tests" / "e2e" / script), tmp, "data_check_raises"]
        [ended] = finish([start(cmd, env=env, cwd=tmp)], cap_s, lambda: _gone(out, cap_s))
        raised_file = out / "raised.json"
        if not raised_file.exists():
            return {"error": "rank 1 never raised"}
        raised = json.loads(raised_file.read_text())["t"]
        summary = out / "reports_data_check_raises" / "summary.txt"
        rank1 = out / "pid1"
        gone = (
            float(rank1.with_suffix(".gone").read_text())
            if rank1.with_suffix(".gone").exists()
            else None
        )
        return {
            "named": {0: summary.stat().st_mtime - raised} if summary.exists() else {},
            "ends": max(ended.ended_at, gone or 0.0) - raised,
            "codes": _integration_codes(ended.stdout, ended.returncode),
            "timed_out": ended.timed_out,
        }


def _gone(out: Path, cap_s: float) -> None:
    """After the launcher ended: when rank 1's process was seen gone (Lightning's outlives it)."""
    pid_file = out / "pid1"
    if not pid_file.exists():
        return
    pid, deadline = int(pid_file.read_text()), time.monotonic() + cap_s
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid_file.with_suffix(".gone").write_text(str(time.time()))


def _integration_codes(output: str, returncode: int) -> str:
    """Rank 0's exit code as the launcher tells it, and the launcher's."""
    found = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: 0 ", output) or re.search(
        r"Global rank 0 \(PID \d+\) exited with code (-?\d+)", output
    )
    rank0 = found.group(1) if found else str(returncode)
    return f"rank 0: {rank0}"


def _cell(result: dict, cap_s: float) -> str:
    if "error" in result:
        return result["error"]
    named = result["named"].get(0)
    said = f"rank 0 told {named:.1f} s" if named is not None else "nothing said"
    if result["timed_out"]:
        return f"{said}; hangs (killed at {cap_s:.0f} s)"
    return f"{said}; ends {result['ends']:.1f} s ({result['codes']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="seconds before a job is killed")
    parser.add_argument("--cases", default=",".join(CASES), help="which of: raise, kill")
    parser.add_argument("--integrations-only", action="store_true", help="the second table only")
    args = parser.parse_args()
    if not args.integrations_only:
        loop_table(args)
    print(
        "\nPer integration: rank 1's data check raises at step 6 and its teardown waits; "
        "RankGuard with a report folder and teardown_timeout_s=3. Times from the raise; "
        "'told': rank 0's summary.txt written; 'ends': the launcher and rank 1 ended."
    )
    header = f"{'integration':<26} | {'with rankguard':<44} | {'without':<40}"
    print(header)
    print("-" * len(header))
    for label, (script, launcher, module) in INTEGRATIONS.items():
        if find_spec(module) is None:
            continue
        with_ = run_integration(script, launcher, True, args.cap)
        without = run_integration(script, launcher, False, args.cap)
        print(
            f"{label:<26} | {_cell(with_, args.cap):<44} | {_cell(without, args.cap):<40}",
            flush=True,
        )


def loop_table(args: argparse.Namespace) -> None:
    """The first table: the loop on one node and on two, raise and SIGKILL."""
    print(
        "2 ranks, gloo on CPU; times from rank 1's fault. Goal with rankguard: "
        "report <= 2 s, job ended <= 5 s (one node; on two, rank 1's node at its bound)."
    )
    header = f"{'case':<32} | {'nodes':>5} | {'with rankguard':<40} | {'without':<40}"
    print(header)
    print("-" * len(header))
    for case in args.cases.split(","):
        for nodes in (1, 2):
            with_ = run(case, nodes, True, args.cap)
            without = run(case, nodes, False, args.cap)
            print(
                f"{CASES[case]:<32} | {nodes:>5} | {_cell(with_, args.cap):<40} | "
                f"{_cell(without, args.cap):<40}",
                flush=True,
            )
            if with_.get("post_mortem"):
                head = "\n".join(with_["post_mortem"].splitlines()[:8])
                print(f"  rankguard report on its folder afterwards:\n{head}\n  ...")


if __name__ == "__main__":
    main()
