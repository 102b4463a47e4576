"""The resume check in a real 2-rank Composer job (``composer -n 2``, gloo on CPU).

One launch runs every scenario in the same two processes (tests/e2e/composer_job.py,
``RESUME``): a first fit that saves every 4 batches, a healthy ``autoresume``, node-local
copies of the save folder where node 1's lags (Composer itself stops that one: its
timestamp check after the load), and a per-rank dataset whose position Composer saves
from rank 0 and loads on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.framework, pytest.mark.composer]

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "e2e" / "composer_job.py"
LAUNCHER = Path(sys.executable).parent / "composer"
SCENARIOS = ["resume_first_fit", "resume_healthy", "resume_node_lagging", "resume_data_position"]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [str(LAUNCHER), "-n", "2", str(JOB), str(out), *SCENARIOS],
        env={**os.environ, "PYTHONPATH": path, "E2E_RERAISE": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {name: [per_rank[name] for per_rank in results] for name in SCENARIOS}


def test_first_fit_saves_and_its_empty_autoresume_is_checked_silently(outcomes):
    for result in outcomes["resume_first_fit"]:
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"] == {"train_batches": 8, "resume_checked": True}


def test_healthy_autoresume_is_checked_silently_and_trains_to_the_end(outcomes):
    for result in outcomes["resume_healthy"]:
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"] == {"train_batches": 4, "resume_checked": True}  # ba8 -> ba12


def test_lagging_node_local_copy_is_stopped_by_composers_timestamp_check(outcomes):
    # Node 0 loads ep0-ba8, node 1 ep0-ba4: Composer compares the batch after the load,
    # in Trainer.__init__, before rankguard's RESUMED.
    for result, batch in zip(outcomes["resume_node_lagging"], (8, 4), strict=True):
        assert result["outcome"] == "RuntimeError", result.get("traceback")
        assert result["message"].startswith(
            f"Timestamp mismatch error: batch to resume from {batch} is not the same on all ranks."
        )
        assert result["counters"] == {}  # no train batch started


def test_rank0_data_position_on_every_rank_raises_before_the_first_batch(outcomes):
    for result in outcomes["resume_data_position"]:
        assert result["outcome"] == "ResumeMismatchError", result.get("traceback")
        message = result["message"]
        assert "train dataset_state is at the same position on every rank" in message
        assert "rank 0's saved position, restored on every rank" in message
        assert "state_dict(num_samples, from_beginning)" in message  # Composer's fix
        assert "train_batches" not in result["counters"]  # no batch of the resumed fit
