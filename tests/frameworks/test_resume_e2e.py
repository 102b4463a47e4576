"""Resumes checked in real 2-rank jobs of every trainer (CPU, gloo): one launch per framework
and world, each running every resume scenario in the same two processes.

Every framework's job plays the same four scenarios, in its own words:

- **first**: a fit that saves (every 4 steps) with rankguard's state in each checkpoint;
- **healthy**: that fit resumed: silent, and it trains the steps left;
- **lagging**: each rank plays a node resuming from its own copy of the save folder, node 1's
  copy without the newest checkpoint: stopped on every rank before the first resumed step;
- **position**: a data position the framework saves from rank 0 and restores on every rank
  (each rank had its own): stopped on every rank before the first resumed step.

The jobs: ``tests/e2e/composer_job.py`` (``composer -n 2``), ``hf_trainer_job.py`` and
``olmo_core_job.py`` (one ``torchrun``), ``lightning_job.py`` (one ``torchrun`` per simulated
node of one rank, ``Trainer(devices=1, num_nodes=2)``). Each job's ``older`` launch runs in
Composer's world (transformers 4.57, Lightning and OLMo-core 2.4 there). Every launch has a
hard timeout: a hang fails the suite, never blocks it.

Without rankguard (``E2E_RANKGUARD=off``, by hand) Lightning's lagging copy resumes rank 0 at
step 8 and rank 1 at step 4, silently (DDP hands rank 0's weights to rank 1; the counters,
optimizer states and data stay each rank's own); rank 0 runs its 4 steps to ``max_steps=12``
and reports success, rank 1 runs 5 batches (its step-8 save's barrier pairs with rank 0's
step-12 one) and then waits in its next all-reduce for a rank 0 that is done: it fails (gloo
"Connection closed by peer") once rank 0's process exits, and hangs while it lives. The
stream resumes both ranks at rank 0's position: both finish, having trained on the same
batches, silently.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from benchmarks.launch import launch_nodes
from tests.mp import run_job

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "tests" / "e2e"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT_S = 150


@dataclass(frozen=True)
class Trainer:
    """How one framework's job plays the four scenarios."""

    scenarios: dict[str, str]  # the concern (first, healthy, lagging, position): its scenario
    runs: tuple[str, ...]  # every scenario the job runs, in order (a save before its resumes)
    steps: str  # the counter of the steps (or batches) a fit ran
    lagging: tuple[str, str]  # the error a lagging copy ends in, and its message's start
    position_fix: str  # the fix the position's message names, in the framework's words


TRAINERS = {
    "composer": Trainer(
        {
            "first": "resume_first_fit",
            "healthy": "resume_healthy",
            "lagging": "resume_node_lagging",
            "position": "resume_data_position",
        },
        ("resume_first_fit", "resume_healthy", "resume_node_lagging", "resume_data_position"),
        "train_batches",
        # Composer compares the batch after the load itself, in Trainer.__init__, before
        # rankguard's RESUMED.
        ("RuntimeError", "Timestamp mismatch error: batch to resume from "),
        "state_dict(num_samples, from_beginning)",
    ),
    "hf": Trainer(
        {
            "first": "resume_first",
            "healthy": "resume_healthy",
            "lagging": "resume_lagging_copy",
            "position": "resume_data_position",
        },
        ("resume_first", "resume_lagging_copy", "resume_data_position", "resume_healthy"),
        "steps_run",
        ("ResumeMismatchError", "Ranks resumed from different checkpoints.\n"),
        "Fix: save each rank's own data position",
    ),
    "lightning": Trainer(
        {
            "first": "resume_first_fit",
            "healthy": "resume_healthy",
            "lagging": "resume_lagging_copy",
            "position": "resume_stream",
        },
        (
            "resume_first_fit",
            "resume_lagging_copy",
            "resume_healthy",
            "resume_stream_first_fit",
            "resume_stream",
        ),
        "train_batches",
        ("ResumeMismatchError", "Ranks resumed from different copies of last.ckpt.\n"),
        "from rank 0 only",
    ),
    "olmo_core": Trainer(
        {
            "first": "resume_first",
            "healthy": "resume_healthy",
            "lagging": "resume_lagging_copy",
            "position": "resume_rank0_state",
        },
        ("resume_first", "resume_healthy", "resume_lagging_copy", "resume_rank0_state"),
        "steps",
        # OLMo-core's rank 0 alone resolves the latest checkpoint and broadcasts it: rank 1
        # is told to read a step8 it lacks, named before any rank reads it.
        ("NodeLocalDirError", "Checkpoint to resume from rank 0: "),
        "train/rank{N}.pt",
    ),
}


