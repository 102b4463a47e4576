"""A rank on another node raises or is killed: two torchruns, no launcher sees the other node.

The job is ``tests/e2e/nodes_fault_job.py``; each node is its own torchrun, so node 0's
launcher never stops node 1's rank and the reverse: only rankguard ends the job.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from benchmarks.launch import launch_nodes
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, HANG_EXIT_CODE

JOB = Path(__file__).resolve().parents[1] / "e2e" / "nodes_fault_job.py"
pytestmark = pytest.mark.framework  # two torchruns: make test, not make check


def _codes(stderr: str) -> dict[int, int]:
    """Each local rank's exit code as torchrun's failure summary names it."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


def _failed_at(out: Path) -> float:
    return json.loads((out / "rank1.json").read_text())["failed"]


def test_a_rank_raising_on_another_node_ends_every_rank_in_seconds(tmp_path):
    started = time.monotonic()
    node0, node1 = launch_nodes(JOB, [str(tmp_path), "raise"], nodes=2, per_node=1, timeout=120)
    took = time.monotonic() - started
    assert _codes(node0.stderr) == {0: DEADLOCK_EXIT_CODE}, node0.stderr[-3000:]
    # rank 1's teardown waits: rankguard ends it at teardown_timeout_s (3 s), with 70
    assert _codes(node1.stderr) == {1: DEADLOCK_EXIT_CODE}, node1.stderr[-3000:]
    assert took < 90, took  # not the harness's 120 s, nor gloo's 30 min
    line = next(ln for ln in node0.stderr.splitlines() if "Rank 1 raised ValueError" in ln)
    assert "rankguard hang_watchdog: Rank 1 raised ValueError: sample 4711 has no tokens" in line
    assert "nodes_fault_job.py:" in line and "(check_batch)" in line
    assert "; train batch 5, host" in line  # the sixth batch: 5 steps done
    summary = next((tmp_path / "reports").rglob("summary.txt")).read_text()
    assert summary.startswith("Rank 1 raised ValueError: sample 4711 has no tokens after filt")
    assert "it ends with exit code 70" in summary
    ended = (tmp_path / "reports").rglob("rank0.txt")
    assert next(ended).stat().st_mtime - _failed_at(tmp_path) < 10  # seconds, not minutes
    stacks = next((tmp_path / "reports").rglob("rank1.txt")).read_text()
    assert "destroy_process_group_waits" in stacks  # the bound wrote where its teardown waited


def test_a_rank_killed_on_another_node_is_named_gone_at_its_deadline(tmp_path):
    node0, node1 = launch_nodes(JOB, [str(tmp_path), "kill"], nodes=2, per_node=1, timeout=120)
    assert _codes(node1.stderr) == {1: -9}, node1.stderr[-3000:]
    assert _codes(node0.stderr) == {0: HANG_EXIT_CODE}, node0.stderr[-3000:]
    summary = next((tmp_path / "reports").rglob("summary.txt")).read_text()
    assert "rank 1" in summary.lower(), summary
    reported = next((tmp_path / "reports").rglob("rank0.txt")).stat().st_mtime
    # no pid to read across nodes: named once silent past its deadline (timeout_s 6 s)
    assert reported - _failed_at(tmp_path) < 30, summary
