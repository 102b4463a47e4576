"""A rank on another node raises, dies or freezes: two torchruns, no launcher sees the other node.

The job is ``tests/e2e/nodes_fault_job.py``; each node is its own torchrun, so node 0's
launcher never stops node 1's rank and the reverse: only rankguard ends the job.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.launch import kill_tree, launch_nodes, start_nodes
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


def _node0_then_node1_killed(
    scenario: str, out: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[str, str]:
    """Runs the job; once node 0 ended, node 1 is killed (a stopped rank never ends).

    Returns both nodes' stderr (torchrun's failure summaries and the ranks' logs).
    """
    procs = start_nodes(JOB, [str(out), scenario], nodes=2, per_node=1, env=env)
    try:
        _, err0 = procs[0].communicate(timeout=timeout)
    finally:
        for proc in procs:
            kill_tree(proc)
    _, err1 = procs[1].communicate(timeout=30)
    return err0, err1


_NAMED = "rank 1 frozen or dead (no answer on the side channel"


def _named_lines(err0: str) -> dict[str, str]:
    """Rank 0's log lines naming rank 1 frozen or dead, by level (WARNING, then ERROR)."""
    return {
        ln.split()[3]: ln
        for ln in err0.splitlines()
        if _NAMED in ln and " [rank 0] " in ln  # a log line, not a message's later line
    }


@pytest.mark.parametrize("scenario", ["freeze_first_step", "kill_first_step"])
def test_a_rank_silent_from_inside_its_first_step_on_another_node_is_named_in_seconds(
    tmp_path, scenario
):
    # Still in start-up (deadline 30 min): its silent watchdog thread names it, not a deadline.
    err0, _ = _node0_then_node1_killed(scenario, tmp_path, timeout=100)
    assert _codes(err0) == {0: HANG_EXIT_CODE}, err0[-3000:]
    failed = _failed_at(tmp_path)
    summary = next((tmp_path / "reports").rglob("summary.txt")).read_text()
    assert summary.startswith("rank 1 frozen or dead (no answer on the side channel for"), summary
    logged = {level: float(line.split()[0]) for level, line in _named_lines(err0).items()}
    # exchange_period_s 1 s (timeout 2 s): named at 5 s of silence (WARNING), ended at 13 s
    assert logged["WARNING"] - failed < 30 and logged["ERROR"] - failed < 60, logged
    assert "Now aborting with exit code 75" in err0


#: Each scenario freezing rank 1 in a phase (``RankGuard()`` at its defaults): the phase the
#: others last saw it in, as "last seen: ..." words it (the job evaluates or saves after step 4).
PHASES = {
    "freeze_eval": r"(after )?eval batch \d+ of 'eval'",
    "freeze_save": r"checkpoint save at step 4",
}


@pytest.fixture(scope="module")
def frozen_in_phase(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Both jobs of :data:`PHASES` at once: rank 0's stderr, the folder.

    About 90 s each (the fault 15-20 s after the start, the end 65 s later); 240 s is the
    harness's kill.
    """
    runs = {name: tmp_path_factory.mktemp(name) for name in PHASES}
    with ThreadPoolExecutor(len(runs)) as pool:
        errs = {
            name: pool.submit(_node0_then_node1_killed, name, out, 240, {"RANKGUARD": "defaults"})
            for name, out in runs.items()
        }
        return {name: (errs[name].result()[0], runs[name]) for name in runs}


def _last_seen(line: str, rank: int) -> str:
    """The phase ``rank`` was in by a log line's "last seen: ..." (``ranks 0,1 in X; ...``)."""
    seen = line.split("last seen: ", 1)[1].rstrip(").")
    for part in seen.split("; "):
        who, phase = part.split(" in ", 1)
        if rank in {int(r) for r in who.split()[1].split(",")}:
            return phase.split(" (blocked in ", 1)[0]
    raise AssertionError(f"rank {rank} not in {seen!r}")


@pytest.mark.parametrize("scenario", list(PHASES))
def test_a_rank_frozen_in_an_eval_or_a_save_on_another_node_is_named_then_ended_75(
    frozen_in_phase, scenario
):
    # RankGuard() with only a report folder: named within 30 s, ended with 75 within 90 s
    err0, out = frozen_in_phase[scenario]
    assert _codes(err0) == {0: HANG_EXIT_CODE}, err0[-3000:]
    assert "Now aborting with exit code 75" in err0
    failed = _failed_at(out)
    lines = _named_lines(err0)
    assert set(lines) == {"WARNING", "ERROR"}, err0[-3000:]
    named, ended = (float(lines[level].split()[0]) - failed for level in ("WARNING", "ERROR"))
    # two missed status exchanges (30 s of silence), then six (70 s), counted from its last
    assert 0 < named < 30 and named < ended < 90, (named, ended)
    warned = "Hang suspected: rank 1 frozen or dead (no answer on the side channel for 30 s; "
    assert warned in lines["WARNING"], lines
    assert "Hang: rank 1 frozen or dead (no answer on the side channel for 70 s; " in lines["ERROR"]
    for line in lines.values():
        assert re.fullmatch(PHASES[scenario], _last_seen(line, 1)), line
    summary = next((out / "reports").rglob("summary.txt")).read_text()
    assert summary.startswith(f"{_NAMED} for 70 s; last seen: "), summary
    print(f"{scenario}: named {named:.1f} s, ended {ended:.1f} s after the freeze")


def _rankguard_lines(*nodes) -> str:
    """Both nodes' rankguard log lines: what a failure needs first (the tail is torchrun's)."""
    return "\n".join(
        line for node in nodes for line in node.stderr.splitlines() if " rankguard" in line
    )


def test_a_rank_slow_in_python_in_its_first_step_is_never_named(tmp_path):
    node0, node1 = launch_nodes(
        JOB, [str(tmp_path), "slow_first_step"], nodes=2, per_node=1, timeout=100
    )
    codes = (node0.returncode, node1.returncode)
    assert codes == (0, 0), f"{_rankguard_lines(node0, node1)}\n{node0.stderr[-3000:]}"
    assert "frozen or dead" not in node0.stderr + node1.stderr