@dataclass
class Job:
    """One launch's outcome: each rank's record of each scenario, and what it printed."""

    framework: str
    out: Path
    ranks: list[dict[str, dict[str, Any]]]
    returncodes: list[int]
    output: str

    def outcomes(self, concern: str) -> list[dict[str, Any]]:
        """Each rank's outcome of the scenario playing ``concern`` (or of a scenario by name)."""
        scenario = TRAINERS[self.framework].scenarios.get(concern, concern)
        outcomes = [rank.get(scenario) for rank in self.ranks]
        assert all(outcomes), f"{scenario!r} did not run on every rank:\n{self.output[-6000:]}"
        return outcomes  # type: ignore[return-value]

    def ran(self, outcome: dict[str, Any]) -> int:
        """The steps (or batches) the outcome's fit ran: 0 where it stopped before the first."""
        return outcome["counters"].get(TRAINERS[self.framework].steps, 0)


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _composer(out: Path, world: str) -> Job:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    runs = TRAINERS["composer"].runs
    proc = subprocess.run(
        [str(BIN / "composer"), "-n", "2", str(E2E / "composer_job.py"), str(out), *runs],
        env={**os.environ, "PYTHONPATH": path, "E2E_RERAISE": "0"},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        cwd=out,
    )
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    return Job("composer", out, _records(out), [proc.returncode], output)


def _torchrun(framework: str, script: str) -> Callable[[Path, str], Job]:
    def launch(out: Path, world: str) -> Job:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
        cmd += [str(E2E / script), str(out), *TRAINERS[framework].runs]
        result = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
        assert result.returncode == 0, result.output[-6000:]
        return Job(framework, out, _records(out), [result.returncode], result.output)

    return launch


def _lightning(out: Path, world: str) -> Job:
    nodes = launch_nodes(
        E2E / "lightning_job.py", [str(out), *TRAINERS["lightning"].runs], 2, 1, LAUNCH_TIMEOUT_S
    )
    output = "\n".join(f"{n.stdout[-4000:]}\n{n.stderr[-4000:]}" for n in nodes)
    for rank in (0, 1):
        assert (out / f"rank{rank}.json").exists(), f"rank {rank} wrote no records:\n{output}"
    return Job("lightning", out, _records(out), [n.returncode for n in nodes], output)


def _olmo_core(out: Path, world: str) -> Job:
    older = int(version("ai2-olmo-core").split(".")[0]) < 3
    if (world == "older") != older:
        pytest.skip(f"the {world} world's run (OLMo-core {version('ai2-olmo-core')} here)")
    return _torchrun("olmo_core", "olmo_core_job.py")(out, world)


#: What each framework needs installed (find_spec: importing it here would only cost seconds).
NEEDS = {
    "composer": "composer",
    "hf": "transformers",
    "lightning": "lightning",
    "olmo_core": "olmo_core",
}
LAUNCH = {
    "composer": _composer,
    "hf": _torchrun("hf", "hf_trainer_job.py"),
    "lightning": _lightning,
    "olmo_core": _olmo_core,
}


