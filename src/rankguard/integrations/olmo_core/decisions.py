"""What the OLMo-core adapter decides, each a pure function of the facts it reads.

Each has its unit test in ``tests/integrations/test_olmo_core.py``.
"""

from __future__ import annotations

from typing import Any

from olmo_core.io import normalize_path
from olmo_core.train import LoadStrategy

__all__ = ["announces_resume", "rank0_timeout", "resumed_from_load_path"]


def announces_resume(no_checkpoints: bool, load_strategy: LoadStrategy) -> bool:
    """Whether a fit announces RESUMED: where ``Trainer.fit`` may load a checkpoint."""
    return not no_checkpoints and load_strategy != LoadStrategy.never


def resumed_from_load_path(checkpoint: str | None, load_path: Any, save_folder: str) -> bool:
    """Whether ``checkpoint`` came from ``load_path``, not the save folder (tried first)."""
    if checkpoint is None or load_path is None:
        return False
    return not checkpoint.startswith(normalize_path(save_folder) + "/")


def rank0_timeout(timeout: float, barrier_timeout_s: float | None, fitting: bool) -> float:
    """Rank 0's wait for its last checkpoint: the barrier's ``timeout_s`` while fitting."""
    if barrier_timeout_s is None or not fitting:
        return timeout
    return max(timeout, barrier_timeout_s)
