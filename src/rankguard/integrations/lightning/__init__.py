"""rankguard callbacks for PyTorch Lightning.

Translation only: Lightning hooks become rankguard core events (the table:
docs/design.md#events-the-training-loop-as-the-guards-see-it), and the facts the guards
need (train loader, each val loader by name with Lightning's planned batch
count) are read from the public ``Trainer`` properties; what only Lightning's
private names say is read in :mod:`rankguard.integrations.private.lightning`.

Every val loader gets its EVAL_START at ``on_validation_start`` and its
EVAL_END at ``on_validation_end``, so each rank reports every loader even
when it has no batch of it. The sanity check counts as an eval.

Example::

    import lightning as L
    from rankguard.integrations.lightning import RankGuard

    trainer = L.Trainer(strategy="ddp", callbacks=[RankGuard()])

Requires ``pip install 'rankguard[lightning]'``.
"""

from __future__ import annotations

from rankguard.integrations._common import require

# The framework first, named with its pip extra where it is missing.
require("lightning", ("lightning",), "Lightning", "lightning")

from rankguard.integrations import _api  # noqa: E402
from rankguard.integrations.lightning.adapter import _LightningAdapter  # noqa: E402


class RankGuard(_api.RankGuardSettings, _LightningAdapter):
    """Every rankguard guard with sound defaults, as a Lightning callback."""


class HangWatchdog(_api.HangWatchdogSettings, _LightningAdapter):
    """The hang watchdog, as a Lightning callback."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _LightningAdapter):
    """The data consistency guard, as a Lightning callback."""


class DropLastGuard(_api.DropLastGuardSettings, _LightningAdapter):
    """The drop-last guard, as a Lightning callback."""


class BatchParityGuard(_api.BatchParityGuardSettings, _LightningAdapter):
    """The batch parity guard, as a Lightning callback."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _LightningAdapter):
    """The shared-directory barrier, as a Lightning callback."""


class ResumeGuard(_api.ResumeGuardSettings, _LightningAdapter):
    """The resume check, as a Lightning callback."""


class ReplicaGuard(_api.ReplicaGuardSettings, _LightningAdapter):
    """The replica check, as a Lightning callback."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _LightningAdapter):
    """The checkpoint planner, as a Lightning callback."""


class DataStallMonitor(_api.DataStallMonitorSettings, _LightningAdapter):
    """The data stall monitor, as a Lightning callback."""


class StragglerMonitor(_api.StragglerMonitorSettings, _LightningAdapter):
    """The straggler monitor, as a Lightning callback."""


__all__ = [*_api.CLASS_NAMES]
