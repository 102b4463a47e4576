"""Each framework's many-scenario launch, run once a session and read by the files of each concern.

A launch of ``tests/e2e/<framework>_job.py`` runs many scenarios in one pair of processes (a
fresh trainer each; every check fires on both ranks at one point, so the next starts in
step): what it costs is the frameworks' start, once. Its scenarios belong to several
concerns (batches, replicas, checkpoints, data, hangs), and each concern's tests live in its
own ``test_<concern>_e2e.py``. Module fixtures would launch once per file, and ``--dist
loadfile`` puts files on different workers: :func:`shared` runs a launch once per test
session instead. The first test to ask runs it under a lock; every later one, in any file
on any worker, waits for the lock and reads what it returned. A launch that failed fails
each of them with its message.

The session fixtures (``tests/frameworks/conftest.py``): ``composer_scenarios``,
``lightning_scenarios``, ``loop_scenarios``, ``hf_scenarios``, ``loop_data_scenarios``.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rankguard.callbacks.hang.hang_watchdog import HANG_EXIT_CODE
from tests.mp import launcher_port, run_job

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT_S = 240

T = TypeVar("T")


def _session_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this session shares (each worker's own is below it)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared(factory: pytest.TempPathFactory, name: str, launch: Callable[[Path], T]) -> T:
    """``launch(out)``'s value, run once this session for every test and worker that asks.

    Args:
        factory: pytest's ``tmp_path_factory``.
        name: The launch's name (its folder ``out``, shared by every reader).
        launch: Runs the launch into the empty folder it is given; returns what tests read
            (picklable).
    """
    root = _session_dir(factory) / "launches"
    root.mkdir(exist_ok=True)
    done = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not done.exists():
            out = root / name
            out.mkdir()
            try:
                value: Any = launch(out)
            except BaseException as exc:  # pytest.fail, an assertion: each reader fails too
                done.write_bytes(pickle.dumps((False, f"{type(exc).__name__}: {exc}")))
                raise
            done.write_bytes(pickle.dumps((True, value)))
            return value
    ok, value = pickle.loads(done.read_bytes())
    if not ok:
        pytest.fail(f"launch {name!r} failed (in the test that ran it):\n{value}", pytrace=False)
    return value


# -- Composer (``composer -n 2``): every scenario ends in step, the launch exits 0 ------------

COMPOSER_JOB = ROOT / "tests" / "e2e" / "composer_job.py"
COMPOSER_SCENARIOS = [
    "healthy",
    "checkpoint_barrier",
    "uneven_eval",
    "uneven_eval_all_guards",
    "uneven_train",
    "drop_last_mismatch",
    "drop_last_enforce",
    "lying_len",
    "data_left_counted",
    "data_left_eval_stream",
    "data_left_train_stream",
    "stream_healthy",
]


def composer_launch(
    out: Path, *scenarios: str, reraise: bool = False, timeout: float = LAUNCH_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """``composer -n 2 composer_job.py OUT SCENARIO...`` (``reraise``: a raise ends it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "E2E_RERAISE": "1" if reraise else "0"}
    env.update(launcher_port())
    return subprocess.run(
        [str(BIN / "composer"), "-n", "2", str(COMPOSER_JOB), str(out), *scenarios],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=out,
    )