def _jobs(*frameworks: str) -> list[Any]:
    """The launches of ``frameworks``: one per world each runs in (Composer: its own alone)."""
    jobs = []
    for framework in frameworks:
        if framework == "composer":
            jobs.append(pytest.param("composer", marks=pytest.mark.composer))
            continue
        jobs.append(pytest.param(f"{framework}-today"))
        jobs.append(pytest.param(f"{framework}-older", marks=pytest.mark.older))
    return jobs


ALL = _jobs(*TRAINERS)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Job]:
    """Launches a job (``framework-world``) the first time a test asks for it."""
    done: dict[str, Job] = {}

    def get(name: str) -> Job:
        if name not in done:
            framework, _, world = name.partition("-")
            if find_spec(NEEDS[framework]) is None:
                pytest.skip(f"needs {NEEDS[framework]}")
            done[name] = LAUNCH[framework](tmp_path_factory.mktemp(name), world or "today")
        return done[name]

    return get


# -- what every framework's resume does -------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_the_first_fit_saves_and_is_silent(launched, name):
    job = launched(name)
    for outcome in job.outcomes("first"):
        assert outcome["outcome"] == "ok", outcome
        assert outcome["warnings"] == [], outcome


@pytest.mark.parametrize("name", ALL)
def test_a_healthy_resume_is_silent_and_trains_the_4_steps_left(launched, name):
    job = launched(name)
    for outcome in job.outcomes("healthy"):
        assert outcome["outcome"] == "ok", outcome
        assert outcome["warnings"] == [], outcome
        assert job.ran(outcome) == 4, outcome  # steps 9 to 12


@pytest.mark.parametrize("name", ALL)
def test_a_lagging_node_copy_stops_every_rank_before_the_first_resumed_step(launched, name):
    job = launched(name)
    error, start = TRAINERS[job.framework].lagging
    for outcome in job.outcomes("lagging"):
        assert outcome["outcome"] == error, outcome
        assert outcome["message"].startswith(start), outcome["message"]
        assert job.ran(outcome) == 0, outcome  # no step of the resumed fit ran


@pytest.mark.parametrize("name", ALL)
def test_rank_0s_data_position_on_every_rank_stops_every_rank_before_the_first_step(launched, name):
    job = launched(name)
    for outcome in job.outcomes("position"):
        assert outcome["outcome"] == "ResumeMismatchError", outcome
        message = outcome["message"]
        assert " is at the same position on every rank" in message, message
        assert TRAINERS[job.framework].position_fix in message, message
        assert job.ran(outcome) == 0, outcome


# -- Composer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _jobs("composer"))
def test_composer_checks_its_empty_autoresume_and_its_resume(launched, name):
    job = launched(name)
    first, healthy = job.outcomes("first"), job.outcomes("healthy")
    assert [o["counters"] for o in first] == [{"train_batches": 8, "resume_checked": True}] * 2
    assert [o["counters"] for o in healthy] == [{"train_batches": 4, "resume_checked": True}] * 2


@pytest.mark.parametrize("name", _jobs("composer"))
def test_composers_own_timestamp_check_names_each_ranks_batch(launched, name):
    # Node 0 loads ep0-ba8, node 1 ep0-ba4.
    job = launched(name)
    for outcome, batch in zip(job.outcomes("lagging"), (8, 4), strict=True):
        assert outcome["message"].startswith(
            f"Timestamp mismatch error: batch to resume from {batch} is not the same on all ranks."
        )
        assert outcome["counters"] == {}  # no train batch started


@pytest.mark.parametrize("name", _jobs("composer"))
def test_composers_rank_0_position_is_told_as_restored_on_every_rank(launched, name):
    for outcome in launched(name).outcomes("position"):
        message = outcome["message"]
        assert "train dataset_state is at the same position on every rank" in message
        assert "rank 0's saved position, restored on every rank" in message


# -- the Hugging Face Trainer: 12 planned steps, stopped after step 9 (the job's time ran out) --


