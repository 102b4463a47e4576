"""The replica check's decisions and words (pure): prints compared, tensors named, causes."""

from __future__ import annotations

import pytest

from rankguard.callbacks.replica.prints import ReplicaPrint, Sample
from rankguard.callbacks.replica.verdict import (
    INIT,
    INIT_OTHER,
    OUTSIDE_OPTIMIZER,
    SKIPPED_STEP,
    UNSYNCED,
    Details,
    Evidence,
    compare_prints,
    describe,
    difference_sizes,
    differing_tensors,
    likely_causes,
)

A, B = b"set-a...", b"set-b..."
SAME, OTHER, THIRD = bytes(8), bytes([1] * 8), bytes([2] * 8)


def prints(digests: dict[int, dict[bytes, bytes]], steps=None, step=10) -> dict[int, ReplicaPrint]:
    steps = steps or {}
    return {r: ReplicaPrint(step, steps.get(r, 10), d) for r, d in digests.items()}


def test_equal_prints_in_every_set_are_silent_and_counted():
    verdict = compare_prints(prints({r: {A: SAME, B: OTHER} for r in range(4)}))
    assert verdict.differ == () and verdict.compared == 2 and verdict.step == 10
    assert verdict.steps is None


def test_sets_are_compared_apart_hsdp_shards_hold_different_tensors():
    # ranks 0,2 hold shard 0 (set A), ranks 1,3 shard 1 (set B): different prints across
    # sets are expected; only rank 3's differs within its set.
    per_rank = prints({0: {A: SAME}, 2: {A: SAME}, 1: {B: OTHER}, 3: {B: THIRD}})
    verdict = compare_prints(per_rank)
    assert [s.key for s in verdict.differ] == [B]
    (only,) = verdict.differ
    assert only.ranks == "ranks 1,3" and only.optimizer_steps is None
    assert [(p.ranks, p.first) for p in only.prints] == [("rank 1", 1), ("rank 3", 3)]
    assert verdict.representatives() == {B: (1, 3)}


def test_the_most_ranks_print_comes_first_and_groups_past_four_are_counted():
    digests = {r: {A: SAME} for r in range(8)}
    for r in range(3, 8):
        digests[r] = {A: bytes([r] * 8)}
    (only,) = compare_prints(prints(digests)).differ
    assert only.prints[0].ranks == "ranks 0-2" and len(only.prints) == 4 and only.more == 2


def test_optimizer_steps_that_differ_make_a_difference_even_with_equal_prints():
    per_rank = prints({0: {A: SAME}, 1: {A: SAME}}, steps={0: 10, 1: 9})
    (only,) = compare_prints(per_rank).differ
    assert only.optimizer_steps == "rank 0: 10; rank 1: 9" and only.steps_known


def test_steps_counted_differently_are_named_per_rank():
    per_rank = {
        0: ReplicaPrint(10, 10, {A: SAME}),
        1: ReplicaPrint(9, 9, {A: OTHER}),
        2: ReplicaPrint(10, 10, {A: SAME}),
    }
    verdict = compare_prints(per_rank)
    assert verdict.step == 10 and verdict.steps == "ranks 0,2: 10; rank 1: 9"


def test_an_optimizer_without_a_step_count_leaves_the_skip_unknown():
    per_rank = prints({0: {A: SAME}, 1: {A: OTHER}}, steps={0: None, 1: None})
    per_rank = {r: p._replace(optimizer_steps=None) for r, p in per_rank.items()}
    (only,) = compare_prints(per_rank).differ
    assert only.optimizer_steps is None and not only.steps_known


def test_differing_tensors_are_found_from_the_representatives_sums():
    verdict = compare_prints(prints({0: {A: SAME}, 1: {A: OTHER}, 2: {A: SAME}}))
    sums = [5, 6, 7, 8, 9]
    per_rank = {
        0: {A: ("ddp", "DDP", sums)},
        1: {A: ("ddp", "DDP", [5, 0, 7, 0, 0])},
        2: None,  # not a representative: sends nothing
    }
    which = differing_tensors(per_rank, verdict)
    assert which == {A: ("ddp", "DDP", (1, 3, 4), 3, 5)}


def sample(name, values, sampled=False):
    return Sample(name, (len(values),), values, sampled)


def test_sizes_compare_each_print_with_the_most_ranks_one():
    verdict = compare_prints(prints({0: {A: SAME}, 1: {A: SAME}, 2: {A: OTHER}}))
    per_rank = {
        0: {A: [sample("head.weight", [1.0, -2.0, 3.0, 4.0])]},
        2: {A: [sample("head.weight", [1.0, -2.5, 3.0, 4.25])]},
    }
    assert difference_sizes(per_rank, verdict) == {
        A: [
            "`head.weight` (4): rank 2 differs from ranks 0,1 in 2 of 4 elements, by up to 0.5 "
            "(largest |value| 4)"
        ]
    }


