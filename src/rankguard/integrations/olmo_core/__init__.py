"""rankguard callbacks for the OLMo-core ``Trainer`` (``olmo_core.train``).

Holds ``RankGuard`` and one callback per guard (settings declared in
``rankguard.integrations._api``). The adapter they join is in :mod:`.adapter`;
what it reads and does is split by concern: OLMo-core's facts and words
(:mod:`.facts`: :func:`~.facts.save_options`, :func:`~.facts.checkpoint_to_load`),
its decisions (:mod:`.decisions`), the methods it wraps (:mod:`.hooks`:
:func:`~.hooks.hook_trainer`) and the metric flush's check (:mod:`.flush`:
:func:`~.flush.hook_metric_flush`). OLMo-core's private names are read in
:mod:`rankguard.integrations.private.olmo_core` (:func:`route_checkpoint_dir_waits`).
Requires ``pip install 'rankguard[olmo-core]'``.
See docs/integrations.md#olmo-core-where-each-event-comes-from.
"""

from __future__ import annotations

from rankguard.integrations._common import require

# The framework first, named with its pip extra where it is missing.
require("olmo_core", ("olmo_core",), "OLMo-core", "olmo-core")

from rankguard.integrations import _api  # noqa: E402
from rankguard.integrations.olmo_core.adapter import _OlmoCoreAdapter  # noqa: E402

# What this module exported before it was a package: kept for the code that imports it.
from rankguard.integrations.olmo_core.facts import checkpoint_to_load, save_options  # noqa: E402
from rankguard.integrations.olmo_core.flush import hook_metric_flush  # noqa: E402
from rankguard.integrations.olmo_core.hooks import hook_trainer  # noqa: E402


class RankGuard(_api.RankGuardSettings, _OlmoCoreAdapter):
    """Every rankguard guard with sound defaults, as an OLMo-core ``Callback``."""


class HangWatchdog(_api.HangWatchdogSettings, _OlmoCoreAdapter):
    """The hang watchdog, as an OLMo-core ``Callback``."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _OlmoCoreAdapter):
    """The data consistency guard, as an OLMo-core ``Callback``."""


class DropLastGuard(_api.DropLastGuardSettings, _OlmoCoreAdapter):
    """The drop-last guard, as an OLMo-core ``Callback``."""


class BatchParityGuard(_api.BatchParityGuardSettings, _OlmoCoreAdapter):
    """The batch parity guard, as an OLMo-core ``Callback``."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _OlmoCoreAdapter):
    """The shared-directory barrier, as an OLMo-core ``Callback``."""


class ResumeGuard(_api.ResumeGuardSettings, _OlmoCoreAdapter):
    """The resume check, as an OLMo-core ``Callback``."""


class ReplicaGuard(_api.ReplicaGuardSettings, _OlmoCoreAdapter):
    """The replica check, as an OLMo-core ``Callback``."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _OlmoCoreAdapter):
    """The checkpoint planner, as an OLMo-core ``Callback``."""


class DataStallMonitor(_api.DataStallMonitorSettings, _OlmoCoreAdapter):
    """The data stall monitor, as an OLMo-core ``Callback``."""


class StragglerMonitor(_api.StragglerMonitorSettings, _OlmoCoreAdapter):
    """The straggler monitor, as an OLMo-core ``Callback``."""


__all__ = [
    "checkpoint_to_load",
    "hook_metric_flush",
    "hook_trainer",
    "save_options",
    *_api.CLASS_NAMES,
]
