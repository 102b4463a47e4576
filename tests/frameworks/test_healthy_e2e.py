"""Healthy runs end to end: every integration trains clean, with no rankguard warning.

Each integration's many-scenario launch (``tests/frameworks/launches.py``, run once a
session) starts with healthy fits: Composer, Lightning (also with a ``DistributedSampler``
and gradient accumulation), a hand-written loop (also with FSDP2 and sharded saves through
``torch.distributed.checkpoint``) and the HF Trainer, 2 CPU ranks on gloo. A healthy run
must log nothing and train every step; and a launch whose last scenario raises must exit
non-zero, promptly.
"""

from __future__ import annotations

import pytest

from tests.frameworks.launches import (
    LIGHTNING_SCENARIOS,
    composer_both,
    composer_launch,
    lightning_outcomes,
)

pytestmark = pytest.mark.framework


def test_composer_healthy_run_passes_with_no_rankguard_warning(composer_scenarios):
    for result in composer_both(composer_scenarios, "healthy"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"] == {"train_batches": 8, "eval_batches": 4}


def test_composer_uncaught_error_ends_the_job_with_a_nonzero_exit_code(tmp_path):
    proc = composer_launch(tmp_path, "uneven_eval", reraise=True, timeout=120)
    assert proc.returncode != 0
    assert "BatchCountMismatchError" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "scenario", ["healthy", "healthy_distributed_sampler", "healthy_accumulation"]
)
def test_lightning_healthy_runs_pass_without_rankguard_warnings(lightning_scenarios, scenario):
    outcomes = lightning_outcomes(lightning_scenarios, scenario)
    for o in outcomes:
        assert o["outcome"] == "ok", o
        assert o["warnings"] == []
        assert o["train_steps"] == 4
    # The sanity check ran (2 steps per val loader), then full validation.
    expected = {"healthy": (2, 4), "healthy_distributed_sampler": (4, 5)}
    counts = expected.get(scenario, (2, 4))
    assert [(o["sanity_val_steps"], o["val_steps"]) for o in outcomes] == [counts] * 2


def test_lightning_job_ran_every_scenario_and_exits_nonzero_promptly_on_the_last_error(
    lightning_scenarios,
):
    for rank in (0, 1):
        report = lightning_scenarios[rank]
        assert report["rank"] == rank
        assert report["finished"], report
        assert list(report["scenarios"]) == LIGHTNING_SCENARIOS
        assert report["exit_code"] == 1  # the last scenario's error is re-raised
    # Rank 0 exits with the error (1), or Lightning's process observer kills it (-9)
    # once rank 1 has exited with it; either way promptly and not 0.
    assert lightning_scenarios["returncode"] != 0, lightning_scenarios["output"][-3000:]
    assert lightning_scenarios["exited_at"] - lightning_scenarios[0]["ended_at"] < 30
    assert "BatchCountMismatchError" in lightning_scenarios["output"]


def test_loop_healthy_run_is_clean_on_both_ranks(loop_scenarios):
    out, _, ranks = loop_scenarios
    for r, rank in enumerate(ranks):
        result = rank["healthy"]
        assert result["outcome"] == "ok" and result["warnings"] == [], result
        # 2 epochs of 6 batches; an eval (2 batches) and a save every 4 steps. At step 2
        # rank 1's data check raised and the loop caught it: nothing for rankguard to say.
        caught = {"bad_samples_caught": 1} if r == 1 else {}
        assert result["counters"] == {
            "train_batches": 12,
            "eval_batches": 6,
            "saves": 3,
            "steps": 12,
            "epochs": 2,
            "checkpoint_files": 3,
            **caught,
        }
    assert not (out / "rankguard_reports" / "summary.txt").exists()  # no incident


def test_loop_with_fsdp2_and_sharded_dcp_saves_is_clean_and_planned_sharded(loop_scenarios):
    for rank in loop_scenarios[2]:
        result = rank["fsdp2"]
        assert result["outcome"] == "ok" and result["warnings"] == [], result
        counters = result["counters"]
        assert counters["steps"] == 6 and counters["plan"] == "ok"
        # The plan reads the FSDP2 model as sharded and the loop's saves as sharded.
        assert counters["reason"].startswith("Checkpoint memory fits: a sharded checkpoint save")
        assert "(1 consolidated copy" in counters["reason"]
        assert counters["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_hf_healthy_run_is_clean_and_logs_through_the_trainer(hf_scenarios):
    _, _, ranks = hf_scenarios
    for rank in ranks:
        result = rank["healthy"]
        assert result["outcome"] == "ok" and result["warnings"] == [], result
        counters = result["counters"]
        assert (counters["steps"], counters["eval_batches"], counters["saves"]) == (6, 4, 2)
        assert "rankguard/shared_dir_wait_s" in counters["rankguard_keys_logged"]
        assert "rankguard/replica_sets_differing" in counters["rankguard_keys_logged"]
