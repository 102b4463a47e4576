"""The resume check in a hand-written loop: 2 gloo ranks, the loop's own ``guard.resumed``.

One run of 2 ranks (each a real DDP loop through ``rankguard.integrations.torch``)
plays a job and its restarts, each a fresh ``RankGuard`` as a restarted process has:

- a first fit saves at steps 4 and 8, each rank its own train-stream position and
  random state (``rank{N}.pt``), rank 0 the model and ``guard.state_dict()``;
- a healthy resume from step 8 (each rank its own files, the random state restored)
  logs no rankguard warning or error, and trains on;
- rank 1 resumes from step 4 (its node's copy lagged): ``ResumeMismatchError`` on
  both ranks, before the first batch;
- rank 1 finds no checkpoint: the same error, saying some ranks found none;
- every rank loads rank 0's stream position (a state written by one rank for all):
  ``ResumeMismatchError`` naming the train stream's position, before the first batch;
- every rank restores rank 0's random state: a warning, training goes on.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from tests.mp import run_ranks

STEPS = 8


class RankStream(torch.utils.data.IterableDataset):
    """A rank's own stream of batches (its shard), which keeps its offset."""

    def __init__(self, rank: int) -> None:
        self.shard, self.offset = rank, 0

    def __iter__(self):
        while True:
            self.offset += 1
            gen = torch.Generator().manual_seed(1000 * self.shard + self.offset)
            yield torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)

    def state_dict(self) -> dict:
        return {"shard": self.shard, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.shard, self.offset = state["shard"], state["offset"]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit(rank: int, folder: Path, resume: dict | None, steps: int) -> dict:
    """One fit of ``steps`` steps; returns what ran. ``resume``: what this rank loaded."""
    import numpy as np
    import torch.distributed as dist

    from rankguard.integrations.torch import RankGuard

    torch.manual_seed(0)  # the model alike on every rank
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    random.seed(rank)  # then every generator per rank (dropout differs per rank on purpose)
    np.random.seed(rank)
    torch.manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = RankStream(rank)
    loader = torch.utils.data.DataLoader(stream, batch_size=None)
    guard = RankGuard(hang_watchdog=False, straggler_monitor=False)
    if resume is not None:
        mine = torch.load(resume["path"], weights_only=False) if resume["path"] else {}
        if mine:
            stream.load_state_dict(torch.load(resume["data"], weights_only=False))
            torch.set_rng_state(torch.load(resume["rng"], weights_only=False))
        guard.resumed(
            resume["path"],
            step=mine.get("step", 0),
            state=mine.get("rankguard"),
            restores_rng=True,
            folder=folder,
        )
    ran = 0
    with guard.fit(model, optimizer, loader, save_dirs=[folder]) as run:
        for x, y in run.train(loader):
            ran += 1
            loss = torch.nn.functional.cross_entropy(model(torch.dropout(x, 0.1, True)), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if resume is None and run.step % 4 == 0:
                with run.checkpoint(folder):
                    step = folder / f"step{run.step}"
                    step.mkdir(exist_ok=True)
                    torch.save(stream.state_dict(), step / f"data{rank}.pt")
                    torch.save(torch.get_rng_state(), step / f"rng{rank}.pt")
                    if rank == 0:
                        state = {"step": run.step, "rankguard": guard.state_dict()}
                        torch.save(state, step / "trainer.pt")
                dist.barrier()
            if ran == steps:
                break
    guard.close()
    return {"ran": ran}


def _job(rank: int, world_size: int, folder: str) -> dict:
    """The job and its restarts; per scenario, what ran or the error (class, message)."""
    del world_size
    root = Path(folder)
    outcomes: dict[str, dict] = {}
    handler = Warnings()
    logging.getLogger("rankguard").addHandler(handler)

    def files(step: int, data_rank: int | None = None, rng_rank: int | None = None) -> dict:
        at = root / f"step{step}"
        return {
            "path": str(at / "trainer.pt"),
            "data": str(at / f"data{rank if data_rank is None else data_rank}.pt"),
            "rng": str(at / f"rng{rank if rng_rank is None else rng_rank}.pt"),
        }

    scenarios = {
        "first": None,
        "healthy": files(STEPS),
        "lagging": files(4 if rank == 1 else STEPS),
        "none_found": {"path": None} if rank == 1 else files(STEPS),
        "clobbered": files(STEPS, data_rank=0),
        "rng_clobbered": files(STEPS, rng_rank=0),
    }
    for name, resume in scenarios.items():
        handler.lines.clear()
        try:
            outcomes[name] = _fit(rank, root, resume, STEPS if resume is None else 2)
        except Exception as exc:
            outcomes[name] = {"error": type(exc).__name__, "message": str(exc)}
        outcomes[name]["warnings"] = list(handler.lines)
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("resume_loop")
    results = run_ranks(_job, 2, str(folder), timeout_s=120)
    for o in results:
        assert o.exitcode == 0 and o.error is None, o.error
    return [o.value for o in results]


def test_healthy_resume_is_silent(outcomes):
    for rank in outcomes:
        assert rank["first"] == {"ran": STEPS, "warnings": []}
        assert rank["healthy"] == {"ran": 2, "warnings": []}


def test_lagging_copy_is_named_before_the_first_batch(outcomes):
    for rank in outcomes:
        out = rank["lagging"]
        assert out["error"] == "ResumeMismatchError"
        lead, loaded = out["message"].splitlines()[:2]
        assert lead == "Ranks resumed from different checkpoints."
        assert loaded == (
            "Loaded (guard.resumed(...)): rank 0: step8/trainer.pt (step 8, epoch 0); "
            "rank 1: step4/trainer.pt (step 4, epoch 0)."
        )


def test_rank_without_checkpoint_is_named(outcomes):
    for rank in outcomes:
        out = rank["none_found"]
        assert out["error"] == "ResumeMismatchError"
        assert out["message"].startswith(
            "Some ranks found no checkpoint to resume from while others did."
        )
        assert "rank 1: no checkpoint (starts fresh)" in out["message"]


def test_one_position_for_all_is_named(outcomes):
    for rank in outcomes:
        out = rank["clobbered"]
        assert out["error"] == "ResumeMismatchError"
        assert out["message"].startswith("Ranks did not resume their data where each left off.")
        assert "train dataset is at the same position on every rank" in out["message"]
        assert "rank 0's saved position, restored on every rank" in out["message"]


def test_one_random_state_for_all_is_a_warning(outcomes):
    for rank in outcomes:
        out = rank["rng_clobbered"]
        assert out["ran"] == 2
        assert [w for w in out["warnings"] if "torch random state" in w] == [
            next(w for w in out["warnings"] if "torch random state" in w)
        ]
        warning = next(w for w in out["warnings"] if "torch random state" in w)
        assert "different on every rank when the checkpoint was saved" in warning
        assert "the same on every rank after the resume" in warning