@pytest.mark.parametrize("name", _jobs("hf"))
def test_hf_first_run_saved_4_and_8_with_guard_state(launched, name):
    for outcome in launched(name).outcomes("first"):
        saved = outcome["counters"]["saved"]
        assert sorted(saved) == ["checkpoint-4", "checkpoint-8"]
        assert all("rankguard_state.json" in files for files in saved.values())


@pytest.mark.parametrize("name", _jobs("hf"))
def test_hf_lagging_copy_names_each_ranks_checkpoint_and_what_each_node_sees(launched, name):
    job = launched(name)
    out, host = job.out, socket.gethostname()
    lagging = job.outcomes("lagging")
    assert [o["counters"]["copied"] for o in lagging] == [
        ["checkpoint-4", "checkpoint-8"],
        ["checkpoint-4"],
    ]
    for outcome in lagging:
        assert outcome["message"].startswith(
            "Ranks resumed from different checkpoints.\n"
            "Loaded (resume_from_checkpoint=True): rank 0: checkpoint-8 (global_step 8, epoch 1, "
            "batches skipped 2); rank 1: checkpoint-4 (global_step 4, epoch 0, batches skipped 4)."
            "\nWhat each node sees (node-local or lagging storage):\n"
            f"  node {host}/node0 (rank 0) sees in {out}/lag_node0/out: checkpoint-8 that not "
            "every node has\n"
            f"  node {host}/node1 (rank 1) sees in {out}/lag_node1/out: not checkpoint-8\n"
        ), outcome["message"]
        assert "Fix: resume every rank from the same checkpoint" in outcome["message"]


@pytest.mark.parametrize("name", _jobs("hf"))
def test_hf_position_kept_by_the_main_process_says_what_it_was_at_the_save(launched, name):
    # The user's callback keeps the stream's place in one file the main process writes and
    # every rank reads back (the accelerate#4164 shape).
    for outcome in launched(name).outcomes("position"):
        lines = outcome["message"].splitlines()
        assert lines[0] == "Ranks did not resume their data where each left off."
        assert lines[1].startswith(
            "train dataset is at the same position on every rank ({'shard': 'shard-0', 'row': "
        )
        assert "but it was different on every rank when the checkpoint was saved" in lines[1]
        assert lines[2].startswith("Fix: save each rank's own data position")


# -- Lightning: two simulated nodes, last.ckpt and a stateful stream ---------------------------


@pytest.mark.parametrize("name", _jobs("lightning"))
def test_lightning_ran_every_scenario_and_every_node_exited_cleanly(launched, name):
    job = launched(name)
    for rank in job.ranks:
        assert tuple(rank) == TRAINERS["lightning"].runs
    assert job.returncodes == [0, 0], job.output


@pytest.mark.parametrize("name", _jobs("lightning"))
def test_lightning_first_fits_save_every_4_steps_and_last(launched, name):
    job = launched(name)
    for scenario in ("resume_first_fit", "resume_stream_first_fit"):
        for outcome in job.outcomes(scenario):
            assert outcome["outcome"] == "ok", outcome
            assert outcome["warnings"] == []
            assert outcome["counters"]["train_batches"] == 8
    stream = sorted(p.name for p in (job.out / "resume" / "stream").iterdir())
    assert stream == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    for outcome in job.outcomes("healthy"):
        assert outcome["counters"]["global_step"] == 12


@pytest.mark.parametrize("name", _jobs("lightning"))
def test_lightning_each_checkpoint_keeps_the_positions_of_its_own_save(launched, name):
    """The guard's state in a file is the one exchanged at that save (read after it)."""
    ranks = [o["counters"] for o in launched(name).outcomes("resume_stream_first_fit")]
    # Each save writes 2 files (epoch=0-step=N.ckpt, then last.ckpt): at steps 4 and 8.
    at_save = [r["position_at_save"] for r in ranks]
    assert [len(p) for p in at_save] == [4, 4]
    for r in ranks:
        assert r["epoch=0-step=4.ckpt guard"] == [p[0] for p in at_save]
        assert r["last.ckpt guard"] == [p[3] for p in at_save]
    assert at_save[0][3] != at_save[1][3]  # each rank reads its own share of the stream
    # Lightning keeps rank 0's loader state alone: 9 batches of 4 fetched (one prefetched).
    assert ranks[0]["last.ckpt loader"] == [{"next_index": 72}]


