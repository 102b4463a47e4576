"""A preemption that reaches one node only: two torchruns, SIGTERM to node 1's launcher.

The job is ``tests/e2e/stop_job.py``; node 0 is never signalled. Every rank must stop
after the same train step, save, and exit with 75 (restart the job).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.launch import finish, kill_tree, signal_node, start_nodes
from rankguard.callbacks.hang.stop import STOP_EXIT_CODE

JOB = Path(__file__).resolve().parents[1] / "e2e" / "stop_job.py"
pytestmark = pytest.mark.framework  # two torchruns: make test, not make check


def _codes(stderr: str) -> dict[int, int]:
    """Each local rank's exit code as torchrun's failure summary names it."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


def test_sigterm_to_one_nodes_launcher_stops_every_rank_after_one_step_then_75(tmp_path):
    procs = start_nodes(JOB, [str(tmp_path)], nodes=2, per_node=1)
    try:  # node 1's torchrun alone: it passes SIGTERM on to rank 1
        signalled_at = signal_node(procs, tmp_path / "ready", node=1, timeout_s=90)
        node0, node1 = finish(procs, 120 if signalled_at is not None else 5)
    finally:
        for proc in procs:
            kill_tree(proc)
    assert signalled_at is not None, f"rank 1 never reached its ready step:\n{node1.stderr[-3000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    steps = {r["step"] for r in results}
    assert len(steps) == 1, results
    (step,) = steps
    for r in results:
        assert r["stopped"] == f"preempted by SIGTERM on rank 1 at step {step}", r
        assert r["exit_code"] == STOP_EXIT_CODE
    for rank in (0, 1):  # the save after the loop ran on every rank
        assert (tmp_path / "ckpt" / f"{rank}.pt").exists()
    took = max(r["saved_at"] for r in results) - signalled_at
    assert took < 20, took  # saved inside the grace, under torchelastic's 30 s
    print(f"stopped after step {step}; saved {took:.1f} s after the signal")
    assert _codes(node0.stderr) == {0: STOP_EXIT_CODE}, node0.stderr[-3000:]
    assert "Preempted: SIGTERM on rank 1" in node0.stderr, node0.stderr[-3000:]
    for node in (node0, node1):  # rank 1's exit code: its torchrun, signalled, names none
        warnings = [ln for ln in node.stderr.splitlines() if "WARNING rankguard" in ln]
        assert len(warnings) == 1 and "Preempted: SIGTERM on rank 1" in warnings[0], warnings
    print(node0.stderr[-6000:])
