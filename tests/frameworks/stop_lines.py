"""What every rank of a preempted job logs: the assertions both two-rank stop tests share."""

from __future__ import annotations

import re

from rankguard.callbacks.hang.stop import STOP_EXIT_CODE


def rankguard_lines(output: str, rank: int, level: str) -> list[str]:
    """Rank ``rank``'s rankguard lines at ``level`` in a job's merged output (the messages)."""
    return re.findall(rf"\[rank {rank}\] {level} rankguard\.\S+: (.*)", output)


def assert_every_rank_preempted(output: str, step: int) -> None:
    """Each of ranks 0 and 1 ended through the exit path with 75 after train step ``step``.

    Each logged one WARNING, the preemption's (SIGTERM on rank 1), and no rankguard ERROR.
    """
    for rank in (0, 1):
        ended = rankguard_lines(output, rank, "INFO")
        assert any(f"ending (preempted) with exit code {STOP_EXIT_CODE}" in e for e in ended), (
            rank,
            output[-6000:],
        )
        (warning,) = rankguard_lines(output, rank, "WARNING")
        assert warning.startswith(
            f"rankguard hang_watchdog: Preempted: SIGTERM on rank 1 at step {step}; "
            f"every rank stops after train step {step}"
        ), warning
        assert rankguard_lines(output, rank, "ERROR") == [], output[-6000:]
