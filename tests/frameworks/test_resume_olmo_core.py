"""The resume check on OLMo-core's ``Trainer``: one torchrun launch (2 CPU ranks) per world.

The launch runs, in one pair of processes (``tests/e2e/olmo_core_job.py``):

a. ``resume_first``: a fit of 8 steps saving ``step0``, ``step4``, ``step8`` (its loader also
   keeps each rank's own cursor, saved per rank in ``train/rank{N}.pt``);
b. ``resume_healthy``: the same config fit again for 12 steps: OLMo-core loads ``step8``
   from the save folder, and nothing is said;
c. ``resume_lagging_copy``: each rank plays a node resuming from ``ckpt`` on its own disk (the
   same path on every node); node 1's copy lost ``step8``. OLMo-core's rank 0 alone resolves
   the latest and broadcasts it, so rank 1 is told to read a ``step8`` it lacks: named before
   any rank reads it (CHECKPOINT_LOAD_START on the broadcast path);
d. ``resume_rank0_state``: ``load_path=`` a copy of ``step8`` that kept ``train/rank0.pt``
   alone: OLMo-core's load falls back to it on rank 1, whose data cursor is rank 0's.

The today-world run is marked ``framework``; the Composer world's (OLMo-core 2.4) ``older``.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.mp import run_job

pytest.importorskip("olmo_core", reason="needs rankguard[olmo-core]")

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
SCENARIOS = ["resume_first", "resume_healthy", "resume_lagging_copy", "resume_rank0_state"]
LAUNCH_TIMEOUT_S = 150
OLDER = int(version("ai2-olmo-core").split(".")[0]) < 3


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("today", marks=pytest.mark.framework),
        pytest.param("older", marks=[pytest.mark.framework, pytest.mark.older]),
    ],
)
def ranks(request, tmp_path_factory):
    """Each rank's outcome per scenario, from the one launch of this world."""
    if (request.param == "older") != OLDER:
        pytest.skip(f"the {request.param} world's run (OLMo-core {version('ai2-olmo-core')} here)")
    out = tmp_path_factory.mktemp("resume_olmo_core")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "e2e" / "olmo_core_job.py"), str(out), *SCENARIOS]
    start = time.monotonic()
    result = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    print(f"launch took {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, result.output[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_first_fit_saves_with_each_ranks_data_position(ranks):
    for rank in ranks:
        first = rank["resume_first"]
        assert first["outcome"] == "ok", first.get("message")
        assert first["counters"]["files"] == ["step0", "step4", "step8"]
    # Every rank's digests stay on rank 0, whose copy the resume check reads.
    saved = ranks[0]["resume_first"]["counters"]["guard_saved"]["saved"]
    assert len(set(saved["data/train loader"])) == 2  # each rank's own cursor
    assert ranks[1]["resume_first"]["counters"]["guard_saved"] == {}


def test_healthy_resume_is_silent_and_trains_on(ranks):
    for rank in ranks:
        healthy = rank["resume_healthy"]
        assert healthy["outcome"] == "ok", healthy.get("message")
        assert healthy["warnings"] == []
        counters = healthy["counters"]
        assert counters["resumed"]["checkpoint"].endswith("/ckpt/step8")
        assert counters["resumed"]["asked"].startswith("save_folder=")
        assert counters["steps"] == 4  # steps 9 to 12
        assert counters["verdict"] == [None, []]


def test_the_guards_state_at_the_last_save_is_what_the_resume_reads(ranks):
    for rank in ranks:
        saved_at_exchange = rank["resume_first"]["counters"]["guard_saved"]
        healthy = rank["resume_healthy"]["counters"]
        if not saved_at_exchange:  # rank 1: rank 0 keeps every rank's digests; none written
            assert healthy["file_state"] is None
            continue
        assert healthy["file_state"] == saved_at_exchange  # written into step8/train/rank0.pt
        assert healthy["loaded_state"] == saved_at_exchange["saved"]  # restored before RESUMED


def test_lagging_node_copy_is_named_before_any_rank_reads_it(ranks):
    for rank in ranks:
        lagging = rank["resume_lagging_copy"]
        assert lagging["outcome"] == "NodeLocalDirError", lagging.get("message")
        message = lagging["message"]
        assert "ckpt/step8 is not there on node" in message
        assert "node1 (rank 1)" in message and "node0 (rank 0) sees it" in message
        assert lagging["counters"]["steps"] == 0
        assert "loaded" not in lagging["counters"]  # no rank loaded it


def test_rank0_trainer_state_on_every_rank_is_named_before_the_first_step(ranks):
    for rank in ranks:
        clobbered = rank["resume_rank0_state"]
        assert clobbered["outcome"] == "ResumeMismatchError", clobbered.get("message")
        message = clobbered["message"]
        assert "train loader is at the same position on every rank" in message
        assert "rank 0's saved position, restored on every rank" in message
        assert "train/rank{N}.pt" in message  # OLMo-core's words
        assert clobbered["counters"]["steps"] == 0
