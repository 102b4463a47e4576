"""The README's quickstart for every integration, for the type checker (``make lint``).

``tools/typecheck.py`` runs mypy on this file as a user's code would be checked
against the installed package: every import resolves and every ``RankGuard``
and single-guard class takes exactly its settings. Nothing runs it.
"""

from __future__ import annotations

from typing import Any

from rankguard.integrations import olmo_core as rg_olmo
from rankguard.integrations import transformers as rg_hf
from rankguard.integrations.composer import HangWatchdog, RankGuard
from rankguard.integrations.lightning import CheckpointPlanner
from rankguard.integrations.lightning import RankGuard as LightningRankGuard
from rankguard.integrations.torch import RankGuard as LoopRankGuard


def composer_callbacks() -> list[Any]:
    return [
        RankGuard(),
        RankGuard(hang_watchdog={"timeout_s": 300}, data_stall_monitor=False),
        RankGuard(exchange_timeout_s=60.0, batch_parity_guard={"on_violation": "warn"}),
        HangWatchdog(timeout_s=300, action="report"),
    ]


def lightning_callbacks() -> list[Any]:
    return [LightningRankGuard(drop_last_guard=False), CheckpointPlanner(writer="file")]


def trainer_callbacks() -> list[Any]:
    return [
        rg_hf.RankGuard(straggler_monitor={"threshold": 0.8}),
        rg_olmo.RankGuard(checkpoint_planner={"mode": "raise"}),
        rg_olmo.SharedDirBarrier(timeout_s=120.0, on_node_local="raise"),
    ]


def loop(model: Any, optimizer: Any, train_loader: Any, eval_loader: Any) -> None:
    guard = LoopRankGuard(hang_watchdog={"timeout_s": 300})
    with guard.fit(model, optimizer, train_loader, eval_loaders=eval_loader) as run:
        for _batch in run.train(train_loader):
            if run.step % 100 == 0:
                for _eval_batch in run.eval(eval_loader):
                    pass
            with run.checkpoint("checkpoints"):
                pass
