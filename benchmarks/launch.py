"""Launches simulated nodes on one machine: one torchrun per node, master on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(
    script: Path, args: list[str], nodes: int, per_node: int, timeout: float
) -> list[subprocess.CompletedProcess]:
    """Runs ``script`` on ``nodes`` x ``per_node`` ranks; each node is its own torchrun."""
    port = free_port()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
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
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results
