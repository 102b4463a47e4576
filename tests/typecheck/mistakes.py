# mypy: warn-unused-ignores
"""Mistakes the type checker must reject in every integration (``make lint``).

Each line below is an error mypy reports, silenced by an ignore of that exact
error code; were it not an error, the ignore would be unused and, with
``warn-unused-ignores``, mypy fails. Nothing runs it.
"""

from __future__ import annotations

from typing import Any

from rankguard.integrations import composer, lightning, olmo_core, torch, transformers


def mistakes() -> list[Any]:
    return [
        composer.RankGuard(hang_watchdg={"timeout_s": 300}),  # type: ignore[call-arg]
        lightning.RankGuard(drop_last_guard="no"),  # type: ignore[arg-type]
        transformers.RankGuard(exchange_timeout_s="60"),  # type: ignore[arg-type]
        torch.HangWatchdog(timeout="300"),  # type: ignore[call-arg]
        olmo_core.SharedDirBarrier(on_node_local=True),  # type: ignore[arg-type]
        lightning.CheckpointPlanner("file"),  # type: ignore[call-arg]
        composer.StragglerMonitor(threshold="high"),  # type: ignore[arg-type]
    ]
