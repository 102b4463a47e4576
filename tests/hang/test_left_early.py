"""A rank whose fit ends early, without an error, while the others train: they are told.

The job is ``tests/e2e/left_early_job.py`` (one torchrun, 2 ranks, the hang watchdog
alone): rank 0's shard is shorter, its fit ends after step 5; rank 1's sixth step is
longer than rank 0 stays in its close, so rank 1 reaches its next all-reduce after rank 0
left. A rank still in its own code when a peer's fit ends is told nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.launch import finish, start_nodes
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE

JOB = Path(__file__).resolve().parents[1] / "e2e" / "left_early_job.py"
pytestmark = pytest.mark.framework  # a torchrun: make test, not make check

LEFT = "Rank 0 left the fit early: its fit ended after train step 5 while rank 1 still trained."
#: From rank 0's fit end: its close (7 s), rank 1's long step (12 s), its settle time (3 s).
TOLD_WITHIN_S = 45.0


def _run(tmp_path: Path, scenario: str) -> tuple[str, dict[int, int]]:
    [node] = finish(start_nodes(JOB, [str(tmp_path), scenario], nodes=1, per_node=2), 150)
    assert not node.timed_out, node.stdout[-4000:]
    codes = re.findall(
        r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s+exitcode\s*:\s*(-?\d+)", node.stderr
    )
    return node.stderr, {int(rank): int(code) for rank, code in codes}


def _left_at(tmp_path: Path) -> float:
    return json.loads((tmp_path / "rank0.json").read_text())["left"]


def test_a_peer_waiting_for_a_rank_whose_fit_ended_ends_with_70_naming_it(tmp_path):
    """Rank 0's process stays after its fit (as when NCCL's teardown waits): rank 1 waits."""
    log, codes = _run(tmp_path, "export")
    assert codes.get(1) == DEADLOCK_EXIT_CODE, log[-4000:]
    assert "WARNING rankguard" not in log, log[-4000:]
    errors = [ln for ln in log.splitlines() if "ERROR rankguard" in ln]
    assert len(errors) == 1 and "[rank 1]" in errors[0], errors
    assert f"rankguard hang_watchdog: {LEFT}" in errors[0], errors[0]
    summary = (tmp_path / "reports" / "summary.txt").read_text()
    assert summary.startswith(LEFT), summary
    assert "Rank 1 waited in all_reduce at left_early_job.py:" in summary, summary
    assert f"it ends with exit code {DEADLOCK_EXIT_CODE}" in summary
    assert "Next: make every rank run the same number of steps" in summary
    told = (tmp_path / "reports" / "summary.txt").stat().st_mtime - _left_at(tmp_path)
    assert told < TOLD_WITHIN_S, told


def test_a_peer_whose_collective_fails_when_a_rank_whose_fit_ended_exits_names_it(tmp_path):
    """Rank 0 exits 0 after its fit: on gloo rank 1's all-reduce fails at once."""
    log, codes = _run(tmp_path, "exit")
    assert codes.get(1) not in (None, 0), log[-4000:]
    raised = [ln for ln in log.splitlines() if "ERROR rankguard" in ln and "[rank 1]" in ln]
    assert raised and f"rankguard hang_watchdog: {LEFT}" in raised[0], raised
    assert "This rank's RuntimeError" in raised[0] and "follows from it" in raised[0]


def test_a_rank_in_its_own_code_when_a_peers_fit_ends_is_told_nothing(tmp_path):
    """Equal shards; rank 1 runs 12 s of its own code at its fit's end: a healthy job."""
    log, codes = _run(tmp_path, "healthy")
    assert codes == {}, log[-4000:]  # torchrun names no failed rank
    told = "INFO rankguard.callbacks.hang_watchdog: rankguard hang_watchdog: This rank's fit ended "
    assert f"[rank 0] {told}while rank 1 still trains: told them" in log, log[-4000:]
    assert "WARNING rankguard" not in log and "ERROR rankguard" not in log, log[-4000:]
    assert "left the fit early" not in log, log[-4000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["step"] == 5
