"""SharedDirBarrier: ranks on other nodes see checkpoint directories before anyone writes.

Two nodes of 2 ranks are simulated on one machine with two launcher
invocations, one torchrun per node (``benchmarks/launch.py``), so each rank's
node and local rank come from torchrun. Each node has its own local directory.
A lagging shared filesystem is a pair of directories, node 0's view and node
1's view, kept in step by a mirror thread in the test process
(:class:`tests.e2e.common.Mirror`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.launch import launch_nodes
from rankguard.callbacks.checkpoint.dir_probe import MARKER_PREFIX, PathState, filesystem_type
from rankguard.callbacks.checkpoint.shared_dir_barrier import SharedDirBarrier, ensure_shared_dirs
from rankguard.callbacks.checkpoint.shared_dirs_plan import BarrierPlanner
from rankguard.callbacks.core.errors import SharedDirCreateError
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.nodes import NodeId, node_identity
from rankguard.callbacks.core.side_channel import SideChannel
from tests.e2e.ckpt_dirs_worker import LAG_BAD_TIMEOUT_S, TIMEOUT_S
from tests.e2e.common import Mirror
from tests.mp import run_ranks

WORKER = Path(__file__).parents[1] / "e2e" / "ckpt_dirs_worker.py"
HOST = socket.gethostname()
LAG_OK_S, LAG_BAD_S = 1.0, 60.0


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("nodes"))
    out = tmp_path_factory.mktemp("ranks")
    for d in ("local/n0", "local/n1", "shared", "lag_ok/view0", "lag_ok/view1"):
        os.makedirs(os.path.join(base, d))
    for d in ("lag_bad/view0", "lag_bad/view1"):
        os.makedirs(os.path.join(base, d))
    with open(os.path.join(base, "shared", "blocker"), "w") as f:
        f.write("not a directory")
    mirror = Mirror(
        [
            (f"{base}/lag_ok/view0", f"{base}/lag_ok/view1", LAG_OK_S),
            (f"{base}/lag_bad/view0", f"{base}/lag_bad/view1", LAG_BAD_S),
        ]
    )
    mirror.start()
    try:
        results = launch_nodes(WORKER, [base, str(out)], nodes=2, per_node=2, timeout=120)
    finally:
        mirror.stop.set()
        mirror.join()
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n{result.stderr[-4000:]}"
    values = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(v["node"], v["local_rank"]) for v in values] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    return base, values


@pytest.mark.slow
def test_node_local_dirs_are_detected_and_created_by_each_nodes_local_rank_0(two_nodes):
    base, values = two_nodes
    for rank, value in enumerate(values):
        report = value["node_local"]
        for name in ("model", "optim"):
            own = os.path.join(base, "local", f"n{rank // 2}", "ckpt", name)
            assert own in report["paths"]  # relative path resolved per rank, reported absolute
            assert report["shared"][own] is False
            assert report["created_by"][own] == [0, 2]
            assert os.path.isdir(own)


@pytest.mark.slow
def test_shared_dir_is_created_once_by_rank_0(two_nodes):
    base, values = two_nodes
    path = os.path.join(base, "shared", "ckpt", "train")
    for value in values:
        assert value["shared"]["shared"][path] is True
        assert value["shared"]["created_by"][path] == [0]


@pytest.mark.slow
def test_shared_dir_shown_late_on_node_1_passes_within_timeout(two_nodes):
    _, values = two_nodes
    for rank, value in enumerate(values):
        report = value["lag_within_timeout"]
        assert "error" not in report, report
        [path] = report["paths"]
        assert report["created_by"][path] == [0]
        assert report["shared"][path] is True
        if rank >= 2:  # node 1 sees the directory only after the lag
            assert LAG_OK_S * 0.8 <= report["waited_s"] < TIMEOUT_S
        assert report["max_waited_s"] >= LAG_OK_S * 0.8


@pytest.mark.slow
def test_shared_dir_shown_too_late_names_path_lagging_ranks_and_fix(two_nodes):
    base, values = two_nodes
    for value in values:
        outcome = value["lag_beyond_timeout"]
        assert "error" in outcome, outcome  # what the rank saw instead, where it passed
        kind, message = outcome["error"], outcome["message"]
        assert kind == "SharedDirTimeoutError"
        assert os.path.join(base, "lag_bad", "view1", "ckpt", "model") in message
        assert "was not visible to ranks 2,3" in message
        assert "/node1" in message and f"waited {LAG_BAD_TIMEOUT_S:g} s" in message
        assert "Filesystem: ranks 2,3:" in message
        assert "actimeo" in message and "`timeout_s`" in message and "node-local" in message


@pytest.mark.slow
def test_file_in_the_way_is_a_clear_error_on_every_rank(two_nodes):
    base, values = two_nodes
    for value in values:
        kind, message = value["file_in_the_way"]["error"], value["file_in_the_way"]["message"]
        assert kind == "SharedDirCreateError"
        assert os.path.join(base, "shared", "blocker") in message
        assert "not a directory" in message and "Fix:" in message
    with open(os.path.join(base, "shared", "blocker")) as f:
        assert f.read() == "not a directory"  # never touched


@pytest.mark.slow
def test_existing_node_local_folder_is_probed_and_found_node_local(two_nodes):
    base, values = two_nodes
    for rank, value in enumerate(values):
        report = value["existing_node_local"]
        own = os.path.join(base, "local", f"n{rank // 2}", "ckpt", "model")
        assert report["shared"][own] is False
        assert report["created_by"][own] == []  # there already: nothing created
        assert (
            f"node {HOST}/node1 (ranks 2,3) does not see what rank 0 ({HOST}/node0)"
            in (report["node_local"][own])
        )


@pytest.mark.slow
def test_existing_shared_folder_is_probed_and_found_shared(two_nodes):
    base, values = two_nodes
    path = os.path.join(base, "shared", "ckpt", "train")
    for value in values:
        assert value["existing_shared"]["shared"][path] is True
        assert value["existing_shared"]["node_local"] == {}


@pytest.mark.slow
def test_guard_warns_about_a_node_local_folder_on_every_rank_unless_uploaded(two_nodes):
    base, values = two_nodes
    for rank, value in enumerate(values):
        guard = value["guard"]
        # Uploaded: fine, said once at INFO (by rank 0), no warning.
        levels = [level for level, _ in guard["uploaded"]]
        assert "WARNING" not in levels
        if rank == 0:
            [info] = [m for level, m in guard["uploaded"] if "is node-local (" in m]
            assert "also uploaded to s3://b/run" in info
        [warning] = [m for level, m in guard["local"] if level == "WARNING"]
        own = os.path.join(base, "local", f"n{rank // 2}", "ckpt", "model")
        assert f"Checkpoint folder {own} is node-local: node {HOST}/node1 (ranks 2,3)" in warning
        assert "Fix: save to a folder on a filesystem every node mounts" in warning


@pytest.mark.slow
def test_resume_checkpoint_on_one_node_only_names_the_nodes_that_cannot_see_it(two_nodes):
    _, values = two_nodes
    for value in values:
        message = value["guard"]["load"]
        assert message.startswith("Checkpoint to resume from ")
        assert f"is not there on node {HOST}/node1 (ranks 2,3); node {HOST}/node0 (ranks 0,1)" in (
            message
        )
        assert "Fix: put the checkpoint on a filesystem every node mounts" in message


@pytest.mark.slow
def test_markers_are_removed(two_nodes):
    base, _ = two_nodes
    leftovers = [f for _, _, files in os.walk(base) for f in files if f.startswith(MARKER_PREFIX)]
    assert leftovers == []


@pytest.mark.slow
def test_node_launcher_timeout_kills_every_rank(tmp_path):
    # torchrun starts each rank in a session of its own; a rank left behind would
    # hold the launcher's pipes open and stall the suite for as long as it runs.
    stuck = tmp_path / "stuck_rank.py"
    stuck.write_text(
        "import os, pathlib, time\n"
        "pathlib.Path(__file__).with_name('started' + os.environ['RANK']).touch()\n"
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    [result] = launch_nodes(stuck, [], nodes=1, per_node=1, timeout=8)
    assert time.monotonic() - started < 30
    assert (tmp_path / "started0").exists()  # the rank ran, and was killed
    assert result.returncode == -9
    left = subprocess.run(["pgrep", "-f", str(stuck)], capture_output=True, text=True)
    assert left.stdout == ""


def test_single_rank_creates_relative_dirs_and_reports_them_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = ensure_shared_dirs(["a/b", "c"], SideChannel(None))
    assert report.paths == [str(tmp_path / "a" / "b"), str(tmp_path / "c")]
    assert (tmp_path / "a" / "b").is_dir() and (tmp_path / "c").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["a", "c"]  # no marker left
    again = ensure_shared_dirs(["a/b"], SideChannel(None))
    assert again.created_by == {str(tmp_path / "a" / "b"): []}


def test_remote_uris_are_skipped_and_file_uris_are_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = ["s3://bucket/ckpt", f"file://{tmp_path}/x", "y"]
    report = ensure_shared_dirs(paths, SideChannel(None))
    assert report.paths == [str(tmp_path / "x"), str(tmp_path / "y")]
    assert sorted(os.listdir(tmp_path)) == ["x", "y"]  # no "s3:" directory


def test_guard_warns_instead_of_raising_when_asked(tmp_path, caplog):
    (tmp_path / "f").write_text("x")
    facts = EventFacts(directories=[str(tmp_path / "f" / "model")])
    with pytest.raises(SharedDirCreateError):
        SharedDirBarrier().on_checkpoint_save_start(facts)
    with caplog.at_level(logging.WARNING):
        SharedDirBarrier(on_violation="warn").on_fit_start(facts)
    assert "not a directory" in caplog.text
    assert (tmp_path / "f").read_text() == "x"


@pytest.mark.parametrize("arg", ["timeout_s", "poll_s", "probe_wait_s"])
def test_constructor_rejects_non_positive_times(arg):
    with pytest.raises(ValueError, match=f"`{arg}`"):
        SharedDirBarrier(**{arg: 0})
    with pytest.raises(ValueError, match="`on_violation`"):
        SharedDirBarrier(on_violation="ignore")


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
nfs01:/export/ckpt /mnt/ckpt nfs4 rw,actimeo=60 0 0
10.0.0.1@tcp:/scratch /lustre lustre rw 0 0
tmpfs /mnt/ckpt/tmp\\040dir tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/home/u/run", "ext4"),
        ("/mnt/ckpt/run1", "nfs4"),
        ("/mnt/ckptx", "ext4"),
        ("/lustre/proj/run", "lustre"),
        ("/mnt/ckpt/tmp dir/x", "tmpfs"),
    ],
)
def test_filesystem_type_from_proc_mounts(path, fstype):
    assert filesystem_type(path, MOUNTS) == fstype


def test_node_identity_uses_node_rank_then_group_rank():
    assert node_identity({"NODE_RANK": "1", "LOCAL_RANK": "3"}).key.endswith("/node1")
    assert node_identity({"GROUP_RANK": "2"}).node_rank == "2"
    assert node_identity({}).node_rank is None and node_identity({}).local_rank is None
    empty = node_identity({"NODE_RANK": "", "GROUP_RANK": "2", "LOCAL_RANK": ""})
    assert (empty.node_rank, empty.local_rank) == ("2", None)  # empty counts as unset


#: Short enough that a folder nobody creates fails fast instead of after 600 s.
PER_RANK_TIMEOUT_S = 3.0


def _per_rank_folders(rank: int, world_size: int, base: str) -> dict:
    """Each rank passes its own folder (``ckpt/rank<r>``): on one node, then as two nodes."""
    channel = SideChannel.from_environment(timeout_s=30)
    out: dict = {}

    def attempt(key: str, path: str) -> None:
        try:
            report = ensure_shared_dirs(
                [path], channel, timeout_s=PER_RANK_TIMEOUT_S, probe_wait_s=0.5
            )
            out[key] = dataclasses.asdict(report)
            out[key]["exists"] = os.path.isdir(path)
        except Exception as exc:
            out[key] = {"error": type(exc).__name__, "message": str(exc)}

    os.environ["LOCAL_RANK"] = "0"
    os.environ.pop("NODE_RANK", None)  # one node
    attempt("one_node_parent_exists", os.path.join(base, "ckpt", f"rank{rank}"))
    attempt("one_node_parent_missing", os.path.join(base, "fresh", f"rank{rank}"))
    os.environ["NODE_RANK"] = str(rank)  # each rank a node; base/n<r> stands for its disk
    disk = os.path.join(base, f"n{rank}")
    attempt("node_local_per_rank", os.path.join(disk, "ckpt", f"rank{rank}"))
    attempt("node_local_same_name", os.path.join(disk, "ckpt", "shared_name"))
    attempt("two_nodes_shared_per_rank", os.path.join(base, "shared", f"rank{rank}"))
    channel.barrier("done")
    return out


def test_per_rank_folders_are_each_created_by_their_rank_not_waited_out(tmp_path):
    base = str(tmp_path)
    for d in ("ckpt", "n0", "n1", "shared"):
        os.makedirs(os.path.join(base, d))
    outcomes = run_ranks(_per_rank_folders, 2, base, timeout_s=90)
    for outcome in outcomes:
        assert outcome.exitcode == 0, outcome.error
    for rank, outcome in enumerate(outcomes):
        result = outcome.value
        for key in (
            "one_node_parent_exists",
            "one_node_parent_missing",
            "node_local_per_rank",
            "two_nodes_shared_per_rank",
        ):
            report = result[key]
            assert "error" not in report, (key, report)
            [path] = report["paths"]
            assert path.endswith(f"rank{rank}") and report["exists"], (key, report)
            assert report["created_by"][path] == [0, 1], (key, report)  # each its own
            assert report["node_local"] == {}, (key, report)  # no folder meant to be shared
            assert report["max_waited_s"] < PER_RANK_TIMEOUT_S
        assert result["two_nodes_shared_per_rank"]["shared"] == {
            os.path.join(base, "shared", f"rank{rank}"): True
        }
        # One folder name on each node's own disk is still a node-local folder.
        same = result["node_local_same_name"]
        own = os.path.join(base, f"n{rank}", "ckpt", "shared_name")
        assert same["shared"][own] is False and same["created_by"][own] == [0, 1]
        assert (
            f"node {HOST}/node1 (rank 1) does not see what rank 0 ({HOST}/node0)"
            in (same["node_local"][own])
        )
    leftovers = [f for _, _, files in os.walk(base) for f in files if f.startswith(MARKER_PREFIX)]
    assert leftovers == []


def test_a_per_rank_folder_never_seen_names_the_rank_that_created_it():
    planner = BarrierPlanner(timeout_s=5)
    node = NodeId("gpu-1", None, None)
    states = {r: (node, [PathState(f"/ckpt/rank{r}", "absent", "/ckpt", "nfs4")]) for r in range(3)}
    assert planner.look(states).pending == [0]
    seen = {r: {0: True} for r in range(3)}  # one filesystem: the marker seen
    plan = planner.creators(seen, {0: 1})
    assert plan.creators == {0: [0, 1, 2]} and plan.node_local == {}
    assert "3 different folders" in plan.summary
    timeout = planner.visible({0: {0: 0.1}, 1: {0: None}, 2: {0: 0.2}})
    assert timeout.error.startswith(
        "Directory /ckpt/rank1 (created by rank 1 on gpu-1) was not visible to rank 1 (gpu-1) "
        "after they waited 5 s (`timeout_s`); ranks 0,2 see it."
    )


def test_a_folder_the_framework_made_is_waited_for_not_created_and_a_late_rank_is_named():
    # create=False (OLMo-core's rank 0 made step4-tmp): nothing to probe, rank 1 waits.
    planner = BarrierPlanner(timeout_s=600)
    states = {
        r: (NodeId(f"gpu-{r}", None, None), [PathState("/nfs/ckpt/step4-tmp", state, e, "nfs4")])
        for r, state, e in ((0, "visible", "/nfs/ckpt/step4-tmp"), (1, "absent", "/nfs/ckpt"))
    }
    look = planner.awaited(states)
    assert (look.pending, look.probe, look.error) == ([0], [], None)
    timeout = planner.visible({0: {0: 0.0}, 1: {0: None}})
    assert timeout.error.startswith(
        "Directory /nfs/ckpt/step4-tmp (created by rank 0 on gpu-0) was not visible to rank 1 "
        "(gpu-1) after they waited 600 s (`timeout_s`); rank 0 sees it. Filesystem: rank 1: nfs4. "
        "Fix: if the filesystem is shared but shows new directories late"
    )
    late = planner.visible({0: {0: 0.0}, 1: {0: 12.5}})
    assert late.error is None and late.max_waited_s == 12.5
    assert late.summary == (
        "/nfs/ckpt/step4-tmp: made by rank 0, not seen at first by rank 1; filesystem ranks "
        "0,1: nfs4; every rank saw it within 12.50 s"
    )
