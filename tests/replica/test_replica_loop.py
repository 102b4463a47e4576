"""ReplicaGuard in a hand-written DDP loop: 2 gloo ranks through ``rankguard.integrations.torch``.

Each test runs one fit per rank (Adam, whose step count goes with each print):

- a healthy fit with gradient accumulation (``no_sync`` on every micro-batch but the
  last), evals and saves: silent, every check equal;
- ``optimizer.step()`` skipped on rank 1 at one step: caught at the first check after,
  naming the step counts (checks at the first batch and every ``interval``-th);
- a clamp on rank 0 only, between two interval checks, right before an eval: caught by
  the eval's check;
- the same with ``on_violation="warn"``: one warning, training goes on, no more checks.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from tests.mp import run_ranks

STEPS = 12
ACCUMULATION = 2


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit(rank, world_size, fault: str, settings: dict, tmp: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from rankguard.integrations.torch import ReplicaGuard

    warnings = Warnings()
    logging.getLogger("rankguard").addHandler(warnings)
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)  # each rank its own batches
    data = [
        (torch.randn(4, 4, generator=gen), torch.randint(0, 2, (4,), generator=gen))
        for _ in range(2 * STEPS)
    ]
    guard = ReplicaGuard(**settings)
    outcome: dict = {"steps": []}
    try:
        with guard.fit(model, optimizer, data, save_dirs=tmp) as run:
            for i, (x, y) in enumerate(run.train(data)):
                last = (i + 1) % ACCUMULATION == 0
                with contextlib.nullcontext() if last else model.no_sync():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                if not last:
                    continue
                if not (fault == "skip" and rank == 1 and i == 3):
                    optimizer.step()
                optimizer.zero_grad()
                outcome["steps"].append(i)
                if fault in ("clamp", "clamp_warn") and rank == 0 and i == 7:
                    with torch.no_grad():
                        model.module[1].bias.clamp_(-0.001, 0.001)
                if i in (7, 15):
                    for _ in run.eval([torch.zeros(1)]):
                        pass
                    with run.checkpoint():
                        pass
            outcome["metrics"] = dict(run.metrics)
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcome["batches"] = i + 1  # batches whose body ran
    outcome["warnings"] = warnings.lines
    return outcome


def run(fault: str, tmp_path, **settings) -> list[dict]:
    outcomes = run_ranks(_fit, 2, fault, settings, str(tmp_path), timeout_s=120)
    for o in outcomes:
        assert o.error is None, o.error
    return [o.value for o in outcomes]


@pytest.mark.slow
def test_healthy_accumulation_with_evals_and_saves_stays_silent(tmp_path):
    for rank in run("none", tmp_path, interval=3):
        assert "error" not in rank and rank["warnings"] == [], rank
        assert rank["batches"] == 2 * STEPS
        assert rank["metrics"]["rankguard/replica_sets_differing"] == 0.0


@pytest.mark.slow
def test_a_step_skipped_on_one_rank_is_caught_at_the_first_check_after(tmp_path):
    # Checks at batches 1, 3, 6 (the first, then every 3rd): rank 1 skips the step of
    # batch 4 (i == 3); the check at the start of batch 6 sees it, collected (and raised)
    # at batch 7's start.
    for rank in run("skip", tmp_path, interval=3):
        assert rank["batches"] == 6, rank
        lines = rank["error"].split("\n")
        assert lines[0] == (
            "ReplicaDivergenceError: Replicas differ: ranks 0,1 should hold the same parameters "
            "and do not."
        )
        # The loop's step at batch 6's start is 5 (batches ended); at batch 3's, 2.
        assert lines[1] == (
            "First seen at step 5, at the check every 3 train batches; the check at step 2 "
            "found them equal."
        )
        assert lines[3] == "Optimizer steps taken: rank 0: 2; rank 1: 1."
        assert lines[4].startswith(
            "4 of 4 tensors differ: `0.weight` (8x4): rank 1 differs from rank 0 in 32 of 32 "
        )
        assert lines[5].startswith(
            "Likely causes, most likely first: (1) a skipped `optimizer.step()`"
        )
        assert "(2)" not in lines[5]


@pytest.mark.slow
def test_a_clamp_on_rank_0_before_an_eval_is_caught_by_the_evals_check(tmp_path):
    # One interval check at batch 1 (interval 100); the clamp after batch 8's step; the
    # eval's check right after it, collected (and raised) at batch 9's start.
    for rank in run("clamp", tmp_path, interval=100):
        assert rank["batches"] == 8, rank
        lines = rank["error"].split("\n")
        assert lines[1] == (
            "First seen at step 8, at an eval's start; the check at step 0 found them equal."
        )
        assert lines[2].startswith("Fingerprints: rank 0: ")
        assert lines[3].startswith(
            "1 of 4 tensors differ: `1.bias` (2): rank 1 differs from rank 0 in 2 of 2"
        )
        assert lines[4].startswith(
            "Likely causes, most likely first: (1) an update outside the optimizer"
        )


@pytest.mark.slow
def test_warn_mode_warns_once_and_training_goes_on(tmp_path):
    for rank in run("clamp_warn", tmp_path, interval=100, on_violation="warn"):
        assert "error" not in rank and rank["batches"] == 2 * STEPS, rank
        (warning,) = rank["warnings"]
        assert warning.startswith("rankguard replica_guard: Replicas differ: ranks 0,1")
        assert rank["metrics"]["rankguard/replica_sets_differing"] == 1.0
