"""Real Composer and Lightning jobs saving checkpoints: SharedDirBarrier and CheckpointPlanner.

Each framework's job (``tests/e2e/*_job.py``) runs all its scenarios in
one launch: two simulated nodes of one rank each, one torchrun per node, on CPU
(gloo), so the planner's per-node budget is that of a real two-node job.

Hand count of the state the planner estimates at fit start (fp32; Adam's state
predicted before its first step: two copies of every parameter plus a 4-byte
``step`` per parameter tensor):

* Lightning ``Linear(4, 512), Linear(512, 1)``: 3073 parameters, 12292 B;
  state 12292 + 2 x 12292 + 4 x 4 = 36892 B (36.0 KiB); largest tensor
  2048 x 4 = 8192 B. Lightning writes through a buffer (+1 copy). DDP full
  save on rank 0: 36892 + 8192 = 45084 B (44.0 KiB); FSDP2 full save (gathered
  on rank 0): 2 x 36892 = 73784 B (72.1 KiB); sharded save per node:
  2 x 18446 = 36892 B (36.0 KiB). Budget 40 KiB per node.
* Composer ``Linear(4, 512), Linear(512, 2)``: 3586 parameters, 14344 B;
  state 14344 + 2 x 14344 + 16 = 43048 B (42.0 KiB). Composer writes to a file
  (+0). FSDP2 full save: 43048 B (42.0 KiB); sharded per node: 21524 B
  (21.0 KiB); budget 32 KiB. DDP full save: the largest tensor, 8192 B
  (8.0 KiB); budget 4 KiB, so a sharded save (21.0 KiB) would not fit either.
"""

from __future__ import annotations

import inspect
import json
from importlib.util import find_spec
from pathlib import Path
from socket import gethostname
from typing import Any

import pytest

from benchmarks.launch import can_mount, launch_nodes, node_disk
from rankguard.callbacks.checkpoint.dir_probe import MARKER_PREFIX
from tests.frameworks.launches import composer_both

pytestmark = pytest.mark.framework

E2E = Path(__file__).parents[1] / "e2e"
SCENARIOS = [
    "checkpointing",
    "planner_warn",
    "planner_raise",
    "planner_auto_ddp",
    "planner_auto_fsdp",
]
#: Need node 1's own disk mounted where node 0 has its own (``benchmarks/launch.py::node_disk``).
NODE_LOCAL_SCENARIOS = ["node_local_warn", "node_local_raise", "resume_node_local"]
NODE_LOCAL = can_mount()
HOST = gethostname()
needs_node_disks = pytest.mark.skipif(
    not NODE_LOCAL, reason="simulating node-local disks needs a private mount namespace"
)
FRAMEWORKS = {
    "lightning": {
        "job": E2E / "lightning_job.py",
        "more_scenarios": ["weights_only"],
        "saved_node_local": ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"],
        "upload_fix": "`ModelCheckpoint(dirpath='s3://bucket/run/checkpoints')`",
        "resume_from": "epoch=0-step=8.ckpt",
        "every_2": [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)],
        "every_4": ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"],
        "over_budget": "needs 44.0 KiB of host memory on node",
        "budget": "40.0 KiB is available (host_memory_bytes)",
        "setting": "`FSDPStrategy(state_dict_type='sharded')`",
        "needed": {"checkpointing": 45084, "planner_warn": 45084, "planner_raise": 45084},
        "fsdp_full": "needs 72.1 KiB",
        "sharded": "a sharded save needs at most 36.0 KiB per node",
        "switched": "Done: set ModelParallelStrategy._save_distributed_checkpoint to True",
        "resume": "`ModelParallelStrategy(save_distributed_checkpoint=True)`",
    },
    "composer": {
        "job": E2E / "composer_job.py",
        "more_scenarios": [],
        "saved_node_local": ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt", "latest-rank0.pt"],
        "upload_fix": "`save_folder='s3://bucket/run/checkpoints'`",
        "resume_from": "ep0-ba8-rank0.pt",
        "every_2": [f"ep0-ba{b}-rank0.pt" for b in (2, 4, 6, 8)],
        "every_4": ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"],
        "over_budget": "needs 42.0 KiB of host memory on node",
        "budget": "32.0 KiB is available (host_memory_bytes)",
        "setting": "`parallelism_config={'fsdp': {'state_dict_type': 'sharded'}}`",
        "needed": {"checkpointing": 8192, "planner_warn": 43048, "planner_raise": 43048},
        "fsdp_full": "needs 42.0 KiB",
        "sharded": "a sharded save needs at most 21.0 KiB per node",
        "switched": "Done: set Composer's FSDP2Config.state_dict_type to 'sharded'",
        "resume": "`parallelism_config={'fsdp': {'state_dict_type': 'sharded'}}`",
    },
}


