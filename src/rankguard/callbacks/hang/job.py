"""The job around this rank: its launcher's restarts and its process group's timeout.

Re-exported by ``hang_watchdog``, where tests, docs and adapters import them from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rankguard.callbacks.core.torch_private import group_timeout_s

__all__ = ["MAX_RESTARTS_ENV", "RESTART_ENV", "attempt_dir", "process_group_timeout"]

#: Set by torchrun (and its elastic agent) to the number of restarts of the worker group.
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


def process_group_timeout() -> tuple[str | None, float | None]:
    """Returns the default process group's backend and timeout (seconds), where known.

    The timeout has no public getter (``torch_private.group_timeout_s``).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    backend = str(dist.get_backend())
    return backend, group_timeout_s("cuda" if backend == "nccl" else "cpu")


def attempt_dir(report_dir: str | os.PathLike, env: Mapping[str, str]) -> Path:
    """Where this attempt's report goes: ``report_dir/attempt{N}`` when the launcher restarts.

    torchrun with ``--max-restarts`` above 0 (``TORCHELASTIC_MAX_RESTARTS``) can
    start the workers again, so each attempt keeps its own folder; otherwise
    the report goes to ``report_dir`` itself, where the docs say it is.

    Args:
        report_dir: The configured report directory.
        env: The environment (``os.environ``); :data:`RESTART_ENV` holds the
            restart count under torchrun, the same on every rank of an attempt.

    Returns:
        ``report_dir`` itself when the launcher does not restart workers.
    """
    count = env.get(RESTART_ENV, "").strip()
    restarts = env.get(MAX_RESTARTS_ENV, "").strip()
    if not count.isdigit() or (int(count) == 0 and not (restarts.isdigit() and int(restarts))):
        return Path(report_dir)
    return Path(report_dir) / f"attempt{int(count)}"