def composer_scenarios(out: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Every scenario of :data:`COMPOSER_SCENARIOS`; the folder and each rank's outcomes."""
    proc = composer_launch(out, *COMPOSER_SCENARIOS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def composer_both(run: tuple[Path, list[dict[str, Any]]], scenario: str) -> list[dict[str, Any]]:
    """``scenario``'s outcome on each rank."""
    return [per_rank[scenario] for per_rank in run[1]]


# -- Lightning (``ddp``): the last scenario's error ends the launch ---------------------------

LIGHTNING_JOB = ROOT / "tests" / "e2e" / "lightning_job.py"
LIGHTNING_SCENARIOS = [
    "uneven_val_no_guard",
    "healthy",
    "healthy_distributed_sampler",
    "healthy_accumulation",
    "eval_padding_distributed_sampler",
    "replica_skipped_step",
    "uneven_val",
    "uneven_val_first_due_in_epoch_2",
    "uneven_val_after_sanity",
    "uneven_val_warn",
    "uneven_train",
    "drop_last_differs",
    "drop_last_differs_rankguard",
    "two_val_loaders_uneven",
    "lying_len_capped_by_lightning",
    "lying_len_slow_rank",
    "lying_len",
]


def _wait_for_report(path: Path, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            report = json.loads(path.read_text())
            if report.get("finished"):
                return report
        time.sleep(0.2)
    return json.loads(path.read_text()) if path.exists() else None


def lightning_scenarios(out: Path) -> dict[str, Any]:
    """Every scenario of :data:`LIGHTNING_SCENARIOS`: rank 0's exit, output, each rank's report."""
    reports: dict[int, dict[str, Any] | None] = {}

    def wait_for_reports() -> None:
        # Rank 0 does not wait for rank 1; give rank 1 a moment to write its report.
        reports.update({r: _wait_for_report(out / f"rank{r}.json", 30) for r in (0, 1)})

    job = run_job(
        [sys.executable, str(LIGHTNING_JOB), str(out), *LIGHTNING_SCENARIOS],
        timeout_s=LAUNCH_TIMEOUT_S,
        after_exit=wait_for_reports,
    )
    output = job.output
    for rank, report in reports.items():
        assert report is not None, f"rank {rank} wrote no report:\n{output[-6000:]}"
    return {"returncode": job.returncode, "output": output, "exited_at": job.ended_at, **reports}


def lightning_outcomes(job: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """``scenario``'s outcome on each rank (it ran on every rank)."""
    outcomes = [job[rank]["scenarios"].get(scenario) for rank in (0, 1)]
    assert all(outcomes), f"{scenario!r} did not run on every rank:\n{job['output'][-6000:]}"
    return outcomes


def lightning_error(job: dict[str, Any], scenario: str, error_type: str) -> list[str]:
    """Both ranks raised ``error_type`` with the same message; returns the messages."""
    outcomes = lightning_outcomes(job, scenario)
    for o in outcomes:
        assert o["outcome"] == "error", o
        assert o["error_type"] == error_type, o
    assert outcomes[0]["error"] == outcomes[1]["error"]
    return [o["error"] for o in outcomes]


def lightning_error_types(job: dict[str, Any], scenario: str, error_type: str) -> list[str]:
    """Both ranks raised ``error_type``; messages may differ (each says what it ran)."""
    outcomes = lightning_outcomes(job, scenario)
    assert [o["error_type"] for o in outcomes] == [error_type] * 2, outcomes
    return [o["error"] for o in outcomes]


# -- torchrun: a hand-written loop and the HF Trainer -------------------------------------------
# In order: a healthy run (the loop's also with FSDP2 and sharded DCP saves; at step 2 rank
# 1's data check raises and the loop catches it); datasets' unseeded train_test_split;
# uneven eval sets; a straggler; the loop's replica, data-left and folder scenarios; a resume
# from one node's disk; last, rank 1 stalls after its first eval and the watchdog ends every
# rank with 75.

SCENARIOS = ["healthy", "unseeded_split", "uneven_eval", "straggler", "post_eval_stall"]
LOOP_ONLY = [
    "fsdp2",
    "replica_accumulation",
    "replica_inverted_no_sync",
    "replica_hsdp",
    "replica_hsdp_unseeded",
    "short_eval_stream",
    "short_train_stream",
    "per_rank_ckpt",
    "resume_node_local",
]
LOOP_SCENARIOS = [*SCENARIOS[:-1], *LOOP_ONLY, SCENARIOS[-1]]
HF_SCENARIOS = [*SCENARIOS[:-1], "node_local_resume", "replica_ema_rank0", SCENARIOS[-1]]
#: Data faults in a loop, one launch: the last scenario's loader raises, which ends it.
DATA_SCENARIOS = [
    "no_sampler",
    "sampler_wrong_replicas",
    "slow_rank_data",
    "starved_loader",
    "teardown_waits",
]


def torchrun(job: str, out: Path, scenarios: list[str]) -> tuple[str, list[dict]]:
    """``torchrun --standalone`` of a job whose last scenario hangs: each rank exits 75."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "e2e" / job), str(out), *scenarios]
    result = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    # torchrun's error names the exit code of each rank that ended before it stopped the
    # others: one or both, 75 (every rank logs that it aborts).
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.output))
    assert result.returncode != 0 and codes == {str(HANG_EXIT_CODE)}, result.output[-6000:]
    return result.output, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def loop_scenarios(out: Path) -> tuple[Path, str, list[dict]]:
    """The loop's :data:`LOOP_SCENARIOS`: the folder, the output, each rank's outcomes."""
    return (out, *torchrun("torch_loop_job.py", out, LOOP_SCENARIOS))


def hf_scenarios(out: Path) -> tuple[Path, str, list[dict]]:
    """The HF Trainer's :data:`HF_SCENARIOS`: the folder, the output, each rank's outcomes."""
    return (out, *torchrun("hf_trainer_job.py", out, HF_SCENARIOS))


def loop_data_scenarios(out: Path) -> tuple[str, list[dict]]:
    """The loop's :data:`DATA_SCENARIOS`: the output and each rank's outcomes."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "tests" / "e2e" / "torch_loop_job.py"), str(out), *DATA_SCENARIOS]
    result = run_job(cmd, timeout_s=LAUNCH_TIMEOUT_S, cwd=out)
    (out / "output.txt").write_text(result.output)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return result.output, ranks
