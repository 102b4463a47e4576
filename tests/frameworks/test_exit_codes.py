"""What each launcher shows when rankguard stops a job: every rank's error, the exit code.

Composer's launcher and Lightning's ``ddp`` are covered by the examples' fault
runs in ``tests/docs/test_examples.py``; this is a hand-written loop under torchrun.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.mp import ROOT, run_job

TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.mark.framework
def test_torchrun_job_stopped_by_rankguard_exits_1_after_every_rank_logged_its_error(tmp_path):
    job = ROOT / "tests" / "e2e" / "torchrun_error_job.py"
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(job)]
    done = run_job(command, timeout_s=180, cwd=tmp_path)
    assert done.returncode == 1, done.output[-4000:]
    for rank in (0, 1):
        logged = f"[rank {rank}] ERROR rankguard.callbacks.guard: rankguard drop_last_guard: "
        assert logged + "Loader settings differ between ranks: loader 'train'" in done.output
    # torchrun's table names the first rank that exited (the other, if it had not exited
    # yet, is stopped with SIGTERM and not listed): whichever it was, its code is 1.
    assert re.search(r"rank      : [01] \(local_rank: [01]\)\n  exitcode  : 1 ", done.output)
