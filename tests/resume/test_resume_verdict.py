"""The resume check's decision (pure) and what it reads from a rank (digests, positions)."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from rankguard.callbacks.resume.position import (
    checkpoint_identity,
    digest,
    loader_positions,
    rng_digests,
    sibling_checkpoints,
)
from rankguard.callbacks.resume.verdict import RankResume, judge, partition

HF = "resume_from_checkpoint=True"


def rank(node: str, step: int | None, **kw) -> RankResume:
    """A rank of an HF-style job whose node keeps ``out/checkpoint-4`` and maybe ``-8``."""
    checkpoint = None if step is None else f"/{node}/out/checkpoint-{step}"
    counters = {} if step is None else {"global_step": step}
    return RankResume(node, HF, checkpoint, folder=f"/{node}/out", counters=counters, **kw)


def test_same_checkpoint_everywhere_is_silent():
    seen = ("checkpoint-4", "checkpoint-8")
    verdict = judge({0: rank("n0", 8, seen=seen), 1: rank("n1", 8, seen=seen)})
    assert verdict.error is None and verdict.warnings == ()


def test_a_lagging_node_is_named_with_what_it_sees():
    error = judge(
        {
            0: rank("n0", 8, seen=("checkpoint-4", "checkpoint-8")),
            1: rank("n0", 8, seen=("checkpoint-4", "checkpoint-8")),
            2: rank("n1", 4, seen=("checkpoint-4",)),
        }
    ).error
    assert error is not None
    lines = error.splitlines()
    assert lines[0] == "Ranks resumed from different checkpoints."
    assert lines[1] == (
        f"Loaded ({HF}): ranks 0,1: checkpoint-8 (global_step 8); "
        "rank 2: checkpoint-4 (global_step 4)."
    )
    assert "  node n0 (ranks 0,1) sees in /n0/out: checkpoint-8 that not every node has" in lines
    assert "  node n1 (rank 2) sees in /n1/out: not checkpoint-8" in lines
    assert lines[-1].startswith("Fix: resume every rank from the same checkpoint")


def test_a_rank_that_found_none():
    error = judge({0: rank("n0", 8), 1: rank("n1", None)}).error
    assert error is not None
    assert error.startswith("Some ranks found no checkpoint to resume from while others did.")
    assert "rank 1: no checkpoint (starts fresh)" in error


def test_no_rank_found_one_is_a_fresh_start():
    assert judge({0: rank("n0", None), 1: rank("n1", None)}).error is None


def test_copies_that_differ_in_size():
    a = rank("n0", 8, identity="trainer_state.json: 900 bytes")
    b = rank("n1", 8, identity="trainer_state.json: 700 bytes")
    error = judge({0: a, 1: b}).error
    assert error is not None and error.startswith(
        "Ranks resumed from different copies of checkpoint-8."
    )
    assert (
        f"Loaded ({HF}): rank 0: checkpoint-8 (trainer_state.json: 900 bytes); "
        "rank 1: checkpoint-8 (trainer_state.json: 700 bytes)."
    ) in error
    # The same counters: nothing says the steps differ, only the copies.
    assert "would update different weights (the copies differ), silently" in error


def test_copies_that_differ_name_every_difference_read_the_steps_first():
    # Lightning's node-local last.ckpt: rank 0's from the save at step 8, rank 1's at step 4.
    a = replace(rank("n0", 8), checkpoint="/n0/out/last.ckpt", identity="13977 bytes")
    b = replace(rank("n1", 4), checkpoint="/n1/out/last.ckpt", identity="13849 bytes")
    a = replace(a, counters={"epoch": 1, "global_step": 8})
    b = replace(b, counters={"epoch": 0, "global_step": 4})
    error = judge({0: a, 1: b}).error
    assert error is not None
    assert error.splitlines()[:2] == [
        "Ranks resumed from different copies of last.ckpt.",
        f"Loaded ({HF}): rank 0: last.ckpt (global_step 8, epoch 1; 13977 bytes); "
        "rank 1: last.ckpt (global_step 4, epoch 0; 13849 bytes).",
    ]
    assert "would update different weights from different steps, silently" in error


def test_counters_that_differ_after_the_same_checkpoint():
    a = rank("n0", 8)
    b = replace(rank("n1", 8), counters={"global_step": 8, "epoch": 1})
    a = replace(a, counters={"global_step": 8, "epoch": 0})
    error = judge({0: a, 1: b}).error
    assert error is not None
    assert error.splitlines()[0] == (
        "Ranks resumed from checkpoint-8 at different points: epoch: rank 0: 0, rank 1: 1."
    )


def _positions(saved: list[str], now: list[str]) -> dict[int, RankResume]:
    return {
        r: rank(
            f"n{r}",
            8,
            positions={"train loader": d},
            position_text={"train loader": f"state {d}"},
            saved={"data/train loader": saved},
        )
        for r, d in enumerate(now)
    }


def test_one_rank_position_restored_everywhere():
    error = judge(_positions(["a", "b", "c"], ["b", "b", "b"])).error
    assert error is not None
    assert "train loader is at the same position on every rank (state b)" in error
    assert "different on every rank when the checkpoint was saved" in error
    assert "rank 1's saved position, restored on every rank" in error


def test_positions_that_matched_and_now_differ():
    error = judge(_positions(["a", "a"], ["a", "b"])).error
    assert error is not None
    assert "train loader was the same on every rank when the checkpoint was saved" in error
    assert "rank 0: state a; rank 1: state b" in error


def test_positions_keep_their_pattern():
    assert judge(_positions(["a", "b"], ["c", "d"])).error is None  # per rank, moved on
    assert judge(_positions(["a", "a"], ["c", "c"])).error is None  # alike, moved on


def test_positions_saved_in_another_world_size_are_not_judged():
    assert judge(_positions(["a", "b", "c"], ["d", "d"])).error is None


def _rng(restores: bool, saved: list[str], start: list[str], now: list[str]):
    return {
        r: rank(
            f"n{r}",
            8,
            rng={"torch": now[r]},
            rng_start={"torch": start[r]},
            saved={"rng/torch": saved},
            restores_rng=restores,
        )
        for r in range(len(now))
    }


def test_random_state_patterns():
    # restored by the framework: judged against the save
    (warning,) = judge(_rng(True, ["a", "b"], ["x", "x"], ["a", "a"])).warnings
    assert warning.startswith(
        "The torch random state was different on every rank when the checkpoint was saved "
        "and is the same on every rank after the resume"
    )
    assert judge(_rng(True, ["a", "b"], ["x", "x"], ["c", "d"])).warnings == ()
    # not restored: judged against this run's start (seeded per rank, then drawn alike)
    assert judge(_rng(False, ["a", "a"], ["x", "y"], ["c", "d"])).warnings == ()
    (warning,) = judge(_rng(False, ["a", "b"], ["x", "y"], ["c", "c"])).warnings
    assert "at this run's start" in warning


def test_partition_groups_ranks_by_value():
    assert partition({0: "a", 1: "b", 2: "a"}) == [[0, 2], [1]]


def test_digests_follow_values():
    state = {"offset": 3, "ids": torch.arange(4), "nested": [1, {"b": 2}]}
    assert digest(state) == digest({"nested": [1, {"b": 2}], "ids": torch.arange(4), "offset": 3})
    assert digest(state) != digest({**state, "ids": torch.arange(1, 5)})


def test_rng_digests_change_with_a_draw():
    before = rng_digests()
    torch.rand(1)
    random.random()
    after = rng_digests()
    assert before["torch"] != after["torch"]
    assert before["python random"] != after["python random"]
    assert before["numpy"] == after["numpy"]


class _Stream:
    def state_dict(self):
        return {"offset": 5}


class _Streaming:
    def state_dict(self, num_samples, from_beginning):  # needs arguments: not read
        raise AssertionError("called")


def test_loader_positions():
    data = list(range(8))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0)
    sampler.set_epoch(3)
    loader = torch.utils.data.DataLoader(data, sampler=sampler)
    assert loader_positions(loader) == {"sampler epoch": 3}
    stream = torch.utils.data.DataLoader(_Stream(), batch_size=None)
    assert loader_positions(stream) == {"dataset": {"offset": 5}}
    assert loader_positions(torch.utils.data.DataLoader(_Streaming(), batch_size=None)) == {}


def test_checkpoint_identity_and_siblings(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text("{}")
    (tmp_path / "last.ckpt").write_bytes(b"12345")
    assert checkpoint_identity(str(tmp_path / "checkpoint-8")) == "trainer_state.json: 2 bytes"
    assert checkpoint_identity(str(tmp_path / "checkpoint-4")) is None
    assert checkpoint_identity(str(tmp_path / "last.ckpt")) == "5 bytes"
    assert sibling_checkpoints(str(tmp_path), str(tmp_path / "checkpoint-8")) == (
        "checkpoint-4",
        "checkpoint-8",
    )
    assert sibling_checkpoints(str(tmp_path), str(tmp_path / "last.ckpt")) == ("last.ckpt",)
    assert sibling_checkpoints(str(tmp_path / "gone"), None) == ()


def test_copies_of_one_name_from_different_saves():
    # Lightning's last.ckpt on each node: the same size, node 1's from the save at step 4.
    a = replace(rank("n0", 8, seen=("epoch=0-step=8.ckpt", "last.ckpt")), counters={"step": 8})
    b = replace(rank("n1", 4, seen=("last.ckpt",)), counters={"step": 4})
    a = replace(a, checkpoint="/n0/out/last.ckpt", identity="44656 bytes")
    b = replace(b, checkpoint="/n1/out/last.ckpt", identity="44656 bytes")
    error = judge({0: a, 1: b}).error
    assert error is not None
    assert error.splitlines()[:2] == [
        "Ranks resumed from different copies of last.ckpt.",
        f"Loaded ({HF}): rank 0: last.ckpt (step 8); rank 1: last.ckpt (step 4).",
    ]
    assert "  node n1 (rank 1) sees in /n1/out: not epoch=0-step=8.ckpt" in error
    # The same folders everywhere: a restore that set other counters, not another copy.
    same = replace(b, seen=a.seen)
    error = judge({0: a, 1: same}).error
    assert error is not None and error.startswith(
        "Ranks resumed from last.ckpt at different points: step: rank 0: 8, rank 1: 4."
    )


def test_a_loader_one_rank_reads_for_all_is_not_recorded_at_saves():
    from rankguard.callbacks import EventFacts, LoaderFacts, ResumeGuard
    from rankguard.callbacks.core.events import Event

    class Stream:
        def state_dict(self):
            return {"offset": 3}

    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    for each, recorded in ((True, loader), (False, None)):
        guard = ResumeGuard()
        facts = EventFacts(loaders=[LoaderFacts("train", loader, True, read_by_each_rank=each)])
        guard.handle(Event.FIT_START, facts)
        assert guard._train_loader is recorded