@pytest.mark.parametrize("name", _jobs("lightning"))
def test_lightning_lagging_copy_names_each_ranks_copy_and_what_each_node_sees(launched, name):
    lagging = launched(name).outcomes("lagging")
    assert [o["counters"]["copied"] for o in lagging] == [
        ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"],
        ["epoch=0-step=4.ckpt", "last.ckpt"],
    ]
    assert lagging[0]["message"] == lagging[1]["message"]
    message = lagging[0]["message"]
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


@pytest.mark.parametrize("name", _jobs("lightning"))
def test_lightning_restored_rank_0s_stream_position_on_both_ranks(launched, name):
    position = launched(name).outcomes("position")
    assert "train loader is at the same position on every rank" in position[0]["message"]
    assert "different on every rank when the checkpoint was saved" in position[0]["message"]
    assert position[0]["message"] == position[1]["message"]
    # Lightning restored rank 0's position on both (then prefetched one batch of 4).
    assert [o["counters"]["next_index"] for o in position] == [80, 80]


# -- OLMo-core: save_folder and load_path; each rank's data cursor in train/rank{N}.pt ----------


@pytest.mark.parametrize("name", _jobs("olmo_core"))
def test_olmo_core_first_fit_saves_with_each_ranks_data_position(launched, name):
    job = launched(name)
    for outcome in job.outcomes("first"):
        assert outcome["counters"]["files"] == ["step0", "step4", "step8"]
    # Every rank's digests stay on rank 0, whose copy the resume check reads.
    first = job.outcomes("first")
    saved = first[0]["counters"]["guard_saved"]["saved"]
    assert len(set(saved["data/train loader"])) == 2  # each rank's own cursor
    assert first[1]["counters"]["guard_saved"] == {}


@pytest.mark.parametrize("name", _jobs("olmo_core"))
def test_olmo_core_resumes_from_its_save_folder_and_reads_the_guards_last_state(launched, name):
    job = launched(name)
    for first, healthy in zip(job.outcomes("first"), job.outcomes("healthy"), strict=True):
        counters = healthy["counters"]
        assert counters["resumed"]["checkpoint"].endswith("/ckpt/step8")
        assert counters["resumed"]["asked"].startswith("save_folder=")
        assert counters["verdict"] == [None, []]
        saved_at_exchange = first["counters"]["guard_saved"]
        if not saved_at_exchange:  # rank 1: rank 0 keeps every rank's digests; none written
            assert counters["file_state"] is None
            continue
        assert counters["file_state"] == saved_at_exchange  # written into step8/train/rank0.pt
        assert counters["loaded_state"] == saved_at_exchange["saved"]  # restored before RESUMED


@pytest.mark.parametrize("name", _jobs("olmo_core"))
def test_olmo_core_lagging_copy_is_named_before_any_rank_reads_it(launched, name):
    for outcome in launched(name).outcomes("lagging"):
        message = outcome["message"]
        assert "ckpt/step8 is not there on node" in message
        assert "node1 (rank 1)" in message and "node0 (rank 0) sees it" in message
        assert "loaded" not in outcome["counters"]  # no rank loaded it


@pytest.mark.parametrize("name", _jobs("olmo_core"))
def test_olmo_core_rank_0s_trainer_state_is_told_as_restored_on_every_rank(launched, name):
    # load_path= a copy of step8 that kept train/rank0.pt alone: OLMo-core's load falls back
    # to it on rank 1, whose data cursor is rank 0's.
    for outcome in launched(name).outcomes("position"):
        message = outcome["message"]
        assert "train loader is at the same position on every rank" in message
        assert "rank 0's saved position, restored on every rank" in message
