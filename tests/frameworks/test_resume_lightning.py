"""ResumeGuard under Lightning: real 2-node resumes (CPU, gloo), one launch per world.

``tests/e2e/lightning_job.py`` runs every resume scenario in the same two processes, one
torchrun per simulated node of one rank (``Trainer(devices=1, num_nodes=2)``): a first fit
that saves every 4 steps and ``last.ckpt`` into a shared folder (rank 0 also copies that
folder right after its step-4 save: the node-local copy that then lagged), resumes from it,
and a fit over a stateful stream loader whose ``state_dict`` Lightning saves from rank 0
only. Each rank records each scenario's outcome, rankguard's warnings and the train
batches the fit ran. The launch has a hard timeout: a hang fails the suite, never blocks it.

Without rankguard (``E2E_RANKGUARD=off``, by hand): from the lagging copy rank 0 resumes at
step 8 and rank 1 at step 4, silently (DDP hands rank 0's weights to rank 1; the counters,
optimizer states and data stay each rank's own); rank 0 runs its 4 steps to ``max_steps=12``
and reports success, rank 1 runs 5 batches (its step-8 save's barrier pairs with rank 0's
step-12 one) and then waits in its next all-reduce for a rank 0 that is done: it fails
(gloo "Connection closed by peer") once rank 0's process exits, and hangs while it lives.
The stream resumes both ranks at rank 0's position: both finish, having trained on the
same batches, silently.
"""

from __future__ import annotations

import json
import re
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from benchmarks.launch import launch_nodes

pytestmark = [
    pytest.mark.framework,
    # find_spec, not importorskip: importing Lightning here would only cost seconds.
    pytest.mark.skipif(find_spec("lightning") is None, reason="needs rankguard[lightning]"),
]

JOB = Path(__file__).parents[1] / "e2e" / "lightning_job.py"
JOB_TIMEOUT_S = 150
SCENARIOS = [
    "resume_first_fit",
    "resume_lagging_copy",
    "resume_healthy",
    "resume_stream_first_fit",
    "resume_stream",
]
#: One launch per world: today's stack, and Composer's (older torch and Lightning).
WORLDS = [pytest.param("today"), pytest.param("older", marks=pytest.mark.older)]


@pytest.fixture(scope="module", params=WORLDS)
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs the job once; returns each rank's records, the output and the checkpoint folder."""
    out = tmp_path_factory.mktemp("resume_lightning")
    started = time.monotonic()
    nodes = launch_nodes(JOB, [str(out), *SCENARIOS], nodes=2, per_node=1, timeout=JOB_TIMEOUT_S)
    took = time.monotonic() - started
    output = "\n".join(f"{n.stdout[-4000:]}\n{n.stderr[-4000:]}" for n in nodes)
    records = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no records ({took:.0f} s):\n{output}"
        records[rank] = json.loads(path.read_text())
    return {
        "records": records,
        "returncodes": [n.returncode for n in nodes],
        "out": out,
        "output": output,
        "took_s": took,
    }


def _outcomes(job: dict, scenario: str) -> list[dict[str, Any]]:
    outcomes = [job["records"][rank].get(scenario) for rank in (0, 1)]
    assert all(outcomes), f"{scenario!r} did not run on every rank:\n{job['output']}"
    return outcomes


def test_every_scenario_ran_and_every_node_exited_cleanly(job):
    for rank in (0, 1):
        assert list(job["records"][rank]) == SCENARIOS
    assert job["returncodes"] == [0, 0], job["output"]


def test_first_fit_saves_every_4_steps_and_last_silently(job):
    for scenario in ("resume_first_fit", "resume_stream_first_fit"):
        for o in _outcomes(job, scenario):
            assert o["outcome"] == "ok", o
            assert o["warnings"] == []
            assert o["counters"]["train_batches"] == 8
    stream = sorted(p.name for p in (job["out"] / "resume" / "stream").iterdir())
    assert stream == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]


def test_each_checkpoint_keeps_the_positions_of_its_own_save(job):
    """The guard's state in a file is the one exchanged at that save (read after it)."""
    ranks = [o["counters"] for o in _outcomes(job, "resume_stream_first_fit")]
    # Each save writes 2 files (epoch=0-step=N.ckpt, then last.ckpt): at steps 4 and 8.
    at_save = [r["position_at_save"] for r in ranks]
    assert [len(p) for p in at_save] == [4, 4]
    for r in ranks:
        assert r["epoch=0-step=4.ckpt guard"] == [p[0] for p in at_save]
        assert r["last.ckpt guard"] == [p[3] for p in at_save]
    assert at_save[0][3] != at_save[1][3]  # each rank reads its own share of the stream
    # Lightning keeps rank 0's loader state alone: 9 batches of 4 fetched (one prefetched).
    assert ranks[0]["last.ckpt loader"] == [{"next_index": 72}]


def test_healthy_resume_mid_epoch_is_silent(job):
    for o in _outcomes(job, "resume_healthy"):
        assert o["outcome"] == "ok", o
        assert o["warnings"] == []
        assert o["counters"]["train_batches"] == 4  # steps 8 to 12
        assert o["counters"]["global_step"] == 12


def test_node_local_lagging_copy_stops_every_rank_before_the_first_step(job):
    outcomes = _outcomes(job, "resume_lagging_copy")
    assert [o["counters"]["copied"] for o in outcomes] == [
        ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"],
        ["epoch=0-step=4.ckpt", "last.ckpt"],
    ]
    for o in outcomes:
        assert o["outcome"] == "ResumeMismatchError", o
        assert o["message"].startswith("Ranks resumed from different copies of last.ckpt.")
        assert "train_batches" not in o["counters"]  # no batch of the resumed fit ran
    assert outcomes[0]["message"] == outcomes[1]["message"]


def test_node_local_lagging_copy_names_what_each_node_sees(job):
    message = _outcomes(job, "resume_lagging_copy")[0]["message"]
    # Every difference read between the copies, the steps first, then the sizes (where they
    # differ: the copies of the two worlds' Lightning differ in size, or not).
    loaded = next(line for line in message.splitlines() if line.startswith("Loaded ("))
    copy = r"last\.ckpt \(global_step {}(, \w+ \d+)*(; \d+ bytes)?\)"
    both = rf"Loaded \(.+\): rank 0: {copy.format(8)}; rank 1: {copy.format(4)}\."
    assert re.fullmatch(both, loaded), loaded
    assert ("bytes" in loaded) == (loaded.count("bytes") == 2), loaded
    assert "would update different weights from different steps" in message
    assert "epoch=0-step=8.ckpt that not every node has" in message
    assert "not epoch=0-step=8.ckpt" in message


def test_stream_position_saved_from_rank_0_stops_every_rank_before_the_first_step(job):
    outcomes = _outcomes(job, "resume_stream")
    for o in outcomes:
        assert o["outcome"] == "ResumeMismatchError", o
        message = o["message"]
        assert "train loader is at the same position on every rank" in message
        assert "different on every rank when the checkpoint was saved" in message
        assert "from rank 0 only" in message  # Lightning's fix
        assert "train_batches" not in o["counters"]
    # Lightning restored rank 0's position on both (then prefetched one batch of 4).
    assert [o["counters"]["next_index"] for o in outcomes] == [80, 80]
    assert outcomes[0]["message"] == outcomes[1]["message"]
