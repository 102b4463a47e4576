"""SharedDirBarrier: every rank sees every checkpoint directory before anyone writes.

Holds :class:`SharedDirBarrier`, the guard, and :func:`ensure_shared_dirs`, the
barrier it runs; its pure decisions are in ``shared_dirs_plan``.
See docs/checkpoint.md#how-shareddirbarrier-works.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from rankguard.callbacks.checkpoint.dir_probe import (
    Marker,
    inspect_path,
    marker_seen,
    write_marker,
)
from rankguard.callbacks.checkpoint.dir_view import make, stat_result
from rankguard.callbacks.checkpoint.shared_dirs_plan import (
    BarrierPlanner,
    Verdict,
    load_path_problem,
)
from rankguard.callbacks.core.errors import (
    NodeLocalDirError,
    SharedDirCreateError,
    SharedDirTimeoutError,
)
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.nodes import node_identity
from rankguard.callbacks.core.settings import check_choice, check_positive
from rankguard.callbacks.core.side_channel import SideChannel

__all__ = ["DirReport", "SharedDirBarrier", "ensure_shared_dirs", "local_paths"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.shared_dirs")


@dataclass(frozen=True)
class DirReport:
    """What :func:`ensure_shared_dirs` found and did.

    Attributes:
        paths: This rank's absolute paths, in the order given.
        shared: Per path: ``True`` its filesystem is shared by every node,
            ``False`` node-local on some node, ``None`` not probed (every rank
            saw it already) or unknown (rank 0 could not write a marker).
        created_by: Per path, the ranks that created it (empty if none had to).
        waited_s: How long this rank polled for paths to appear.
        max_waited_s: The longest any rank polled.
        node_local: Per path whose folder (rank 0's) some nodes do not see,
            though their ranks name it: which nodes and ranks, and the
            filesystem (the same text on every rank). Folders of a rank's own
            are never listed.
        late: A warning for a folder some rank saw ``warn_late_s`` or more after
            the first (the same text on every rank), or ``""``.
    """

    paths: list[str]
    shared: dict[str, bool | None]
    created_by: dict[str, list[int]]
    waited_s: float
    max_waited_s: float
    node_local: dict[str, str] = field(default_factory=dict)
    late: str = ""


def _raise(verdict: Verdict) -> None:
    if verdict.error is not None:
        cls = SharedDirTimeoutError if verdict.timeout else SharedDirCreateError
        raise cls(verdict.error)


def _probe(paths: Sequence[str], markers: Mapping[int, Marker | None], wait_s: float) -> dict:
    seen = {i: False for i in markers}
    deadline, pause = time.monotonic() + wait_s, 0.02
    while True:
        for i, marker in markers.items():
            seen[i] = seen[i] or (marker is not None and marker_seen(paths[i], marker))
        left = deadline - time.monotonic()
        if all(seen.values()) or left <= 0:
            return seen
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)


def _wait(paths: Sequence[str], pending: Sequence[int], timeout_s: float, poll_s: float) -> dict:
    started = time.monotonic()
    waited: dict[int, float | None] = {i: None for i in pending}
    pause = poll_s
    while True:
        for i in pending:
            if waited[i] is None and stat_result(paths[i]) == "dir":
                waited[i] = time.monotonic() - started
        left = timeout_s - (time.monotonic() - started)
        if all(w is not None for w in waited.values()) or left <= 0:
            return waited
        time.sleep(min(pause, left))
        pause = min(pause * 1.5, max(poll_s, 2.0))


def local_paths(paths: Sequence[str]) -> list[str]:
    """Drops remote URIs (``s3://``, ``oci://``...), strips ``file://``, keeps plain paths."""
    out = []
    for path in paths:
        scheme, sep, rest = str(path).partition("://")
        if not sep:
            out.append(str(path))
        elif scheme == "file":
            out.append(rest)
        else:
            logger.debug("rankguard: %s is remote; no directory to share", path)
    return out


def ensure_shared_dirs(
    paths: Sequence[str],
    channel: SideChannel,
    *,
    timeout_s: float = 600.0,
    poll_s: float = 0.05,
    probe_wait_s: float = 2.0,
    probe_existing: bool = False,
    create: bool = True,
    name: str = "shared_dirs",
    warn_late_s: float = math.inf,
) -> DirReport:
    """Creates ``paths`` where needed and returns once every rank sees every one.

    Every rank must call it with the same number of paths. A path may differ
    between ranks: resolved against each rank's cwd, or a folder per rank
    (``ckpt/rank3``), which its rank's side creates. The node-local verdict
    concerns the ranks that name rank 0's folder (the same path, as seen from
    each node): a folder of a rank's own is not meant to be seen by others.

    Args:
        paths: Directories, absolute or relative to each rank's cwd; remote
            URIs (``s3://...``) are skipped, ``file://`` is stripped.
        channel: The side channel (a local one at world size 1).
        timeout_s: How long a rank polls for a path to appear (seconds).
        poll_s: First polling interval; it grows 1.5x up to 2 s.
        probe_wait_s: How long a rank looks for rank 0's marker before
            deciding its node does not share the filesystem.
        probe_existing: Also probe the paths every rank already sees, when the
            ranks run on more than one node: an existing folder may still be
            each node's own (a local disk, ``/tmp``, a folder made per node).
        create: ``False`` for folders the framework creates itself (its rank 0
            made them; its other ranks poll): only steps 1 and 4, nothing is
            probed or created.
        name: Prefix of the side-channel exchange names.
        warn_late_s: A folder some rank sees this much later than the first is
            described in :attr:`DirReport.late` (the caller warns).

    Returns:
        What was found and done (for the local paths only).

    Raises:
        SharedDirCreateError: A path is blocked or could not be created.
        SharedDirTimeoutError: Some rank did not see a path within ``timeout_s``.
    """
    states = [inspect_path(p) for p in local_paths(paths)]
    absolute = [s.path for s in states]
    # Its decide methods run on rank 0 only.
    planner = BarrierPlanner(timeout_s, probe_existing=probe_existing, warn_late_s=warn_late_s)
    decide = planner.look if create else planner.awaited
    look = channel.exchange(f"{name}/look", (node_identity(), states), decide)
    _raise(look)
    unprobed = DirReport(absolute, dict.fromkeys(absolute), {p: [] for p in absolute}, 0.0, 0.0)
    if not look.probe:  # every rank sees every path, or create=False: nothing to probe
        if not look.pending:
            return unprobed
        return _released(channel, planner, look.pending, unprobed, (timeout_s, poll_s, name))
    markers: dict[int, Marker | None] = {}
    written: list[str] = []
    try:
        if channel.is_leader:
            for i in look.probe:
                try:
                    markers[i], file = write_marker(states[i])
                    written.append(file)
                except OSError as exc:
                    logger.warning("rankguard: no marker for %s: %s", absolute[i], exc)
                    markers[i] = None
        markers = channel.broadcast(f"{name}/markers", markers)
        seen = _probe(absolute, markers, probe_wait_s)
        levels = {i: None if m is None else m.levels for i, m in markers.items()}
        plan = channel.exchange(
            f"{name}/seen", seen, lambda per_rank: planner.creators(per_rank, levels)
        )
    finally:
        for file in written:
            try:
                os.remove(file)
            except OSError:
                logger.warning("rankguard: could not remove marker %s", file)
    shared = {p: plan.shared.get(i) for i, p in enumerate(absolute)}
    node_local = {absolute[i]: text for i, text in plan.node_local.items()}
    if not look.pending:  # every rank sees every path: probed only
        if channel.is_leader:
            logger.info("rankguard %s: %s", name, plan.summary)
        return DirReport(absolute, shared, {p: [] for p in absolute}, 0.0, 0.0, node_local)
    errors: dict[int, str] = {}
    for i in look.pending:
        if channel.rank in plan.creators[i]:
            # mkdir's EEXIST where stat sees nothing: there, not yet visible here; waited for.
            _, error = make(absolute[i])
            if error is not None:
                errors[i] = error
    _raise(channel.exchange(f"{name}/created", errors, planner.created))
    creators = {p: sorted(plan.creators.get(i, [])) for i, p in enumerate(absolute)}
    report = DirReport(absolute, shared, creators, 0.0, 0.0, node_local)
    return _released(channel, planner, look.pending, report, (timeout_s, poll_s, name))


def _released(
    channel: SideChannel,
    planner: BarrierPlanner,
    pending: list[int],
    report: DirReport,
    settings: tuple[float, float, str],
) -> DirReport:
    """Step 4: polls for the pending paths, then releases every rank together (or names some)."""
    timeout_s, poll_s, name = settings
    waited = _wait(report.paths, pending, timeout_s, poll_s)
    mine = max((w if w is not None else timeout_s) for w in waited.values())
    done = channel.exchange(
        f"{name}/visible", waited, planner.visible, timeout_s=timeout_s + max(30.0, timeout_s / 4)
    )
    _raise(done)
    if channel.is_leader:
        logger.info("rankguard %s: %s", name, done.summary)
    return replace(report, waited_s=mine, max_waited_s=done.max_waited_s, late=done.late)


class SharedDirBarrier(Guard):
    """Makes every rank see the checkpoint directories before a save writes to them.

    Runs :func:`ensure_shared_dirs` on ``facts.directories`` at fit start and
    at every checkpoint save start (one side-channel exchange when every rank
    already sees them). At fit start of a multi-node job it also probes the
    folders that already exist, and reports one that is node-local (each
    node sees its own) on every rank, unless the framework also uploads the
    checkpoints saved there (then an INFO line says so). Before a resume it
    checks that every node sees the checkpoint to load.

    Args:
        on_violation: ``"raise"`` (default) or ``"warn"``: a directory some
            rank cannot see or create, a resume checkpoint some node cannot see.
        timeout_s: How long ranks wait for a directory to appear (> 0;
            minutes, because NFS attribute caches can hide a new directory
            for up to a minute).
        poll_s: First polling interval in seconds (> 0).
        probe_wait_s: How long a rank looks for rank 0's marker before it
            treats its node as not sharing the filesystem (> 0).
        on_node_local: ``"warn"`` (default) or ``"raise"``: a save folder that
            is node-local in a multi-node job (:class:`NodeLocalDirError`).
        warn_late_s: A folder some rank sees this many seconds later than the
            first rank is a warning naming the rank, its host, the lag and the
            mount options that cause it, once per run (> 0).

    Raises:
        ValueError: A setting out of range.
        SharedDirTimeoutError: A rank did not see a directory within ``timeout_s``.
        SharedDirCreateError: A rank could not create a directory.
        NodeLocalDirError: A node-local save folder (``on_node_local="raise"``), or a resume
            checkpoint some node does not see.

    Example::

        barrier = SharedDirBarrier(timeout_s=600, on_node_local="raise")
        # at fit start: creates save_folder where needed; every rank sees it
    """

    name = "shared_dir_barrier"

    def __init__(
        self,
        *,
        on_violation: str = "raise",
        timeout_s: float = 600.0,
        poll_s: float = 0.05,
        probe_wait_s: float = 2.0,
        on_node_local: str = "warn",
        warn_late_s: float = 5.0,
    ) -> None:
        super().__init__(on_violation=on_violation)
        self.timeout_s = check_positive("timeout_s", timeout_s)
        self.poll_s = check_positive("poll_s", poll_s)
        self.probe_wait_s = check_positive("probe_wait_s", probe_wait_s)
        self.on_node_local = check_choice("on_node_local", on_node_local, ("warn", "raise"))
        self.warn_late_s = check_positive("warn_late_s", warn_late_s)
        self.last_report: DirReport | None = None

    def on_checkpoint_load_start(self, facts: EventFacts) -> None:
        """Checks that every node sees the checkpoint about to be loaded."""
        paths = local_paths([facts.load_path]) if facts.load_path else []
        if not paths or not self.channel.is_distributed:
            return
        path = paths[0]
        mine = (node_identity(), os.path.abspath(path), os.path.exists(path))
        problem = self.channel.exchange(f"{self.name}/load", mine, load_path_problem)
        if problem:
            fix = facts.upload_setting or "load it from remote storage every node can read"
            self.violation(
                NodeLocalDirError(
                    f"{problem} Loading it would fail on those ranks while the others go on "
                    "and wait for them in the next collective. Fix: put the checkpoint on a "
                    "filesystem every node mounts, copy it to the same path on every node, "
                    f"or {fix}."
                )
            )

    def on_fit_start(self, facts: EventFacts) -> None:
        """Makes the save directories visible to every rank; reports node-local ones."""
        report = self.run(facts.directories, "fit_start", probe_existing=True)
        if report is not None:
            self._report_node_local(report, facts)

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Makes the directories of this save visible to every rank."""
        self.run(facts.directories, "checkpoint_save_start")

    def run(
        self,
        directories: Sequence[str],
        where: str,
        probe_existing: bool = False,
        create: bool = True,
    ) -> DirReport | None:
        """Runs the barrier (every rank, even with no directories, to stay in step).

        An adapter calls it with ``create=False`` where the framework's rank 0
        makes a folder and its other ranks poll for it (OLMo-core's
        ``step<N>-tmp``): they wait up to ``timeout_s``, and one that never sees
        it is named.
        """
        if not directories and not self.channel.is_distributed:
            return None
        try:
            self.last_report = ensure_shared_dirs(
                list(directories),
                self.channel,
                timeout_s=self.timeout_s,
                poll_s=self.poll_s,
                probe_wait_s=self.probe_wait_s,
                probe_existing=probe_existing,
                create=create,
                name=f"{self.name}/{where}",
                warn_late_s=self.warn_late_s,
            )
        except (SharedDirTimeoutError, SharedDirCreateError) as error:
            self.violation(error)
            return None
        self.log_metrics({"rankguard/shared_dir_wait_s": self.last_report.max_waited_s})
        if self.last_report.late:
            self.warn_once("late_folder", "%s", self.last_report.late)
        return self.last_report

    def _report_node_local(self, report: DirReport, facts: EventFacts) -> None:
        uploads = {
            os.path.abspath(p): uri for d, uri in facts.uploads.items() for p in local_paths([d])
        }
        for path, where in report.node_local.items():
            if path in uploads:
                if self.channel.is_leader:
                    logger.info(
                        "rankguard %s: checkpoint folder %s is node-local (%s); every checkpoint "
                        "saved there is also uploaded to %s, so a resume finds it on any node.",
                        self.name,
                        path,
                        where,
                        uploads[path],
                    )
                continue
            fix = facts.upload_setting or "upload every checkpoint to remote storage"
            error = NodeLocalDirError(
                f"Checkpoint folder {path} is node-local: {where}. A checkpoint saved there "
                "exists only on the node that wrote it (rank 0's, for a full save; for a "
                "sharded save each node holds its own shards): a resume on another node, or "
                "of a sharded checkpoint, finds it missing or incomplete. Fix: save to a folder "
                f"on a filesystem every node mounts (NFS, Lustre, ...), or {fix}."
            )
            if self.on_node_local == "raise":
                raise error
            self.warn_once(f"node_local:{path}", "%s", error)
