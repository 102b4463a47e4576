"""ReplicaCheck end to end: replicas that drift apart are caught at the next check.

Each integration's many-scenario launch (``tests/frameworks/launches.py``, run once a
session), 2 CPU ranks on gloo: Lightning with an optimizer step skipped on rank 1; a
hand-written loop whose accumulation and HSDP replicas stay equal, with an inverted
``no_sync`` and an unseeded initialization under HSDP; the HF Trainer with an EMA updated on
the main process only. The table in ``docs/replica.md`` quotes these runs.
"""

from __future__ import annotations

import pytest

from tests.frameworks.launches import lightning_error, lightning_outcomes

pytestmark = pytest.mark.framework


def test_lightning_an_optimizer_step_skipped_on_one_rank_is_caught_at_the_next_check(
    lightning_scenarios,
):
    # Manual optimization; rank 1 skips its second step. A check at every batch: the one at
    # batch 3's start sees it, collected at batch 4's start, on every rank.
    for message in lightning_error(
        lightning_scenarios, "replica_skipped_step", "ReplicaDivergenceError"
    ):
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
    assert [
        o["train_steps"] for o in lightning_outcomes(lightning_scenarios, "replica_skipped_step")
    ] == [3, 3]


def test_loop_accumulation_and_hsdp_replicas_stay_equal_and_silent(loop_scenarios):
    # 6 batches a rank; a replica check at batches 1, 2, 4, 6 (the job's REPLICA).
    for rank in loop_scenarios[2]:
        accumulation, hsdp = rank["replica_accumulation"], rank["replica_hsdp"]
        assert accumulation["outcome"] == "ok" and accumulation["warnings"] == [], accumulation
        assert accumulation["counters"] == {"train_batches": 6, "steps": 3}
        assert hsdp["outcome"] == "ok" and hsdp["warnings"] == [], hsdp
        assert hsdp["counters"] == {"train_batches": 6}


def replica_lines(result: dict) -> list[str]:
    assert result["outcome"] == "ReplicaDivergenceError", result
    return result["message"].split("\n")


def test_loop_inverted_no_sync_is_caught_at_the_first_check_after_the_first_step(loop_scenarios):
    # Checks at batches 1, 2, 4 (the first, then every 2nd). The first optimizer step (after
    # batch 2) takes rank-local gradients; the check at batch 4's start sees it, collected
    # at batch 5's start.
    for rank in loop_scenarios[2]:
        result = rank["replica_inverted_no_sync"]
        assert result["warnings"] == [] and result["counters"] == {"train_batches": 4, "steps": 2}
        lines = replica_lines(result)
        assert lines[0] == "Replicas differ: ranks 0,1 should hold the same parameters and do not."
        assert lines[1] == (
            "First seen at step 3, at the check every 2 train batches; the check at step 1 "
            "found them equal."
        )
        assert lines[3].startswith("2 of 3 tensors differ: `embed.weight` (32x8): rank 1 differs")
        assert lines[4].startswith(
            "Likely causes, most likely first: (1) gradients not averaged across ranks before "
            "a step: an inverted `no_sync()` condition"
        )


def test_loop_unseeded_init_under_hsdp_is_caught_before_the_first_step(loop_scenarios):
    # torch.seed() before the model: each rank its own weights, fully_shard copies none.
    for rank in loop_scenarios[2]:
        result = rank["replica_hsdp_unseeded"]
        assert result["counters"] == {"train_batches": 1}  # raised at batch 2's start
        lines = replica_lines(result)
        assert lines[1] == (
            "First seen at step 0, at the first train batch's start; no earlier check of this "
            "fit found them equal."
        )
        assert lines[3].startswith("3 of 3 tensors differ: `embed.weight` (32x8): rank 1 differs")
        assert lines[4].startswith(
            "Likely causes, most likely first: (1) an unseeded initialization: FSDP2's "
            "`fully_shard` and HSDP do not copy"
        )
        assert "(2)" not in lines[4]
        # The data check saw the same cause from its side: torch's seed differs.
        (warning,) = result["warnings"]
        assert warning.startswith(
            "rankguard data_consistency_guard: torch was not seeded the same on every rank"
        )


def test_hf_ema_updated_on_the_main_process_only_is_caught_at_the_next_step(hf_scenarios):
    # Rank 0 updates model.ema at the end of step 1; the check at step 2's start sees it,
    # collected at step 3's start (a check every step).
    for rank in hf_scenarios[2]:
        result = rank["replica_ema_rank0"]
        assert result["warnings"] == [] and result["counters"]["steps"] == 2, result
        lines = replica_lines(result)
        assert lines[1] == (
            "First seen at step 1, at the check every train batch; the check at step 0 found "
            "them equal."
        )
        assert lines[3].startswith("2 of 43 tensors differ: `ema.weight` (2x16): rank 1 differs")
        assert "`ema.bias` (2): rank 1 differs from rank 0 in 2 of 2 elements" in lines[3]
        assert lines[4].startswith(
            "Likely causes, most likely first: (1) an update outside the optimizer on some "
            "ranks only: an EMA"
        )
