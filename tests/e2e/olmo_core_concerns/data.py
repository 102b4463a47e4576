"""What the ranks read: eval sets of unlike lengths, slow reads on one rank, node-local tokens."""

from __future__ import annotations

import torch.distributed as dist

from tests.e2e.olmo_core_concerns import harness
from tests.e2e.olmo_core_concerns.harness import PER_RANK, QUICK, build_trainer, counting, fit


def uneven_eval() -> None:
    # Each rank built its own eval set (32 and 64 sequences): 4 and 8 eval batches per rank.
    from rankguard.integrations.olmo_core import RankGuard

    # DataConsistencyGuard would name the sets' lengths at fit start: BatchParityGuard is tested.
    sequences = 32 if dist.get_rank() == 0 else 64
    guard = RankGuard(data_consistency_guard=False, **QUICK)
    fit(build_trainer(harness.OUT / "uneven_eval", counting(guard), eval_sequences=sequences))


def slow_data() -> None:
    """Rank 1's token reads take 25 ms per sequence (100 ms per batch), 16 steps."""
    from rankguard.integrations.olmo_core import RankGuard

    monitor = {"interval": 4, "window": 3}
    guard = RankGuard(data_stall_monitor=monitor, **QUICK)
    delay = 0.025 if dist.get_rank() == 1 else 0.0
    trainer = build_trainer(
        harness.OUT / "slow_data",
        counting(guard),
        eval_sequences=None,
        steps=16,
        save_interval=100,
        data_delay_s=delay,
    )
    fit(trainer)


def slow_rank_data() -> None:
    """Rank 1's token reads 0.1 s slower per batch (a slow disk on one node), 40 steps."""
    from rankguard.integrations.olmo_core import RankGuard

    delay = 0.1 / PER_RANK if dist.get_rank() == 1 else 0.0
    trainer = build_trainer(
        harness.OUT / "slow_rank_data",
        counting(RankGuard(**QUICK)),
        eval_sequences=None,
        steps=40,
        save_interval=100,
        data_delay_s=delay,
        sequences=8 * 40,
    )
    fit(trainer)


def node_local_tokens() -> None:
    """Each node's token file: same name and size, contents shuffled without a seed."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    fit(build_trainer(harness.OUT / "node_local_tokens", counting(guard), node_local_tokens=True))


SCENARIOS = {
    "uneven_eval": uneven_eval,
    "slow_data": slow_data,
    "slow_rank_data": slow_rank_data,
    "node_local_tokens": node_local_tokens,
}
