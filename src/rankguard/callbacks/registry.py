"""The core guards by name, and building them from plain (YAML-friendly) config.

This is the one list of guards: ``RankGuard`` in every adapter and config
builders use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from rankguard.callbacks.batches.batch_parity_guard import BatchParityGuard
from rankguard.callbacks.batches.drop_last_guard import DropLastGuard
from rankguard.callbacks.checkpoint.checkpoint_planner import CheckpointPlanner
from rankguard.callbacks.checkpoint.shared_dir_barrier import SharedDirBarrier
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.data.data_consistency_guard import DataConsistencyGuard
from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor
from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
from rankguard.callbacks.replica.replica_guard import ReplicaGuard
from rankguard.callbacks.resume.resume_guard import ResumeGuard
from rankguard.callbacks.straggler.straggler_monitor import StragglerMonitor

__all__ = ["GUARDS", "build_guard", "build_guards", "unknown_name_error"]

#: Core guard classes by snake-case name, in the order they run. The hang
#: watchdog first: its heartbeat marks each event before a check waits there,
#: and its thread runs before the fit-start checks, so a rank missing from any
#: check gets its diagnosis. Then root causes first: a dataset or seed
#: difference explains a settings or count difference, and a settings
#: difference explains a count difference (and ``DropLastGuard(mode="enforce")``
#: changes counts); ranks that resumed differently explain replicas that differ. Of
#: the monitors, a data stall explains slow steps, so ``DataStallMonitor`` comes before
#: ``StragglerMonitor``, which then starts its batch clock after the data-stall exchange.
GUARDS: dict[str, type[Guard]] = {
    HangWatchdog.name: HangWatchdog,
    DataConsistencyGuard.name: DataConsistencyGuard,
    DropLastGuard.name: DropLastGuard,
    BatchParityGuard.name: BatchParityGuard,
    SharedDirBarrier.name: SharedDirBarrier,
    ResumeGuard.name: ResumeGuard,
    ReplicaGuard.name: ReplicaGuard,
    CheckpointPlanner.name: CheckpointPlanner,
    DataStallMonitor.name: DataStallMonitor,
    StragglerMonitor.name: StragglerMonitor,
}


def unknown_name_error(kind: str, name: str, valid: list[str]) -> ValueError:
    """A ``ValueError`` for an unknown name that lists the valid ones and the closest match."""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"Unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}.{hint}")


def build_guards(config: Mapping[str, Mapping[str, Any] | bool | None]) -> list[Guard]:
    """Builds every guard with its settings; guards not mentioned use their defaults.

    Args:
        config: Per guard name: a dict of keyword arguments, ``True``/``None``
            for the defaults, or ``False`` to leave the guard out.

    Returns:
        The enabled guards, in run order.

    Raises:
        ValueError: An unknown guard name or setting, or an invalid value.
    """
    for name in config:
        if name not in GUARDS:
            raise unknown_name_error("guard", name, list(GUARDS))
    guards = []
    for name, cls in GUARDS.items():
        settings = config.get(name, True)
        if settings is False:
            continue
        if settings is True or settings is None:
            settings = {}
        if not isinstance(settings, Mapping):
            raise ValueError(
                f"`{name}` must be a dict of settings, True or False; got {settings!r}."
            )
        guards.append(build_guard(cls, settings))
    return guards


def build_guard(cls: type[Guard], settings: Mapping[str, Any]) -> Guard:
    """Builds one guard, turning an unknown keyword into a ``ValueError`` with the valid ones."""
    import inspect

    params = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    for key in settings:
        if key not in params:
            raise unknown_name_error(f"setting of `{cls.name}`", key, params)
    return cls(**settings)
