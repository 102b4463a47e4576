"""Checkpoint folders and memory: node-local disks, a late or never-seen folder, NFS's
negative cache, saves over the node's memory."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch.distributed as dist
from olmo_core.train.callbacks import Callback

from tests.e2e.common import Mirror, own_node
from tests.e2e.olmo_core_concerns import harness
from tests.e2e.olmo_core_concerns.harness import COUNTERS, QUICK, build_trainer, counting, fit


def node_local() -> None:
    """Each rank plays a node whose local disk is ``node<r>/``; ``OLMO_SHARED_FS=1`` says shared."""
    from rankguard.integrations.olmo_core import RankGuard

    rank = dist.get_rank()
    os.environ["OLMO_SHARED_FS"] = "1"
    try:
        with own_node(rank, harness.OUT / f"node{rank}") as disk:
            trainer = build_trainer(
                harness.OUT / "node_local", counting(RankGuard(**QUICK)), save_folder=disk / "ckpt"
            )
            fit(trainer)
    finally:
        del os.environ["OLMO_SHARED_FS"]


#: How late rank 1's view of the shared folder shows ``step0-tmp``: past OLMo-core's 10 s.
LATE_S = 12.0
#: The barrier's ``timeout_s`` where rank 1 never sees ``step0-tmp``.
NEVER_TIMEOUT_S = 2.0


def lagging_view(name: str, late_s: float, guard: Callback) -> None:
    """Rank 0 saves into ``view0/ckpt``, rank 1 into ``view1/ckpt``: its view of one folder.

    A mirror thread in rank 1 shows rank 0's ``step0-tmp`` there ``late_s`` after rank 0
    makes it (``math.inf``: never), every other folder at once. 2 steps, saved at steps 0
    and 2 (OLMo-core's pre-train and final saves); the time each folder poll took, by path
    below the save folder, goes to the ``folder_waits`` counter.
    """
    rank = dist.get_rank()
    base = harness.OUT / name
    view = base / f"view{rank}"
    view.mkdir(parents=True)  # each node's mount point
    barrier = next(g for g in guard.runner.guards if g.name == "shared_dir_barrier")
    run = barrier.run
    waits: dict[str, float] = {}

    def timed(directories, where, *args, **kwargs):
        report = run(directories, where, *args, **kwargs)
        if where == "checkpoint_folder" and report is not None:
            below = os.path.relpath(report.paths[0], view / "ckpt")
            waits[below] = round(report.max_waited_s, 1)
            COUNTERS["folder_waits"] = dict(waits)
        return report

    barrier.run = timed
    late = {"ckpt/step0-tmp": late_s}
    mirror = Mirror([(str(base / "view0"), str(view), lambda rel: late.get(rel, 0.0))])
    if rank == 1:
        mirror.start()
    try:
        trainer = build_trainer(
            base,
            counting(guard),
            eval_sequences=None,
            save_folder=view / "ckpt",
            steps=2,
            save_interval=100,
        )
        fit(trainer)
    finally:
        mirror.stop.set()
        if rank == 1:
            mirror.join()


def late_checkpoint_folder() -> None:
    """Rank 1 sees ``step0-tmp`` 12 s late: OLMo-core would give up after 10 s."""
    from rankguard.integrations.olmo_core import RankGuard

    lagging_view("late_folder", LATE_S, RankGuard(**QUICK))


def checkpoint_folder_never_seen() -> None:
    """Rank 1 never sees ``step0-tmp``: named after the barrier's 2 s ``timeout_s``."""
    from rankguard.integrations.olmo_core import RankGuard

    barrier = {"timeout_s": NEVER_TIMEOUT_S}
    lagging_view("never_seen", math.inf, RankGuard(shared_dir_barrier=barrier, **QUICK))


#: How long rank 1's negative lookup cache hides each ``step<N>`` after rank 0 made it, and
#: the barrier's ``warn_late_s`` (the suite's short lag; ``benchmarks/nfs_lag.py`` sets 15 s).
NEG_CACHE_LAG_S = float(os.environ.get("NEG_CACHE_LAG_S", "2.0"))
NEG_CACHE_WARN_S = float(os.environ.get("NEG_CACHE_WARN_S", "1.0"))


def negative_cache_folder() -> None:
    """One save folder; rank 1's NFS client hides each renamed ``step<N>`` ``NEG_CACHE_LAG_S``.

    Under negative-cache semantics (:class:`tests.e2e.nfs_view.NegativeLookupCache`):
    ``stat`` says ``ENOENT``, ``mkdir`` says ``EEXIST``, the listing leaves it out. 2
    steps, saved at steps 0 and 2, synchronously (OLMo-core 3.0's async save records its
    duration at whatever step each rank has reached when it ends: ranks a lag has put apart
    then reduce different metric steps and hang); the cache's longest hide per folder goes to
    ``hidden``.
    """
    from rankguard.integrations.olmo_core import RankGuard
    from tests.e2e.nfs_view import NegativeLookupCache

    base = harness.OUT / "negative_cache"
    barrier = {"warn_late_s": NEG_CACHE_WARN_S}
    guard = RankGuard(shared_dir_barrier=barrier, **QUICK)
    cache = NegativeLookupCache(
        str(base / "ckpt"), NEG_CACHE_LAG_S, lambda p: re.fullmatch(r"step\d+", Path(p).name)
    )
    trainer = build_trainer(base, counting(guard), eval_sequences=None, steps=2, save_interval=100)
    if dist.get_rank() == 1:
        cache.__enter__()
    try:
        fit(trainer)
    finally:
        if dist.get_rank() == 1:
            cache.__exit__()
        COUNTERS["hidden"] = {Path(p).name: round(s, 1) for p, s in cache.hidden.items()}


#: Host memory the planner is told each node has: less than the 1-layer model's state.
TINY_HOST_BYTES = 16 * 1024


def ckpt_over_memory() -> None:
    """OLMo-core's default sharded save, on a node given 16 KiB: stopped at fit start."""
    from rankguard.integrations.olmo_core import RankGuard

    planner = {"host_memory_bytes": TINY_HOST_BYTES, "mode": "raise"}
    guard = RankGuard(checkpoint_planner=planner, **QUICK)
    fit(build_trainer(harness.OUT / "ckpt_over_memory", counting(guard)))


def full_export_over_memory() -> None:
    """``state_dict_save_opts={'full_state_dict': True}``: a full export, planned as one."""
    from rankguard.integrations.olmo_core import RankGuard

    planner = {"host_memory_bytes": TINY_HOST_BYTES, "mode": "raise"}
    guard = RankGuard(checkpoint_planner=planner, **QUICK)
    options = {"full_state_dict": True, "cpu_offload": True}
    trainer = build_trainer(
        harness.OUT / "full_export", counting(guard), state_dict_save_opts=options
    )
    fit(trainer)


SCENARIOS = {
    "node_local": node_local,
    "late_checkpoint_folder": late_checkpoint_folder,
    "checkpoint_folder_never_seen": checkpoint_folder_never_seen,
    "negative_cache_folder": negative_cache_folder,
    "ckpt_over_memory": ckpt_over_memory,
    "full_export_over_memory": full_export_over_memory,
}
