"""Batch parity and drop_last end to end: ranks that would run different numbers of batches.

Every integration's many-scenario launch (``tests/frameworks/launches.py``, run once a
session): Composer (``composer -n 2``), Lightning (``ddp``), a hand-written loop and the HF
Trainer (``torchrun``), 2 CPU ranks on gloo. Uneven eval or train batches, ``drop_last``
differing between ranks, a sampler whose ``__len__`` lies, streams that run out on one rank
first: each stops every rank at the earliest point it can be known, naming the ranks and the
counts.

Without rankguard, uneven val batch counts on gloo do not stop a Lightning run: with
``self.log(..., sync_dist=True)`` (one sync at val epoch end) both ranks finish, rank 1
having silently run twice the val batches of rank 0. (With per-step collectives in
validation the extra ones pair with the wrong partner: gloo aborts on a size mismatch, or
hangs when training goes on after eval.)
"""

from __future__ import annotations

import pytest

from tests.frameworks.launches import (
    composer_both,
    lightning_error,
    lightning_error_types,
    lightning_outcomes,
)

pytestmark = pytest.mark.framework

# -- Composer ------------------------------------------------------------------------------


def test_composer_uneven_eval_batches_fail_at_fit_start_before_any_batch(composer_scenarios):
    for result in composer_both(composer_scenarios, "uneven_eval"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert "loader 'eval': rank 0: 2 batches; rank 1: 4 batches" in result["message"]
        assert "Fix:" in result["message"]
        assert result["counters"] == {}  # no train or eval batch ran on any rank


def test_composer_with_every_guard_the_root_cause_is_named_first(composer_scenarios):
    for result in composer_both(composer_scenarios, "uneven_eval_all_guards"):
        assert result["outcome"] == "DataInconsistencyError"
        assert (
            "loader 'eval': length differs (rank 0: 16 items; rank 1: 32 items)"
            in (result["message"])
        )
        assert result["counters"] == {}


def test_composer_uneven_train_batches_fail_at_fit_start(composer_scenarios):
    for result in composer_both(composer_scenarios, "uneven_train"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert "loader 'train': rank 0: 2 batches; rank 1: 3 batches" in result["message"]
        assert result["counters"] == {}


def test_composer_drop_last_differing_between_ranks_fails_at_fit_start(composer_scenarios):
    for result in composer_both(composer_scenarios, "drop_last_mismatch"):
        assert result["outcome"] == "DropLastMismatchError"
        assert "loader 'train': drop_last: rank 0: True, rank 1: False" in result["message"]
        assert result["counters"] == {}


def test_composer_enforced_drop_last_gives_every_rank_the_same_full_batches(composer_scenarios):
    for result in composer_both(composer_scenarios, "drop_last_enforce"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"]["train_batches"] == 8


def test_composer_sampler_whose_len_lies_is_caught_after_eval(composer_scenarios):
    # Composer stops both ranks when rank 0 runs out: rank 1's data is silently skipped.
    for result in composer_both(composer_scenarios, "lying_len"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert "ranks 0,1: ran 2 of 4 batches its __len__ promised" in result["message"]
        assert result["counters"]["eval_batches"] == 2


def test_composer_sampler_yielding_past_its_len_on_one_rank_fails_at_fit_start(composer_scenarios):
    # Without rankguard: both ranks run the 4 batches __len__ says; rank 1's other 4 are
    # silently skipped.
    for result in composer_both(composer_scenarios, "data_left_counted"):
        assert result["outcome"] == "BatchCountMismatchError"
        message = result["message"]
        assert message.startswith(
            "Loaders yield a different number of batches than planned from their __len__ "
            "(at fit start): loader 'eval': rank 1: __len__ 4 batches, yields 8 (4 never run)."
        )
        assert "Fix: make the sampler's (or batch sampler's) __len__ return" in message
        assert result["counters"] == {}  # before any batch


def test_composer_eval_stream_running_out_on_one_rank_names_the_rank_that_had_data_left(
    composer_scenarios,
):
    # Composer stops both ranks when rank 0's stream runs out after 3 of the 4 batches
    # both promise: rank 1's 4th is silently skipped.
    for result in composer_both(composer_scenarios, "data_left_eval_stream"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert result["message"].startswith(
            "Eval loader 'eval' left data behind: rank 0: ran out after 3 batches; still had "
            "data: rank 1: ran 3 batches, at least 1 more left; those batches never ran. "
            "Batches run: ranks 0,1: ran 3 of 4 batches its __len__ promised. Fix: "
        )
        assert result["counters"] == {"train_batches": 8, "eval_batches": 3}


def test_composer_train_stream_running_out_on_one_rank_names_the_rank_that_had_data_left(
    composer_scenarios,
):
    for result in composer_both(composer_scenarios, "data_left_train_stream"):
        assert result["outcome"] == "BatchCountMismatchError"
        assert result["message"].startswith(
            "Train loader 'train' in epoch 0 left data behind: rank 0: ran out after 3 "
            "batches; still had data: rank 1: ran 3 batches, at least 1 more left"
        )
        assert "split iterable or streaming data evenly across ranks" in result["message"]
        assert result["counters"] == {"train_batches": 3}  # at the end of the epoch


def test_composer_streams_that_hold_what_they_say_pass_silently(composer_scenarios):
    for result in composer_both(composer_scenarios, "stream_healthy"):
        assert result["outcome"] == "ok", result.get("traceback")
        assert result["warnings"] == []
        assert result["counters"] == {"train_batches": 4, "eval_batches": 3}


# -- Lightning -----------------------------------------------------------------------------


def test_lightning_without_rankguard_uneven_val_batches_pass_silently_on_gloo(lightning_scenarios):
    outcomes = lightning_outcomes(lightning_scenarios, "uneven_val_no_guard")
    assert [o["outcome"] for o in outcomes] == ["ok", "ok"]
    assert [o["val_steps"] for o in outcomes] == [2, 4]
    assert outcomes[0]["metrics"] == outcomes[1]["metrics"]  # synced, nothing flagged


@pytest.mark.parametrize("scenario", ["uneven_val", "uneven_val_after_sanity"])
def test_lightning_uneven_val_batches_fail_before_the_first_val_batch(
    lightning_scenarios, scenario
):
    for message in lightning_error(lightning_scenarios, scenario, "BatchCountMismatchError"):
        assert "loader 'val': rank 0: 2 batches; rank 1: 4 batches" in message
        assert "at fit start" in message  # Lightning loads val loaders before training
        assert "Fix:" in message
    for o in lightning_outcomes(lightning_scenarios, scenario):
        assert o["val_steps"] == 0
        assert o["train_steps"] == 0
    # Only the sanity check ran val batches: 2 on every rank (its planned count).
    assert [
        o["sanity_val_steps"]
        for o in lightning_outcomes(lightning_scenarios, "uneven_val_after_sanity")
    ] == [2, 2]


def test_lightning_uneven_val_batches_unknown_at_fit_start_fail_at_val_start(lightning_scenarios):
    scenario = "uneven_val_first_due_in_epoch_2"
    for message in lightning_error(lightning_scenarios, scenario, "BatchCountMismatchError"):
        assert "before the first eval batch" in message
        assert "loader 'val': rank 0: 2 batches; rank 1: 4 batches" in message
    for o in lightning_outcomes(lightning_scenarios, scenario):
        assert o["val_steps"] == 0
        assert o["train_steps"] == 8  # two epochs of 4 batches, then the first val


def test_lightning_uneven_val_batches_with_warn_finish_training_and_name_the_ranks(
    lightning_scenarios,
):
    outcomes = lightning_outcomes(lightning_scenarios, "uneven_val_warn")
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


def test_lightning_lying_len_is_caught_after_eval_with_the_counts_that_ran(lightning_scenarios):
    for message in lightning_error(lightning_scenarios, "lying_len", "BatchCountMismatchError"):
        assert "Eval loader 'val' did not run the same, promised number of batches" in message
        assert "rank 0: ran 2 of 4 batches its __len__ promised; rank 1: ran 4 batches" in message
    # Both ranks planned 4 (the same __len__), so nothing fired before eval.
    assert [o["val_steps"] for o in lightning_outcomes(lightning_scenarios, "lying_len")] == [2, 4]


def test_lightning_rank_still_in_eval_is_named_after_eval_end_timeout(lightning_scenarios):
    messages = lightning_error_types(
        lightning_scenarios, "lying_len_slow_rank", "BatchCountMismatchError"
    )
    for rank, message in enumerate(messages):
        assert "rank 1 did not finish eval loader 'val' within 0.5 s" in message
        ran = ["ran 2 of 4 batches its __len__ promised", "ran 4 batches"][rank]
        assert f"this rank {ran}" in message
    outcomes = lightning_outcomes(lightning_scenarios, "lying_len_slow_rank")
    assert outcomes[0]["elapsed_s"] < outcomes[1]["elapsed_s"]  # rank 0 did not wait for 1


def test_lightning_batches_past_len_that_lightning_would_skip_fail_before_the_first_val_batch(
    lightning_scenarios,
):
    # Without rankguard: both ranks run the 2 batches __len__ says, and rank 1's other 2
    # never run, silently.
    for message in lightning_error(
        lightning_scenarios, "lying_len_capped_by_lightning", "BatchCountMismatchError"
    ):
        assert message.startswith(
            "Loaders yield a different number of batches than planned from their __len__ "
            "(at fit start): loader 'val': rank 1: __len__ 2 batches, yields 4 (2 never run)."
        )
    for o in lightning_outcomes(lightning_scenarios, "lying_len_capped_by_lightning"):
        assert (o["train_steps"], o["val_steps"]) == (0, 0)


def test_lightning_uneven_train_batches_fail_before_the_first_training_step(lightning_scenarios):
    for message in lightning_error(lightning_scenarios, "uneven_train", "BatchCountMismatchError"):
        assert "at fit start" in message
        assert "loader 'train': rank 0: 4 batches; rank 1: 6 batches" in message
    for o in lightning_outcomes(lightning_scenarios, "uneven_train"):
        assert o["train_steps"] == 0
        assert o["val_steps"] == 0


@pytest.mark.parametrize("scenario", ["drop_last_differs", "drop_last_differs_rankguard"])
def test_lightning_drop_last_differing_between_ranks_fails_at_fit_start(
    lightning_scenarios, scenario
):
    # With RankGuard too: DropLastGuard runs first, its error is the better explanation.
    for message in lightning_error(lightning_scenarios, scenario, "DropLastMismatchError"):
        assert "loader 'train': drop_last: rank 0: True, rank 1: False" in message
        assert "Fix:" in message
    for o in lightning_outcomes(lightning_scenarios, scenario):
        assert o["train_steps"] == 0


def test_lightning_two_val_loaders_are_named_val_0_and_val_1(lightning_scenarios):
    for message in lightning_error(
        lightning_scenarios, "two_val_loaders_uneven", "BatchCountMismatchError"
    ):
        assert "loader 'val/0': rank 0: 2 batches; rank 1: 3 batches" in message
        assert "loader 'val/1': rank 0: 2 batches; rank 1: 4 batches" in message


def test_lightning_eval_padding_by_lightnings_distributed_sampler_is_a_warning(lightning_scenarios):
    outcomes = lightning_outcomes(lightning_scenarios, "eval_padding_distributed_sampler")
    for o in outcomes:
        assert o["outcome"] == "ok", o
        assert len(o["warnings"]) == 1, o["warnings"]
        [warning] = o["warnings"]
        assert "eval loader 'val': the DistributedSampler repeats 1 sample(s)" in warning
        assert "15 samples" in warning


# -- The loop and the HF Trainer (torchrun) ------------------------------------------------


FIX_LEFT = "Fix: give every rank the same number of batches: split iterable or streaming data"


def test_loop_rank_whose_eval_stream_ran_out_first_is_named_with_what_the_other_left(
    loop_scenarios,
):
    for rank in loop_scenarios[2]:
        result = rank["short_eval_stream"]
        assert result["outcome"] == "BatchCountMismatchError", result
        assert result["message"].startswith(
            "Eval loader 'eval' left data behind: rank 0: ran out after 3 batches; still had "
            "data: rank 1: ran 4 batches, more left; those batches never ran. Batches run: "
            "rank 0: ran 3 of 4 batches its __len__ promised; rank 1: ran 4 batches. " + FIX_LEFT
        )
    assert [r["short_eval_stream"]["counters"]["eval_batches"] for r in loop_scenarios[2]] == [3, 4]


def test_loop_train_epoch_with_data_left_on_a_rank_is_named_at_the_epoch_end(loop_scenarios):
    # DDP's join let rank 0 finish its epoch early: without rankguard, nothing is said.
    for rank in loop_scenarios[2]:
        result = rank["short_train_stream"]
        assert result["outcome"] == "BatchCountMismatchError", result
        assert result["message"].startswith(
            "Train loader 'train' in epoch 0 left data behind: rank 0: ran out after 3 "
            "batches; still had data: rank 1: ran 4 batches, more left; those batches never "
            "ran. Batches run: rank 0: 3 batches; rank 1: 4 batches. " + FIX_LEFT
        )
        assert result["counters"]["evals"] == 1  # checked at the fit's end, after the eval
    assert [r["short_train_stream"]["counters"]["train_batches"] for r in loop_scenarios[2]] == [
        3,
        4,
    ]


def test_loop_uneven_eval_batches_fail_before_the_first_eval_batch(loop_scenarios):
    for rank in loop_scenarios[2]:
        result = rank["uneven_eval"]
        assert result["outcome"] == "BatchCountMismatchError", result
        assert result["message"].startswith(
            "Ranks would run different numbers of batches (before the first eval batch): "
            "loader 'eval': rank 0: 2 batches; rank 1: 4 batches. Fix: "
        )
        # The loop named its eval loader only at eval (step 4): no eval batch ran.
        assert result["counters"] == {"train_batches": 4}


def test_hf_uneven_eval_batches_fail_at_fit_start_from_the_trainers_own_eval_loader(hf_scenarios):
    for rank in hf_scenarios[2]:
        result = rank["uneven_eval"]
        assert result["outcome"] == "BatchCountMismatchError", result
        assert result["message"].startswith(
            "Ranks would run different numbers of batches (at fit start): "
            "loader 'eval': rank 0: 2 batches; rank 1: 4 batches. Fix: "
        )
        assert result["counters"] == {}  # no step, no eval batch
