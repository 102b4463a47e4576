"""Real 2-rank Lightning runs (CPU, gloo) showing BatchParityGuard and DropLastGuard end to end.

One invocation of ``tests/e2e/lightning_job.py`` runs every scenario in
sequence in the same two processes (Lightning re-executes the script for rank
1); each rank records per scenario the outcome, the rankguard warnings and the
steps its module ran. The job has a hard timeout: a hang fails the suite, it
never blocks it.

Without rankguard, uneven val batch counts on gloo do not stop the run: with
``self.log(..., sync_dist=True)`` (one sync at val epoch end) both ranks finish,
rank 1 having silently run twice the val batches of rank 0. (With per-step
collectives in validation the extra ones pair with the wrong partner: gloo
aborts on a size mismatch, or hangs when training goes on after eval.)
"""

from __future__ import annotations

import json
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from tests.mp import run_job

pytestmark = [
    pytest.mark.framework,
    # find_spec, not importorskip: importing Lightning here would only cost seconds.
    pytest.mark.skipif(find_spec("lightning") is None, reason="needs rankguard[lightning]"),
]

JOB = Path(__file__).parents[1] / "e2e" / "lightning_job.py"
JOB_TIMEOUT_S = 240
# Every scenario's error fires on both ranks at the same point, so the ranks stay in
# step for the next one. The last one's error ends the job with a non-zero exit.
SCENARIOS = [
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


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the job once; returns rank 0's exit code, output and both ranks' reports."""
    out = tmp_path_factory.mktemp("lightning_job")
    reports: dict[int, dict[str, Any] | None] = {}

    def wait_for_reports() -> None:
        # Rank 0 does not wait for rank 1; give rank 1 a moment to write its report.
        reports.update({r: _wait_for_report(out / f"rank{r}.json", 30) for r in (0, 1)})

    job = run_job(
        [sys.executable, str(JOB), str(out), *SCENARIOS],
        timeout_s=JOB_TIMEOUT_S,
        after_exit=wait_for_reports,
    )
    output = job.output
    for rank, report in reports.items():
        assert report is not None, f"rank {rank} wrote no report:\n{output[-6000:]}"
    return {"returncode": job.returncode, "output": output, "exited_at": job.ended_at, **reports}


def _outcomes(job: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    outcomes = [job[rank]["scenarios"].get(scenario) for rank in (0, 1)]
    assert all(outcomes), f"{scenario!r} did not run on every rank:\n{job['output'][-6000:]}"
    return outcomes


def _assert_error(job: dict[str, Any], scenario: str, error_type: str) -> list[str]:
    """Both ranks raised ``error_type`` with the same message; returns the messages."""
    outcomes = _outcomes(job, scenario)
    for o in outcomes:
        assert o["outcome"] == "error", o
        assert o["error_type"] == error_type, o
    assert outcomes[0]["error"] == outcomes[1]["error"]
    return [o["error"] for o in outcomes]


def _assert_error_types(job: dict[str, Any], scenario: str, error_type: str) -> list[str]:
    """Both ranks raised ``error_type``; messages may differ (each says what it ran)."""
    outcomes = _outcomes(job, scenario)
    assert [o["error_type"] for o in outcomes] == [error_type] * 2, outcomes
    return [o["error"] for o in outcomes]


def test_job_ran_every_scenario_and_exits_nonzero_promptly_on_the_last_error(job):
    for rank in (0, 1):
        report = job[rank]
        assert report["rank"] == rank
        assert report["finished"], report
        assert list(report["scenarios"]) == SCENARIOS
        assert report["exit_code"] == 1  # the last scenario's error is re-raised
    # Rank 0 exits with the error (1), or Lightning's process observer kills it (-9)
    # once rank 1 has exited with it; either way promptly and not 0.
    assert job["returncode"] != 0, job["output"][-3000:]
    assert job["exited_at"] - job[0]["ended_at"] < 30
    assert "BatchCountMismatchError" in job["output"]


def test_without_rankguard_uneven_val_batches_pass_silently_on_gloo(job):
    outcomes = _outcomes(job, "uneven_val_no_guard")
    assert [o["outcome"] for o in outcomes] == ["ok", "ok"]
    assert [o["val_steps"] for o in outcomes] == [2, 4]
    assert outcomes[0]["metrics"] == outcomes[1]["metrics"]  # synced, nothing flagged


@pytest.mark.parametrize("scenario", ["uneven_val", "uneven_val_after_sanity"])
def test_uneven_val_batches_fail_before_the_first_val_batch(job, scenario):
    for message in _assert_error(job, scenario, "BatchCountMismatchError"):
        assert "loader 'val': rank 0: 2 batches; rank 1: 4 batches" in message
        assert "at fit start" in message  # Lightning loads val loaders before training
        assert "Fix:" in message
    for o in _outcomes(job, scenario):
        assert o["val_steps"] == 0
        assert o["train_steps"] == 0
    # Only the sanity check ran val batches: 2 on every rank (its planned count).
    assert [o["sanity_val_steps"] for o in _outcomes(job, "uneven_val_after_sanity")] == [2, 2]


def test_uneven_val_batches_unknown_at_fit_start_fail_at_val_start(job):
    scenario = "uneven_val_first_due_in_epoch_2"
    for message in _assert_error(job, scenario, "BatchCountMismatchError"):
        assert "before the first eval batch" in message
        assert "loader 'val': rank 0: 2 batches; rank 1: 4 batches" in message
    for o in _outcomes(job, scenario):
        assert o["val_steps"] == 0
        assert o["train_steps"] == 8  # two epochs of 4 batches, then the first val


def test_uneven_val_batches_with_warn_finish_training_and_name_the_ranks(job):
    outcomes = _outcomes(job, "uneven_val_warn")
    assert [o["outcome"] for o in outcomes] == ["ok", "ok"]
    assert [o["val_steps"] for o in outcomes] == [2, 4]  # what rankguard warns about
    assert [o["train_steps"] for o in outcomes] == [4, 4]
    for o in outcomes:
        assert o["warnings"], o
        assert all(w.startswith("rankguard.") for w in o["warnings"])
        assert any("rank 0: 2 batches; rank 1: 4 batches" in w for w in o["warnings"])
        # before the first val batch (planned counts) and after eval (what ran)
        assert any("before the first eval batch" in w for w in o["warnings"])
        assert any("rank 0: ran 2 batches; rank 1: ran 4 batches" in w for w in o["warnings"])


def test_lying_len_is_caught_after_eval_with_the_counts_that_ran(job):
    for message in _assert_error(job, "lying_len", "BatchCountMismatchError"):
        assert "Eval loader 'val' did not run the same, promised number of batches" in message
        assert "rank 0: ran 2 of 4 batches its __len__ promised; rank 1: ran 4 batches" in message
    # Both ranks planned 4 (the same __len__), so nothing fired before eval.
    assert [o["val_steps"] for o in _outcomes(job, "lying_len")] == [2, 4]


def test_rank_still_in_eval_is_named_after_eval_end_timeout(job):
    messages = _assert_error_types(job, "lying_len_slow_rank", "BatchCountMismatchError")
    for rank, message in enumerate(messages):
        assert "rank 1 did not finish eval loader 'val' within 0.5 s" in message
        ran = ["ran 2 of 4 batches its __len__ promised", "ran 4 batches"][rank]
        assert f"this rank {ran}" in message
    outcomes = _outcomes(job, "lying_len_slow_rank")
    assert outcomes[0]["elapsed_s"] < outcomes[1]["elapsed_s"]  # rank 0 did not wait for 1


def test_batches_past_len_that_lightning_would_skip_fail_before_the_first_val_batch(job):
    # Without rankguard: both ranks run the 2 batches __len__ says, and rank 1's other 2
    # never run, silently.
    for message in _assert_error(job, "lying_len_capped_by_lightning", "BatchCountMismatchError"):
        assert message.startswith(
            "Loaders yield a different number of batches than planned from their __len__ "
            "(at fit start): loader 'val': rank 1: __len__ 2 batches, yields 4 (2 never run)."
        )
    for o in _outcomes(job, "lying_len_capped_by_lightning"):
        assert (o["train_steps"], o["val_steps"]) == (0, 0)


def test_uneven_train_batches_fail_before_the_first_training_step(job):
    for message in _assert_error(job, "uneven_train", "BatchCountMismatchError"):
        assert "at fit start" in message
        assert "loader 'train': rank 0: 4 batches; rank 1: 6 batches" in message
    for o in _outcomes(job, "uneven_train"):
        assert o["train_steps"] == 0
        assert o["val_steps"] == 0


@pytest.mark.parametrize("scenario", ["drop_last_differs", "drop_last_differs_rankguard"])
def test_drop_last_differing_between_ranks_fails_at_fit_start(job, scenario):
    # With RankGuard too: DropLastGuard runs first, its error is the better explanation.
    for message in _assert_error(job, scenario, "DropLastMismatchError"):
        assert "loader 'train': drop_last: rank 0: True, rank 1: False" in message
        assert "Fix:" in message
    for o in _outcomes(job, scenario):
        assert o["train_steps"] == 0


def test_two_val_loaders_are_named_val_0_and_val_1(job):
    for message in _assert_error(job, "two_val_loaders_uneven", "BatchCountMismatchError"):
        assert "loader 'val/0': rank 0: 2 batches; rank 1: 3 batches" in message
        assert "loader 'val/1': rank 0: 2 batches; rank 1: 4 batches" in message


@pytest.mark.parametrize(
    "scenario", ["healthy", "healthy_distributed_sampler", "healthy_accumulation"]
)
def test_healthy_runs_pass_without_rankguard_warnings(job, scenario):
    outcomes = _outcomes(job, scenario)
    for o in outcomes:
        assert o["outcome"] == "ok", o
        assert o["warnings"] == []
        assert o["train_steps"] == 4
    # The sanity check ran (2 steps per val loader), then full validation.
    expected = {"healthy": (2, 4), "healthy_distributed_sampler": (4, 5)}
    counts = expected.get(scenario, (2, 4))
    assert [(o["sanity_val_steps"], o["val_steps"]) for o in outcomes] == [counts] * 2


def test_an_optimizer_step_skipped_on_one_rank_is_caught_at_the_next_check(job):
    # Manual optimization; rank 1 skips its second step. A check at every batch: the one at
    # batch 3's start sees it, collected at batch 4's start, on every rank.
    for message in _assert_error(job, "replica_skipped_step", "ReplicaDivergenceError"):
        lines = message.split("\n")
        assert lines[0] == (
            "Replicas differ: ranks 0,1 should hold the same parameters and do not."
        )
        # Lightning's global_step counts each rank's own optimizer steps.
        assert lines[1] == (
            "First seen at step 2 (counted per rank: rank 0: 2; rank 1: 1), at the check "
            "every train batch; the check at step 1 found them equal."
        )
        assert lines[3] == "Optimizer steps taken: rank 0: 2; rank 1: 1."
        assert lines[4].startswith("2 of 2 tensors differ: `layer.weight` (1x4): rank 1 differs")
        assert lines[5].startswith(
            "Likely causes, most likely first: (1) a skipped `optimizer.step()` on some ranks"
        )
    assert [o["train_steps"] for o in _outcomes(job, "replica_skipped_step")] == [3, 3]


def test_eval_padding_by_lightnings_distributed_sampler_is_a_warning(job):
    outcomes = _outcomes(job, "eval_padding_distributed_sampler")
    for o in outcomes:
        assert o["outcome"] == "ok", o
        assert len(o["warnings"]) == 1, o["warnings"]
        [warning] = o["warnings"]
        assert "eval loader 'val': the DistributedSampler repeats 1 sample(s)" in warning
        assert "15 samples" in warning
