"""The multi-process harness itself: a failed process-group set-up is tried again, then fails."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.mp import SETUP_TRIES, gloo_setup, run_ranks


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


@pytest.mark.slow
def test_a_set_up_that_fails_once_is_retried_and_every_rank_runs(tmp_path):
    setup = functools.partial(_setup_failing, tmp_path, 1)
    outcomes = run_ranks(_sum_of_ranks, 2, timeout_s=60, setup=setup)
    assert [o.value for o in outcomes] == [1, 1], outcomes
    assert len(list(tmp_path.iterdir())) == 1  # it failed once, and the second try ran


@pytest.mark.slow
def test_a_set_up_that_fails_every_time_fails_the_test_with_every_ranks_own_error(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("tests.mp.SETUP_PAUSES_S", (0.0,) * SETUP_TRIES)
    monkeypatch.setattr("tests.mp.SETUP_REPORT_S", 1.0)
    setup = functools.partial(_setup_failing, tmp_path, SETUP_TRIES)
    with pytest.raises(pytest.fail.Exception, match=f"failed in all {SETUP_TRIES} tries") as failed:
        run_ranks(_sum_of_ranks, 2, timeout_s=60, setup=setup)
    message = str(failed.value)
    assert len(list(tmp_path.iterdir())) == SETUP_TRIES
    # Rank 1's own error, and what became of rank 0 (its partner, which cannot pair up alone).
    assert message.count("rank 1: RuntimeError: [gloo] connectFullMesh failed") == SETUP_TRIES
    assert message.count("rank 0: no report; still running 1 s later, killed") == SETUP_TRIES


def _one_fails_and_its_partner_dies(rank: int, world_size: int, init_file: str) -> None:
    """Rank 0's set-up raises; rank 1's process ends (exit code 3) without a word."""
    if rank == 1:
        os._exit(3)
    raise RuntimeError("[gloo] connectFullMesh failed: Connection closed by peer")


def test_a_rank_that_ends_without_a_report_is_named_with_its_exit_code(monkeypatch):
    monkeypatch.setattr("tests.mp.SETUP_PAUSES_S", (0.0,))
    with pytest.raises(pytest.fail.Exception) as failed:
        run_ranks(_sum_of_ranks, 2, timeout_s=30, setup=_one_fails_and_its_partner_dies)
    message = str(failed.value)
    assert "rank 0: RuntimeError: [gloo] connectFullMesh failed" in message
    assert "rank 1: no report; the process ended with exit code 3" in message
