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

try:  # every module of this package reads OLMo-core: checked once, here, before any loads
    import olmo_core  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "rankguard.integrations.olmo_core needs OLMo-core: pip install 'rankguard[olmo-core]'"
    ) from exc

from rankguard.integrations import _api
from rankguard.integrations.olmo_core.adapter import _OlmoCoreAdapter


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


class CheckpointPlanner(_api.CheckpointPlannerSettings, _OlmoCoreAdapter):
    """The checkpoint planner, as an OLMo-core ``Callback``."""


class DataStallMonitor(_api.DataStallMonitorSettings, _OlmoCoreAdapter):
    """The data stall monitor, as an OLMo-core ``Callback``."""


class StragglerMonitor(_api.StragglerMonitorSettings, _OlmoCoreAdapter):
    """The straggler monitor, as an OLMo-core ``Callback``."""


__all__ = [*_api.CLASS_NAMES]
