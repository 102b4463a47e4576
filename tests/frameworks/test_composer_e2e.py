"""Real 2-rank Composer runs (``composer -n 2``, gloo on CPU) with rankguard.

One launcher invocation runs every scenario in sequence (each a fresh
Trainer); each check fires before ranks fall out of step, so the next
scenario starts in step. A second invocation checks the process exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.framework

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "e2e" / "composer_job.py"
LAUNCHER = Path(sys.executable).parent / "composer"
SCENARIOS = [
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


def launch(out_dir: Path, *scenarios: str, reraise: bool = False, timeout: float = 240):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "E2E_RERAISE": "1" if reraise else "0"}
    return subprocess.run(
        [str(LAUNCHER), "-n", "2", str(JOB), str(out_dir), *scenarios],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=out_dir,
    )


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("composer")
    proc = launch(out_dir, *SCENARIOS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out_dir


@pytest.fixture(scope="module")
def outcomes(job_dir):
    return [json.loads((job_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def both(outcomes, scenario):
    return [per_rank[scenario] for per_rank in outcomes]


def test_healthy_run_passes_with_no_rankguard_warning(outcomes):
    for result in both(outcomes, "healthy"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"] == {"train_batches": 8, "eval_batches": 4}


def test_checkpointing_run_goes_through_the_dir_barrier_silently(outcomes, job_dir):
    for result in both(outcomes, "checkpoint_barrier"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
    saved = sorted(p.name for p in (job_dir / "ckpt" / "e2e").glob("ep*-ba*-rank0.pt"))
    assert saved == ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"]
    assert not list(job_dir.rglob("*rankguard*"))  # barrier markers are removed


def test_uneven_eval_batches_fail_at_fit_start_before_any_batch(outcomes):
    for result in both(outcomes, "uneven_eval"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert "loader 'eval': rank 0: 2 batches; rank 1: 4 batches" in result["message"]
        assert "Fix:" in result["message"]
        assert result["counters"] == {}  # no train or eval batch ran on any rank


def test_with_every_guard_the_root_cause_is_named_first(outcomes):
    for result in both(outcomes, "uneven_eval_all_guards"):
        assert result["outcome"] == "DataInconsistencyError"
        assert (
            "loader 'eval': length differs (rank 0: 16 items; rank 1: 32 items)"
            in (result["message"])
        )
        assert result["counters"] == {}


def test_uneven_train_batches_fail_at_fit_start(outcomes):
    for result in both(outcomes, "uneven_train"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert "loader 'train': rank 0: 2 batches; rank 1: 3 batches" in result["message"]
        assert result["counters"] == {}


def test_drop_last_differing_between_ranks_fails_at_fit_start(outcomes):
    for result in both(outcomes, "drop_last_mismatch"):
        assert result["outcome"] == "DropLastMismatchError"
        assert "loader 'train': drop_last: rank 0: True, rank 1: False" in result["message"]
        assert result["counters"] == {}


def test_enforced_drop_last_gives_every_rank_the_same_full_batches(outcomes):
    for result in both(outcomes, "drop_last_enforce"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"]["train_batches"] == 8


def test_sampler_whose_len_lies_is_caught_after_eval(outcomes):
    # Composer stops both ranks when rank 0 runs out: rank 1's data is silently skipped.
    for result in both(outcomes, "lying_len"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert "ranks 0,1: ran 2 of 4 batches its __len__ promised" in result["message"]
        assert result["counters"]["eval_batches"] == 2


def test_sampler_yielding_past_its_len_on_one_rank_fails_at_fit_start(outcomes):
    # Without rankguard: both ranks run the 4 batches __len__ says; rank 1's other 4 are
    # silently skipped.
    for result in both(outcomes, "data_left_counted"):
        assert result["outcome"] == "BatchCountMismatchError"
        message = result["message"]
        assert message.startswith(
            "Loaders yield a different number of batches than planned from their __len__ "
            "(at fit start): loader 'eval': rank 1: __len__ 4 batches, yields 8 (4 never run)."
        )
        assert "Fix: make the sampler's (or batch sampler's) __len__ return" in message
        assert result["counters"] == {}  # before any batch


def test_eval_stream_running_out_on_one_rank_names_the_rank_that_had_data_left(outcomes):
    # Composer stops both ranks when rank 0's stream runs out after 3 of the 4 batches
    # both promise: rank 1's 4th is silently skipped.
    for result in both(outcomes, "data_left_eval_stream"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert result["message"].startswith(
            "Eval loader 'eval' left data behind: rank 0: ran out after 3 batches; still had "
            "data: rank 1: ran 3 batches, at least 1 more left; those batches never ran. "
            "Batches run: ranks 0,1: ran 3 of 4 batches its __len__ promised. Fix: "
        )
        assert result["counters"] == {"train_batches": 8, "eval_batches": 3}


def test_train_stream_running_out_on_one_rank_names_the_rank_that_had_data_left(outcomes):
    for result in both(outcomes, "data_left_train_stream"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert result["message"].startswith(
            "Train loader 'train' in epoch 0 left data behind: rank 0: ran out after 3 "
            "batches; still had data: rank 1: ran 3 batches, at least 1 more left"
        )
        assert "split iterable or streaming data evenly across ranks" in result["message"]
        assert result["counters"] == {"train_batches": 3}  # at the end of the epoch


def test_streams_that_hold_what_they_say_pass_silently(outcomes):
    for result in both(outcomes, "stream_healthy"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"] == {"train_batches": 4, "eval_batches": 3}


def test_uncaught_error_ends_the_job_with_a_nonzero_exit_code(tmp_path):
    proc = launch(tmp_path, "uneven_eval", reraise=True, timeout=120)
    assert proc.returncode != 0
    assert "BatchCountMismatchError" in proc.stdout + proc.stderr
