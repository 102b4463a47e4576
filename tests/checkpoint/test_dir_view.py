"""What a rank's view of a folder means under NFS semantics (negative lookup cache).

``view_of`` against every combination of ``stat``, ``mkdir`` and listing results; the
lookups themselves under :class:`tests.e2e.nfs_view.NegativeLookupCache` (``stat``
says ``ENOENT`` for a while after the folder was made, ``mkdir`` says ``EEXIST``); and
2 ranks whose rank 1 sees the checkpoint folders late: waited for, one warning per run.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket

import pytest

from rankguard.callbacks.checkpoint.dir_probe import PathState, inspect_path
from rankguard.callbacks.checkpoint.dir_view import (
    ABSENT,
    BLOCKED,
    HIDDEN,
    VISIBLE,
    look,
    make,
    view_of,
)
from rankguard.callbacks.checkpoint.late_dirs import cache_options
from rankguard.callbacks.checkpoint.shared_dir_barrier import SharedDirBarrier
from rankguard.callbacks.checkpoint.shared_dirs_plan import BarrierPlanner
from rankguard.callbacks.core.nodes import NodeId
from rankguard.callbacks.core.side_channel import SideChannel
from tests.e2e.nfs_view import NegativeLookupCache
from tests.mp import run_ranks

V, H, A, B = VISIBLE, HIDDEN, ABSENT, BLOCKED
STATS = ["dir", "other", "ENOENT", "ENOTDIR", "ESTALE", "EACCES"]
MKDIRS = [None, "created", "EEXIST", "ENOENT", "ENOTDIR", "EACCES"]
#: Per ``stat`` result, per ``mkdir`` result (``MKDIRS``' order): the view when the
#: parent's listing is (not read, without the name, with the name).
TABLE = {
    # stat shows a directory: visible, whatever else says
    "dir": [(V, V, V)] * 6,
    # stat shows something else there: blocked (unless mkdir just made the folder)
    "other": [(B, B, B), (V, V, V), (B, B, B), (B, B, B), (B, B, B), (B, B, B)],
    # stat found nothing: mkdir's EEXIST or the listing says the server has it (hidden)
    "ENOENT": [(A, A, H), (V, V, V), (H, H, H), (A, A, H), (B, B, B), (A, A, H)],
    # an ancestor is not a directory here; the server may know better
    "ENOTDIR": [(B, B, H), (V, V, V), (H, H, H), (A, A, H), (B, B, B), (A, A, H)],
    # a stale handle or no permission: like ENOENT
    "ESTALE": [(A, A, H), (V, V, V), (H, H, H), (A, A, H), (B, B, B), (A, A, H)],
    "EACCES": [(A, A, H), (V, V, V), (H, H, H), (A, A, H), (B, B, B), (A, A, H)],
}


@pytest.mark.parametrize(
    ("stat", "mkdir", "listed"), list(itertools.product(STATS, MKDIRS, [None, False, True]))
)
def test_view_of_every_combination_of_stat_mkdir_and_listing(stat, mkdir, listed):
    expected = TABLE[stat][MKDIRS.index(mkdir)][[None, False, True].index(listed)]
    assert view_of(stat, mkdir, listed) == expected


def test_mkdir_eexist_where_stat_sees_nothing_is_there_not_yet_visible_never_in_the_way():
    assert view_of("ENOENT", "EEXIST", False) == HIDDEN
    assert all(view_of(s, "EEXIST", listed) != BLOCKED for s in STATS[2:] for listed in (0, 1))


LAG_S = 1.5


def test_a_folder_another_node_made_is_hidden_under_a_negative_lookup_cache(tmp_path):
    step = tmp_path / "ckpt" / "step10"
    step.mkdir(parents=True)  # "rank 0" made it; this process's cache still says not there
    with NegativeLookupCache(str(tmp_path / "ckpt"), LAG_S, lambda p: p == str(step)):
        assert not step.exists()
        with pytest.raises(FileExistsError):  # what os.makedirs(exist_ok=True) says
            os.makedirs(step, exist_ok=True)
        assert look(str(step)) == ABSENT  # its listing leaves it out too
        state = inspect_path(str(step))
        assert (state.state, state.existing) == (ABSENT, str(tmp_path / "ckpt"))
        assert make(str(step)) == (HIDDEN, None)  # mkdir's EEXIST: wait, do not fail
        assert inspect_path(str(step / "train")).state == ABSENT  # below it: not blocked
    with NegativeLookupCache(str(tmp_path / "ckpt"), LAG_S, listed=True):
        assert look(str(step)) == HIDDEN  # the listing shows it, stat does not
    assert inspect_path(str(step)).state == VISIBLE


def test_a_folder_whose_lookups_disagree_is_not_something_in_the_way(tmp_path, monkeypatch):
    # The seed's failure: rank 0 renames step10-tmp to step10 while rank 1 looks at
    # step10-tmp/train; rank 1's client still has step10-tmp's entry (lstat finds it),
    # stat asks again and finds nothing. Two lookups disagreeing are not "in the way".
    tmp = tmp_path / "ckpt" / "step10-tmp"
    tmp.mkdir(parents=True)
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if os.fspath(path).startswith(str(tmp)):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert os.path.lexists(tmp) and not os.path.isdir(tmp)
    state = inspect_path(str(tmp / "train"))
    assert (state.state, state.existing) == (ABSENT, str(tmp_path / "ckpt"))


def test_only_something_that_is_not_a_directory_is_in_the_way(tmp_path):
    (tmp_path / "file").write_text("x")
    assert inspect_path(str(tmp_path / "file")).state == BLOCKED
    assert inspect_path(str(tmp_path / "file" / "step1")).state == BLOCKED
    view, error = make(str(tmp_path / "file" / "step1"))
    assert view == BLOCKED and "NotADirectoryError" in error
    assert make(str(tmp_path / "new" / "step1")) == (VISIBLE, None)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert inspect_path(str(tmp_path / "dangling")).state == BLOCKED


def test_nfs_mount_options_that_hide_folders_are_named():
    mount = "/mnt/ckpt rw,relatime,vers=4.2,hard,actimeo=60,lookupcache=all,addr=10.0.0.1"
    assert cache_options("nfs4", mount) == "nfs4 at /mnt/ckpt with actimeo=60, lookupcache=all"
    assert "acdirmin=30, acdirmax=60, lookupcache=all (the defaults)" in cache_options(
        "nfs", "/mnt/ckpt rw,hard"
    )
    other = cache_options("ext4", "/ rw,relatime")
    assert other.startswith("ext4 at /, not NFS: ") and "`lookupcache`, `actimeo`" in other


def test_a_folder_seen_late_by_one_rank_is_described_with_its_host_lag_and_mount():
    planner = BarrierPlanner(timeout_s=600, warn_late_s=5.0)
    mount = "/nfs rw,actimeo=60"
    states = {
        r: (NodeId(f"gpu-{r}", None, None), [PathState("/nfs/ckpt/step10", s, e, "nfs4", mount)])
        for r, s, e in ((0, VISIBLE, "/nfs/ckpt/step10"), (1, ABSENT, "/nfs/ckpt"))
    }
    planner.awaited(states)
    late = planner.visible({0: {0: 0.0}, 1: {0: 15.7}}).late
    assert late.startswith("Folder /nfs/ckpt/step10 became visible 15.7 s late on rank 1 (gpu-1).")
    assert "nfs4 at /nfs with actimeo=60" in late and "`timeout_s` (600 s" in late
    assert "Fix: mount it with `lookupcache=positive`" in late
    assert planner.visible({0: {0: 0.0}, 1: {0: 4.9}}).late == ""  # under warn_late_s


def _lagging_rank_1(rank: int, world_size: int, base: str) -> dict:
    """Rank 0 makes OLMo-core's ``step1`` itself, then the barrier makes ``step2``.

    Rank 1 sees every ``step*`` ``LAG_S`` after it was made; ``plain`` at once.
    """
    channel = SideChannel.from_environment(timeout_s=30)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("rankguard").addHandler(handler)
    ckpt = os.path.join(base, "ckpt")
    out: dict = {}
    guard = SharedDirBarrier(timeout_s=20, warn_late_s=LAG_S / 2)
    guard.bind(channel)
    cache = NegativeLookupCache(ckpt, LAG_S, lambda p: os.path.basename(p).startswith("step"))
    if rank == 1:
        cache.__enter__()
    try:
        out["plain"] = guard.run([os.path.join(ckpt, "plain")], "checkpoint_save_start").late
        out["warnings_healthy"] = len(records)
        if rank == 0:
            os.makedirs(os.path.join(ckpt, "step1"))
        channel.barrier("step1 made")
        report = guard.run([os.path.join(ckpt, "step1")], "checkpoint_folder", create=False)
        out["step1"] = (report.waited_s, report.late)
        report = guard.run([os.path.join(ckpt, "step2")], "checkpoint_save_start")
        out["step2"] = (report.waited_s, report.late)
    finally:
        if rank == 1:
            cache.__exit__()
    out["warnings"] = [r.getMessage() for r in records]
    out["hidden"] = sorted(os.path.basename(p) for p in cache.hidden)
    channel.barrier("done")
    return out


@pytest.mark.slow
def test_folders_rank_1_sees_late_are_waited_for_and_warned_about_once(tmp_path):
    os.makedirs(tmp_path / "ckpt")
    outcomes = run_ranks(_lagging_rank_1, 2, str(tmp_path), timeout_s=90)
    for outcome in outcomes:
        assert outcome.exitcode == 0, outcome.error
    host = f"{socket.gethostname()}"
    for rank, outcome in enumerate(outcomes):
        result = outcome.value
        assert result["plain"] == "" and result["warnings_healthy"] == 0
        for key in ("step1", "step2"):
            waited, late = result[key]
            assert late.startswith(f"Folder {tmp_path}/ckpt/{key} became visible "), late
            assert f"late on rank 1 ({host}" in late
            if rank == 1:
                assert LAG_S * 0.5 < waited < 20
        [warning] = result["warnings"]  # two late folders, one warning per run
        assert warning.startswith(f"rankguard shared_dir_barrier: Folder {tmp_path}/ckpt/step1 ")
        assert "not NFS: if it is a network filesystem" in warning  # tmp is not NFS here
    assert outcomes[1].value["hidden"] == ["step1", "step2"]  # the cache did hide them
