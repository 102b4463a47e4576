"""One rank of tests/checkpoint/test_shared_dirs.py: the directory barrier on simulated nodes.

Launched by ``benchmarks/launch.py::launch_nodes``, one torchrun per node, so
each rank's node and local rank come from torchrun (``GROUP_RANK``,
``LOCAL_RANK``) as on a real cluster. Usage::

    torchrun ... ckpt_dirs_worker.py BASE OUT_DIR

``BASE`` holds, per node ``n``, a node-local disk ``local/n<n>`` and a view
``lag_ok/view<n>`` and ``lag_bad/view<n>`` of a lagging shared filesystem (the
test mirrors view 0 into view 1), and a plain shared directory ``shared``.
Every rank writes what each barrier returned or raised to ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any

import torch.distributed as dist

from rankguard.callbacks.checkpoint.shared_dir_barrier import SharedDirBarrier, ensure_shared_dirs
from rankguard.callbacks.core.errors import NodeLocalDirError
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.side_channel import SideChannel

#: The barrier's timeout; ``lag_beyond_timeout`` uses ``LAG_BAD_TIMEOUT_S``.
TIMEOUT_S = 3.0
LAG_BAD_TIMEOUT_S = 1.5
PROBE_WAIT_S = 0.5


def guard_reports(channel: SideChannel, rank: int) -> dict[str, Any]:
    """What SharedDirBarrier says about the node-local ``ckpt/model``, with and without uploads."""
    guard = SharedDirBarrier(probe_wait_s=PROBE_WAIT_S)
    guard.bind(channel)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("rankguard")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    out: dict[str, Any] = {}
    try:
        uploaded = EventFacts(directories=["ckpt/model"], uploads={"ckpt/model": "s3://b/run"})
        local = EventFacts(directories=["ckpt/model"])
        for key, facts in (("uploaded", uploaded), ("local", local)):
            records.clear()
            guard.on_fit_start(facts)
            out[key] = [(r.levelname, r.getMessage()) for r in records]
        if rank == 0:  # a checkpoint on node 0's disk only
            with open("ckpt/model/last.pt", "w") as f:
                f.write("state")
        channel.barrier("checkpoint written")
        try:
            guard.on_checkpoint_load_start(EventFacts(load_path="ckpt/model/last.pt"))
            out["load"] = "ok"
        except NodeLocalDirError as exc:
            out["load"] = str(exc)
    finally:
        log.removeHandler(handler)
    return out


def main(base: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    channel = SideChannel.from_environment(timeout_s=30)
    out: dict[str, Any] = {"node": node, "local_rank": int(os.environ["LOCAL_RANK"])}

    def attempt(
        key: str, paths: list[str], timeout_s: float = TIMEOUT_S, probe_existing: bool = False
    ) -> None:
        try:
            report = ensure_shared_dirs(
                paths,
                channel,
                timeout_s=timeout_s,
                probe_wait_s=PROBE_WAIT_S,
                probe_existing=probe_existing,
            )
            out[key] = dataclasses.asdict(report)
        except Exception as exc:
            out[key] = {"error": type(exc).__name__, "message": str(exc)}

    os.chdir(os.path.join(base, "local", f"n{node}"))  # node-local disks, relative paths
    attempt("node_local", ["ckpt/model", "ckpt/optim"])
    attempt("shared", [os.path.join(base, "shared", "ckpt", "train")])
    attempt("lag_within_timeout", [os.path.join(base, "lag_ok", f"view{node}", "ckpt", "model")])
    attempt(
        "lag_beyond_timeout",
        [os.path.join(base, "lag_bad", f"view{node}", "ckpt", "model")],
        timeout_s=LAG_BAD_TIMEOUT_S,
    )
    attempt("file_in_the_way", [os.path.join(base, "shared", "blocker", "model")])
    # Folders every rank sees already (made above), probed as at fit start.
    attempt("existing_node_local", ["ckpt/model"], probe_existing=True)
    attempt("existing_shared", [os.path.join(base, "shared", "ckpt", "train")], probe_existing=True)
    out["guard"] = guard_reports(channel, rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    channel.barrier("done")  # no rank leaves while another still reads the store
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