@pytest.fixture(scope="module", params=list(FRAMEWORKS))
def job(request, tmp_path_factory) -> dict[str, Any]:
    """Runs one framework's job once (2 nodes x 1 rank); returns both ranks' records.

    Both nodes share ``OUT_DIR``, except ``OUT_DIR/local``: node 1 sees its own
    disk there (``OUT_DIR/node1_disk``), as each node of a cluster sees its own
    ``/local``.
    """
    framework = request.param
    if find_spec(framework) is None:
        pytest.skip(f"needs rankguard[{framework}]")
    spec = FRAMEWORKS[framework]
    out = tmp_path_factory.mktemp(framework)
    scenarios = SCENARIOS + spec["more_scenarios"]
    prefix = {}
    if NODE_LOCAL:
        (out / "local").mkdir()
        (out / "node1_disk").mkdir()
        prefix = {1: node_disk(str(out / "node1_disk"), str(out / "local"))}
        scenarios += NODE_LOCAL_SCENARIOS
    # Below pytest's 300 s: a job that hangs is killed and its nodes' output shown.
    results = launch_nodes(
        spec["job"], [str(out), *scenarios], nodes=2, per_node=1, timeout=240, prefix=prefix
    )
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n{result.stderr[-4000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {**spec, "framework": framework, "out": out, "ranks": ranks}


def _both(job: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [rank[scenario] for rank in job["ranks"]]


def _saved(job: dict[str, Any], scenario: str) -> list[str]:
    folder = job["out"] / "ckpt" / scenario
    return sorted(p.name for p in folder.iterdir() if not p.is_symlink()) if folder.exists() else []


def test_checkpointing_run_goes_through_the_dir_barrier_at_fit_start_and_every_save(job):
    for rank, result in enumerate(_both(job, "checkpointing")):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []  # every guard on; the planner in raise mode
        counters = result["counters"]
        assert counters.get("train_steps", counters.get("train_batches")) == 8
        # one barrier at fit start, one before each of the 4 saves
        assert counters["rankguard/shared_dir_wait_s count"] == 5
        assert counters["rankguard/checkpoint_needed_bytes count"] == 1
        if rank == 0:
            assert 0 < counters["rankguard/checkpoint_needed_bytes"]
            assert (
                counters["rankguard/checkpoint_needed_bytes"]
                < (counters["rankguard/checkpoint_available_bytes"])
            )
    assert _saved(job, "checkpointing") == sorted(job["every_2"])
    markers = [p for p in job["out"].rglob(f"{MARKER_PREFIX}*")]
    assert markers == []


def test_full_save_over_budget_warns_with_the_table_and_training_completes(job):
    for result in _both(job, "planner_warn"):
        assert result["outcome"] == "ok", result.get("traceback")
        [warning] = result["warnings"]
        assert warning.startswith("rankguard checkpoint_planner: Checkpoint save will not fit")
        assert job["over_budget"] in warning and job["budget"] in warning
        assert job["setting"] in warning
        assert "\nnode " in warning and "full save" in warning and "sharded save" in warning
        assert "/node0  0 " in warning and "/node1  1 " in warning  # a row per node
        counters = result["counters"]
        assert counters.get("train_steps", counters.get("train_batches")) == 8
    assert _saved(job, "planner_warn") == sorted(job["every_4"])


def test_full_save_over_budget_raises_before_the_first_save(job):
    messages = []
    for result in _both(job, "planner_raise"):
        assert result["outcome"] == "CheckpointMemoryError"
        messages.append(result["message"])
        assert job["over_budget"] in result["message"] and job["budget"] in result["message"]
        assert "Fix: save sharded checkpoints" in result["message"]
        assert job["setting"] in result["message"]
        assert "train_steps" not in result["counters"]  # at fit start, before any batch
        assert "train_batches" not in result["counters"]
    assert messages[0] == messages[1]
    assert _saved(job, "planner_raise") == []


def test_auto_switches_an_fsdp_job_to_sharded_saves_and_says_so(job):
    for result in _both(job, "planner_auto_fsdp"):
        assert result["outcome"] == "ok", result.get("traceback")
        [warning] = result["warnings"]
        assert "Switching to sharded checkpoints" in warning
        assert job["fsdp_full"] in warning and job["sharded"] in warning
        assert job["switched"] in warning and job["resume"] in warning
        assert result["counters"]["rankguard/shared_dir_wait_s count"] == 3
    folder = job["out"] / "ckpt" / "planner_auto_fsdp"
    saves = _saved(job, "planner_auto_fsdp")
    assert len(saves) == 2  # both saves, every one sharded: a directory of per-rank shards
    for save in saves:
        files = sorted(p.name for p in (folder / save).iterdir())
        assert "__0_0.distcp" in files and "__1_0.distcp" in files


def test_auto_on_plain_ddp_raises(job):
    for result in _both(job, "planner_auto_ddp"):
        assert result["outcome"] == "CheckpointMemoryError"
        message = result["message"]
        assert "train_steps" not in result["counters"]
        assert "train_batches" not in result["counters"]
        if job["framework"] == "lightning":
            # a sharded save would fit, but DDP cannot save one: the setting is named
            assert "A sharded save would fit (at most 36.0 KiB per node)" in message
            assert "cannot switch this job to it: the model is not sharded" in message
            assert job["setting"] in message
        else:
            # a full save to a file copies one tensor at a time: sharding would not help
            assert "needs 8.0 KiB" in message and "4.0 KiB is available" in message
            assert "even a sharded save does not fit" in message
    assert _saved(job, "planner_auto_ddp") == []


def test_planner_estimate_matches_the_hand_count(job):
    for name, expected in job["needed"].items():
        rank0, rank1 = (rank[name]["counters"] for rank in job["ranks"])
        assert rank0["rankguard/checkpoint_needed_bytes"] == expected
        assert rank1["rankguard/checkpoint_needed_bytes"] == 0  # node 1 holds no full copy


@pytest.mark.skipif(find_spec("lightning") is None, reason="needs rankguard[lightning]")
def test_lightning_strategies_still_read_the_attributes_the_switch_sets():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from rankguard.integrations.lightning.facts import checkpoint_format

    fsdp = FSDPStrategy(state_dict_type="full")
    assert checkpoint_format(fsdp)[0] == "full"
    assert checkpoint_format(fsdp)[1]() == "set FSDPStrategy._state_dict_type to 'sharded'"
    assert checkpoint_format(fsdp)[0] == "sharded"
    assert "self._state_dict_type" in inspect.getsource(FSDPStrategy.save_checkpoint)

    parallel = ModelParallelStrategy(save_distributed_checkpoint=False)
    assert checkpoint_format(parallel)[0] == "full"
    checkpoint_format(parallel)[1]()
    assert checkpoint_format(parallel)[0] == "sharded"
    assert "self._save_distributed_checkpoint" in inspect.getsource(
        ModelParallelStrategy.save_checkpoint
    )

    assert checkpoint_format(DDPStrategy())[:2] == ("full", None)


@pytest.mark.parametrize("job", ["lightning"], indirect=True)
def test_weights_only_saves_go_through_the_dir_barrier_before_every_save(job):
    # on_save_checkpoint never fires for save_weights_only=True: the barrier wraps the save.
    for result in _both(job, "weights_only"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        # one barrier at fit start, one before each of the 4 saves
        assert result["counters"]["rankguard/shared_dir_wait_s count"] == 5
    assert _saved(job, "weights_only") == sorted(f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8))


def _node_disks(job: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The checkpoint files on node 0's disk and on node 1's."""
    return [
        sorted(p.name for p in (job["out"] / disk / "ckpt").iterdir())
        for disk in ("local", "node1_disk")
    ]


@needs_node_disks
def test_node_local_save_folder_is_reported_on_every_rank_and_training_goes_on(job):
    folder = job["out"] / "local" / "ckpt"
    for result in _both(job, "node_local_warn"):
        assert result["outcome"] == "ok", result.get("traceback")
        [warning] = result["warnings"]
        assert warning.startswith(
            f"rankguard shared_dir_barrier: Checkpoint folder {folder} is node-local: "
        )
        assert f"node {HOST}/node1 (rank 1) does not see what rank 0 ({HOST}/node0) writes" in (
            warning
        )
        assert "Fix: save to a folder on a filesystem every node mounts" in warning
        assert job["upload_fix"] in warning
        counters = result["counters"]
        assert counters.get("train_steps", counters.get("train_batches")) == 8
    # As warned: the checkpoints are on node 0's disk only.
    assert _node_disks(job) == [job["saved_node_local"], []]


@needs_node_disks
def test_node_local_save_folder_raises_at_fit_start_when_asked(job):
    messages = []
    for result in _both(job, "node_local_raise"):
        assert result["outcome"] == "NodeLocalDirError", result.get("traceback")
        assert "is node-local: node " in result["message"]
        assert "train_steps" not in result["counters"]
        assert "train_batches" not in result["counters"]
        messages.append(result["message"])
    assert messages[0] == messages[1]


@needs_node_disks
def test_resume_from_a_checkpoint_one_node_cannot_see_fails_before_loading(job):
    path = job["out"] / "local" / "ckpt" / job["resume_from"]
    for result in _both(job, "resume_node_local"):
        # Without rankguard: FileNotFoundError on node 1 only, node 0 loads and goes on.
        assert result["outcome"] == "NodeLocalDirError", result.get("traceback")
        message = result["message"]
        assert message.startswith(
            f"Checkpoint to resume from {path} is not there on node {HOST}/node1 (rank 1); "
            f"node {HOST}/node0 (rank 0) sees it."
        )
        assert "copy it to the same path on every node" in message
        assert "on_checkpoint_load_start" in result["traceback"]  # before the framework read it
        assert "train_steps" not in result["counters"]
        assert "train_batches" not in result["counters"]


# -- The many-scenario launches (tests/frameworks/launches.py) -----------------------------


def test_composer_checkpointing_run_goes_through_the_dir_barrier_silently(composer_scenarios):
    for result in composer_both(composer_scenarios, "checkpoint_barrier"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
    saved = sorted(
        p.name for p in (composer_scenarios[0] / "ckpt" / "e2e").glob("ep*-ba*-rank0.pt")
    )
    assert saved == ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"]
    assert not list(composer_scenarios[0].rglob("*rankguard*"))  # barrier markers are removed


def test_loop_folders_of_each_rank_own_are_created_and_clean(loop_scenarios):
    for rank in loop_scenarios[2]:
        result = rank["per_rank_ckpt"]
        assert result["outcome"] == "ok" and result["warnings"] == [], result
        assert result["counters"]["files"] == [
            "per_rank/ckpt_rank0/model.pt",
            "per_rank/ckpt_rank1/model.pt",
        ]


def test_loop_resume_from_one_nodes_disk_fails_before_any_rank_loads(loop_scenarios):
    out, _, ranks = loop_scenarios
    host = HOST
    for r, rank in enumerate(ranks):
        result = rank["resume_node_local"]
        # At fit start: the save folder is each node's own.
        [warning] = result["warnings"]
        assert (
            f"Checkpoint folder {out}/node{r}/ckpt is node-local: node {host}/node1 (rank 1) "
            in (warning)
        )
        assert result["outcome"] == "NodeLocalDirError", result
        assert result["message"].startswith(
            f"Checkpoint to resume from rank 0: {out}/node0/ckpt/last.pt; rank 1: "
            f"{out}/node1/ckpt/last.pt is not there on node {host}/node1 (rank 1); node "
            f"{host}/node0 (rank 0) sees it."
        )
        assert "loaded" not in result["counters"]  # no rank read it
    assert [rank["resume_node_local"]["counters"]["saved"] for rank in ranks] == [1, 0]


def test_hf_resume_from_a_checkpoint_one_node_lacks_fails_before_the_trainer_loads(hf_scenarios):
    out, _, ranks = hf_scenarios
    host = HOST
    # Rank 1's node got only its own RNG state from each save: no resumable checkpoint.
    assert [r["node_local_resume"]["counters"]["saved"][-1] for r in ranks] == [
        "training_args.bin",
        "rng_state_1.pth",
    ]
    for r, rank in enumerate(ranks):
        result = rank["node_local_resume"]
        [warning] = result["warnings"]  # the first run's save folder, at its fit start
        assert warning.startswith(
            f"rankguard shared_dir_barrier: Checkpoint folder {out}/hf_node{r}/out is node-local: "
            f"node {host}/node1 (rank 1) does not see what rank 0 ({host}/node0) writes there"
        )
        assert result["outcome"] == "NodeLocalDirError", result
        state = "checkpoint-6/trainer_state.json"
        assert result["message"].startswith(
            f"Checkpoint to resume from rank 0: {out}/hf_node0/out/{state}; rank 1: "
            f"{out}/hf_node1/out/{state} is not there on node {host}/node1 (rank 1); node "
            f"{host}/node0 (rank 0) sees it."
        )
        assert "steps" not in result["counters"]  # stopped before any step of the resume
