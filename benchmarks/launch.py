"""Launches simulated nodes on one machine: one torchrun per node, master on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def node_disk(disk: str, mount_point: str) -> list[str]:
    """A command prefix that runs a node's launcher with ``disk`` mounted at ``mount_point``.

    The node's processes see ``disk`` at the same absolute path where the other
    nodes see their own directory: a node-local disk, as on a cluster where
    each node mounts its own NVMe at ``/local``. Needs a private mount
    namespace (``unshare -m``, root or user namespaces); see :func:`can_mount`.
    """
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    namespace = ["unshare", "-m", "--propagation", "private"]
    return [*namespace, "sh", "-c", script, "sh", disk, mount_point]


def can_mount() -> bool:
    """Whether :func:`node_disk` works here."""
    try:
        probe = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "mount", "--bind", "/", "/"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def launch_nodes(
    script: Path,
    args: list[str],
    nodes: int,
    per_node: int,
    timeout: float,
    prefix: Mapping[int, Sequence[str]] | None = None,
) -> list[subprocess.CompletedProcess]:
    """Runs ``script`` on ``nodes`` x ``per_node`` ranks; each node is its own torchrun.

    After ``timeout`` seconds (for all nodes together) every node's torchrun and
    every process below it are killed. ``prefix`` gives a node's launcher a
    command to run under (e.g. :func:`node_disk`).
    """
    port = free_port()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                *(prefix or {}).get(node, ()),
                torchrun,
                f"--nnodes={nodes}",
                f"--nproc-per-node={per_node}",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(script),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(nodes)
    ]
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # torchrun starts each rank in a session of its own: killing torchrun (or its
            # process group) would leave the ranks running, holding the pipes open.
            for pid in [q for p in procs for q in (p.pid, *descendants(p.pid))]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results
