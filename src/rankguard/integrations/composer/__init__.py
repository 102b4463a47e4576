"""rankguard callbacks for MosaicML Composer.

Translation only: Composer events become rankguard core events (the table:
docs/design.md#events-the-training-loop-as-the-guards-see-it), and the facts the guards
need (train loader, each evaluator's loader and planned batch count) are read
from Composer's public ``State``.

Example::

    from composer import Trainer
    from rankguard.integrations.composer import RankGuard

    trainer = Trainer(..., callbacks=[RankGuard(hang_watchdog={"timeout_s": 300})])

Requires ``pip install 'rankguard[composer]'``.
"""

from __future__ import annotations

from rankguard.integrations._common import require

# The framework first, named with its pip extra where it is missing.
require("composer", ("composer",), "Composer", "composer")

from rankguard.integrations import _api  # noqa: E402
from rankguard.integrations.composer.adapter import _ComposerAdapter  # noqa: E402


class RankGuard(_api.RankGuardSettings, _ComposerAdapter):
    """Every rankguard guard with sound defaults, as a Composer callback."""


class HangWatchdog(_api.HangWatchdogSettings, _ComposerAdapter):
    """The hang watchdog, as a Composer callback."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _ComposerAdapter):
    """The data consistency guard, as a Composer callback."""


class DropLastGuard(_api.DropLastGuardSettings, _ComposerAdapter):
    """The drop-last guard, as a Composer callback."""


class BatchParityGuard(_api.BatchParityGuardSettings, _ComposerAdapter):
    """The batch parity guard, as a Composer callback."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _ComposerAdapter):
    """The shared-directory barrier, as a Composer callback."""


class ResumeGuard(_api.ResumeGuardSettings, _ComposerAdapter):
    """The resume check, as a Composer callback."""


class ReplicaGuard(_api.ReplicaGuardSettings, _ComposerAdapter):
    """The replica check, as a Composer callback."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _ComposerAdapter):
    """The checkpoint planner, as a Composer callback."""


class DataStallMonitor(_api.DataStallMonitorSettings, _ComposerAdapter):
    """The data stall monitor, as a Composer callback."""


class StragglerMonitor(_api.StragglerMonitorSettings, _ComposerAdapter):
    """The straggler monitor, as a Composer callback."""


__all__ = [*_api.CLASS_NAMES]
