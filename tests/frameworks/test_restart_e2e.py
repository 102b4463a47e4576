"""A hung job restarts itself under the stock launcher: ``torchrun --max-restarts=1``.

One launch of ``tests/e2e/composer_job.py OUT restart`` (real Composer, 2 CPU
ranks): on the first attempt rank 1 hangs after an eval; the watchdog ends
every rank with exit code 75; torchrun restarts the workers; the second
attempt resumes from the last checkpoint with the watchdog calibrated from
it, and finishes. The launch has a hard timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rankguard.callbacks.hang.hang_watchdog import HANG_EXIT_CODE
from tests.mp import run_job

pytestmark = [pytest.mark.framework, pytest.mark.composer]

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
JOB = ROOT / "tests" / "e2e" / "composer_job.py"
LAUNCH_TIMEOUT_S = 240


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    out = tmp_path_factory.mktemp("restart")
    left: dict[str, list[int]] = {}

    def pids_left() -> None:  # torchrun has exited; its workers ran in their own sessions
        pids = [json.loads(p.read_text())["pid"] for p in out.glob("attempt*_rank*.json")]
        left["pids"] = [pid for pid in pids if _alive(pid)]
        for pid in left["pids"]:
            os.kill(pid, signal.SIGKILL)

    # torch >= 2.5 shares torchrun's rendezvous store with the workers; a restarted gloo
    # group then reads the previous attempt's addresses (pytorch/pytorch#135712).
    env = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
    cmd = [*env, str(TORCHRUN), "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    job = run_job(
        [*cmd, str(JOB), str(out), "restart"],
        timeout_s=LAUNCH_TIMEOUT_S,
        cwd=out,
        after_exit=pids_left,
    )
    return out, job, left["pids"]


def _attempt(out: Path, attempt: int) -> list[dict]:
    return [json.loads((out / f"attempt{attempt}_rank{r}.json").read_text()) for r in (0, 1)]


def test_hung_first_attempt_aborts_every_rank_and_torchrun_restarts_it(restarted):
    out, job, _ = restarted
    assert job.returncode == 0, job.output[-6000:]  # the second attempt finished
    assert f"failed (exitcode: {HANG_EXIT_CODE})" in job.output  # torchrun saw the abort
    assert job.output.count(f"Now aborting with exit code {HANG_EXIT_CODE}.") == 2
    for first in _attempt(out, 0):
        assert first["start_batch"] == 0 and "end_batch" not in first  # it never finished


def test_second_attempt_resumes_from_the_checkpoint_calibrated_and_finishes(restarted):
    out, job, _ = restarted
    for second in _attempt(out, 1):
        assert second["start_batch"] in (6, 8)  # the last checkpoint before the hang
        assert second["end_batch"] == 12
        assert second["restored"]  # the watchdog's calibration came from the checkpoint
        deadlines = second["deadlines"]  # at fit start, before any step of this attempt
        assert deadlines["train"] < 600 and deadlines["post_eval"] < 600, deadlines
    # Each rank of attempt 1 says so at fit start.
    assert job.output.count("deadlines calibrated from the checkpoint: train ") == 2


def test_first_attempts_report_is_kept_in_its_own_folder(restarted):
    out, _, _ = restarted
    reports = out / "reports"
    assert sorted(p.name for p in reports.iterdir()) == ["attempt0"]  # attempt 1 was healthy
    summary = (reports / "attempt0" / "summary.txt").read_text()
    assert summary.startswith("rank 1 stuck "), summary
    assert "in after eval of 'eval' (deadline " in summary
    assert "Stage 2: the incident ends" in summary
    assert "stall_after_eval" in (reports / "attempt0" / "rank1.txt").read_text()
    # `rankguard report` reads one attempt's folder like any report folder.
    cli = [str(TORCHRUN.parent / "rankguard"), "report", str(reports / "attempt0")]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("rank 1 stuck ") and "in stall_after_eval" in proc.stdout


def test_nothing_stays_alive_after_the_abort(restarted):
    _, _, left = restarted
    assert left == []
