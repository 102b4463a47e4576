"""The multi-process harness itself: a failed process-group set-up is retried once, then fails."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.mp import gloo_setup, run_ranks


def _setup_failing(marker_dir: Path, times: int, rank: int, world_size: int, init_file: str):
    """Rank 1's set-up fails ``times`` times (as gloo's did: "Connection closed by peer")."""
    if rank == 1:
        failures = len(list(marker_dir.iterdir()))
        if failures < times:
            (marker_dir / f"failed{failures}").touch()
            raise RuntimeError("[gloo] connectFullMesh failed: Connection closed by peer")
    gloo_setup(rank, world_size, init_file)


def _sum_of_ranks(rank: int, world_size: int) -> int:
    import torch

    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t.item())


def test_a_set_up_that_fails_once_is_retried_and_every_rank_runs(tmp_path):
    setup = functools.partial(_setup_failing, tmp_path, 1)
    outcomes = run_ranks(_sum_of_ranks, 2, timeout_s=60, setup=setup)
    assert [o.value for o in outcomes] == [1, 1], outcomes
    assert len(list(tmp_path.iterdir())) == 1  # it failed once, and the second try ran


def test_a_set_up_that_fails_twice_fails_the_test_with_its_own_error(tmp_path):
    setup = functools.partial(_setup_failing, tmp_path, 2)
    with pytest.raises(pytest.fail.Exception, match="set-up failed twice") as failed:
        run_ranks(_sum_of_ranks, 2, timeout_s=60, setup=setup)
    assert "connectFullMesh failed: Connection closed by peer" in str(failed.value)
