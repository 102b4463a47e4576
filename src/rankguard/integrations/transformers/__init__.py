"""rankguard callbacks for the Hugging Face ``Trainer``.

Holds ``RankGuard`` and one callback per guard (settings declared in
``rankguard.integrations._api``), and :func:`calling_trainer` (from
``rankguard.integrations.private.transformers``).
The adapter's hooks are in ``.adapter``, what it reads from the Trainer in
``.facts``, what it decides in ``.decisions``.
Requires ``pip install 'rankguard[transformers]'``.
See docs/integrations.md#hugging-face-trainer-where-each-event-comes-from.
"""

from __future__ import annotations

from rankguard.integrations._common import require

# The framework first, named with its pip extra where it is missing.
require(
    "transformers", ("transformers", "accelerate"), "transformers and accelerate", "transformers"
)

from rankguard.integrations import _api  # noqa: E402
from rankguard.integrations.private.transformers import calling_trainer  # noqa: E402
from rankguard.integrations.transformers.adapter import _TrainerAdapter  # noqa: E402


class RankGuard(_api.RankGuardSettings, _TrainerAdapter):
    """Every rankguard guard with sound defaults, as a Hugging Face ``TrainerCallback``."""


class HangWatchdog(_api.HangWatchdogSettings, _TrainerAdapter):
    """The hang watchdog, as a Hugging Face ``TrainerCallback``."""


class DataConsistencyGuard(_api.DataConsistencyGuardSettings, _TrainerAdapter):
    """The data consistency guard, as a Hugging Face ``TrainerCallback``."""


class DropLastGuard(_api.DropLastGuardSettings, _TrainerAdapter):
    """The drop-last guard, as a Hugging Face ``TrainerCallback``."""


class BatchParityGuard(_api.BatchParityGuardSettings, _TrainerAdapter):
    """The batch parity guard, as a Hugging Face ``TrainerCallback``."""


class SharedDirBarrier(_api.SharedDirBarrierSettings, _TrainerAdapter):
    """The shared-directory barrier, as a Hugging Face ``TrainerCallback``."""


class ResumeGuard(_api.ResumeGuardSettings, _TrainerAdapter):
    """The resume check, as a Hugging Face ``TrainerCallback``."""


class ReplicaGuard(_api.ReplicaGuardSettings, _TrainerAdapter):
    """The replica check, as a Hugging Face ``TrainerCallback``."""


class CheckpointPlanner(_api.CheckpointPlannerSettings, _TrainerAdapter):
    """The checkpoint planner, as a Hugging Face ``TrainerCallback``."""


class DataStallMonitor(_api.DataStallMonitorSettings, _TrainerAdapter):
    """The data stall monitor, as a Hugging Face ``TrainerCallback``."""


class StragglerMonitor(_api.StragglerMonitorSettings, _TrainerAdapter):
    """The straggler monitor, as a Hugging Face ``TrainerCallback``."""


__all__ = ["calling_trainer", *_api.CLASS_NAMES]
