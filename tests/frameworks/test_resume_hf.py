"""The resume check under the Hugging Face Trainer: one ``torchrun`` launch of 2 CPU ranks per
world, each running, in order (``tests/e2e/hf_trainer_job.py``):

- ``resume_first``: 12 planned steps, stopped after step 9 (the job's time ran out), with
  checkpoints 4 and 8 in a folder both ranks share, each holding rankguard's state;
- ``resume_lagging_copy``: each rank plays a node that resumes (``resume_from_checkpoint=True``)
  from its own copy of that folder, node 1's copy without checkpoint-8: stopped on every rank
  before the first resumed step;
- ``resume_data_position``: each rank streams its own shard; the user's callback keeps the
  stream's place in one file the main process writes and every rank reads back (the
  accelerate#4164 shape): stopped on every rank before the first resumed step;
- ``resume_healthy``: the first run resumed in its own folder: silent, and it finishes.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tests.mp import run_job

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
SCENARIOS = ["resume_first", "resume_lagging_copy", "resume_data_position", "resume_healthy"]
LAUNCH_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    pytest.importorskip("transformers", reason="needs rankguard[transformers]")
    out = tmp_path_factory.mktemp("resume_hf")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "e2e" / "hf_trainer_job.py"), str(out), *SCENARIOS]
    job = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    assert job.returncode == 0, job.output[-6000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def check_first_run_saved_4_and_8_with_guard_state(ranks):
    for rank in ranks[1]:
        result = rank["resume_first"]
        assert result["outcome"] == "ok" and result["warnings"] == [], result
        saved = result["counters"]["saved"]
        assert sorted(saved) == ["checkpoint-4", "checkpoint-8"]
        assert all("rankguard_state.json" in files for files in saved.values())


def check_lagging_copy_stops_every_rank_before_the_first_resumed_step(ranks):
    out, results = ranks
    host = socket.gethostname()
    assert [r["resume_lagging_copy"]["counters"]["copied"] for r in results] == [
        ["checkpoint-4", "checkpoint-8"],
        ["checkpoint-4"],
    ]
    for rank in results:
        result = rank["resume_lagging_copy"]
        assert result["outcome"] == "ResumeMismatchError", result
        assert result["message"].startswith(
            "Ranks resumed from different checkpoints.\n"
            "Loaded (resume_from_checkpoint=True): rank 0: checkpoint-8 (global_step 8, epoch 1, "
            "batches skipped 2); rank 1: checkpoint-4 (global_step 4, epoch 0, batches skipped 4)."
            "\nWhat each node sees (node-local or lagging storage):\n"
            f"  node {host}/node0 (rank 0) sees in {out}/lag_node0/out: checkpoint-8 that not "
            "every node has\n"
            f"  node {host}/node1 (rank 1) sees in {out}/lag_node1/out: not checkpoint-8\n"
        ), result["message"]
        assert "Fix: resume every rank from the same checkpoint" in result["message"]
        assert "steps_run" not in result["counters"]  # no step of the resumed train ran


def check_one_data_position_for_all_ranks_stops_every_rank_before_the_first_step(ranks):
    for rank in ranks[1]:
        result = rank["resume_data_position"]
        assert result["outcome"] == "ResumeMismatchError", result
        lines = result["message"].splitlines()
        assert lines[0] == "Ranks did not resume their data where each left off."
        assert lines[1].startswith(
            "train dataset is at the same position on every rank ({'shard': 'shard-0', 'row': "
        )
        assert "but it was different on every rank when the checkpoint was saved" in lines[1]
        assert lines[2].startswith("Fix: save each rank's own data position")
        assert "steps_run" not in result["counters"]  # no step of the resumed train ran


def check_healthy_resume_is_silent_and_finishes(ranks):
    for rank in ranks[1]:
        result = rank["resume_healthy"]
        assert result["outcome"] == "ok" and result["warnings"] == [], result
        assert result["counters"]["steps_run"] == 4  # steps 9 to 12


CHECKS = [
    check_first_run_saved_4_and_8_with_guard_state,
    check_lagging_copy_stops_every_rank_before_the_first_resumed_step,
    check_one_data_position_for_all_ranks_stops_every_rank_before_the_first_step,
    check_healthy_resume_is_silent_and_finishes,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[len("check_") :])
def test_resume_today(ranks, check):
    """transformers 5 (today's world)."""
    check(ranks)


@pytest.mark.older
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[len("check_") :])
def test_resume_older(ranks, check):
    """transformers 4.57 (Composer's world)."""
    check(ranks)