def test_a_difference_outside_the_sampled_elements_says_so():
    verdict = compare_prints(prints({0: {A: SAME}, 1: {A: OTHER}}))
    per_rank = {
        0: {A: [sample("embed.weight", [0.5, float("nan")], sampled=True)]},
        1: {A: [sample("embed.weight", [0.5, float("nan")], sampled=True)]},
    }
    assert difference_sizes(per_rank, verdict) == {
        A: ["`embed.weight` (2): rank 1 and rank 0 agree in all 2 sampled elements"]
    }


CAUSES = [
    # (kind, steps_differ, before_training, never_equal, share) -> causes, most likely first
    ("mesh", False, True, True, 1.0, [INIT["mesh"]]),
    ("ddp", None, True, True, 0.5, [INIT["ddp"]]),
    ("world", False, True, True, 1.0, [INIT_OTHER]),
    ("ddp", True, False, False, 1.0, [SKIPPED_STEP]),
    ("mesh", True, False, True, 1.0, [SKIPPED_STEP, INIT["mesh"]]),
    ("ddp", False, False, False, 1.0, [UNSYNCED, OUTSIDE_OPTIMIZER]),
    ("ddp", None, False, False, 1.0, [UNSYNCED, SKIPPED_STEP, OUTSIDE_OPTIMIZER]),
    ("ddp", False, False, False, 0.25, [OUTSIDE_OPTIMIZER, UNSYNCED]),
    ("ddp", None, False, False, 0.25, [OUTSIDE_OPTIMIZER, UNSYNCED, SKIPPED_STEP]),
    ("ddp", False, False, False, None, [UNSYNCED, OUTSIDE_OPTIMIZER]),
    ("mesh", False, False, True, 1.0, [INIT["mesh"], UNSYNCED, OUTSIDE_OPTIMIZER]),
]


@pytest.mark.parametrize(("kind", "steps", "before", "never", "share", "expected"), CAUSES)
def test_likely_causes_follow_the_evidence(kind, steps, before, never, share, expected):
    evidence = Evidence(kind, steps, before_training=before, never_equal=never, share=share)
    assert likely_causes(evidence) == expected


def test_the_message_leads_with_one_sentence_then_the_details():
    verdict = compare_prints(prints({0: {A: SAME}, 1: {A: OTHER}}, steps={0: 10, 1: 9}))
    details = Details(
        which={
            A: differing_tensors(
                {0: {A: ("ddp", "DDP", [1, 2])}, 1: {A: ("ddp", "DDP", [1, 3])}}, verdict
            )[A]
        },
        sizes={
            A: [
                "`b` (2): rank 1 differs from rank 0 in 1 of 2 elements, by up to 1 "
                "(largest |value| 2)"
            ]
        },
    )
    message = describe(verdict, details, [SKIPPED_STEP], 8, "at the check every 2 train batches")
    lines = message.split("\n")
    assert lines[0] == "Replicas differ: ranks 0,1 should hold the same parameters and do not."
    assert lines[1] == (
        "First seen at step 10, at the check every 2 train batches; the check at step 8 found "
        "them equal."
    )
    assert lines[2] == f"Fingerprints: rank 0: {SAME.hex()[:8]}; rank 1: {OTHER.hex()[:8]}."
    assert lines[3] == "Optimizer steps taken: rank 0: 10; rank 1: 9."
    assert lines[4] == (
        "1 of 2 tensors differ: `b` (2): rank 1 differs from rank 0 in 1 of 2 elements, by up "
        "to 1 (largest |value| 2)."
    )
    assert lines[5] == f"Likely causes, most likely first: (1) {SKIPPED_STEP}"


def test_the_message_without_an_earlier_equal_check_or_details():
    verdict = compare_prints(prints({0: {A: SAME, B: SAME}, 1: {A: OTHER, B: OTHER}}))
    message = describe(verdict, Details(), [INIT_OTHER], None, "at an eval's start")
    lines = message.split("\n")
    assert lines[0] == (
        "Replicas differ: ranks 0,1 should hold the same parameters and do not (and 1 more "
        "replica groups)."
    )
    assert lines[1] == (
        "First seen at step 10, at an eval's start; no earlier check of this fit found them equal."
    )
    assert lines[2].startswith("ranks 0,1: rank 0: ")  # several sets: each named by its ranks
