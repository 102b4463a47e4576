"""rankguard's framework-free core: guards, the side channel, events and errors.

Nothing here imports a training framework. Adapters in
``rankguard.integrations`` translate framework events into
:class:`~rankguard.callbacks.events.Event` s and drive the guards.
"""

from rankguard.callbacks.batch_parity import BatchParityGuard
from rankguard.callbacks.checkpoint_plan import CheckpointPlan
from rankguard.callbacks.checkpoint_planner import CheckpointPlanner
from rankguard.callbacks.data_consistency import DataConsistencyGuard
from rankguard.callbacks.data_stall import DataStallMonitor
from rankguard.callbacks.drop_last import DropLastGuard
from rankguard.callbacks.errors import (
    BatchCountMismatchError,
    CheckpointMemoryError,
    DataInconsistencyError,
    DataStallError,
    DropLastMismatchError,
    HangDetectedError,
    NodeLocalDirError,
    RankGuardError,
    RanksMissingError,
    SharedDirCreateError,
    SharedDirTimeoutError,
    StragglerError,
)
from rankguard.callbacks.events import Event, EventFacts, LoaderFacts, LoaderPass
from rankguard.callbacks.guard import Guard, GuardRunner
from rankguard.callbacks.hang_watchdog import DEADLOCK_EXIT_CODE, HANG_EXIT_CODE, HangWatchdog
from rankguard.callbacks.registry import GUARDS, build_guards
from rankguard.callbacks.shared_dirs import SharedDirBarrier, ensure_shared_dirs
from rankguard.callbacks.side_channel import SideChannel
from rankguard.callbacks.state_size import estimate_state_size
from rankguard.callbacks.straggler import StragglerMonitor

__all__ = [
    "DEADLOCK_EXIT_CODE",
    "GUARDS",
    "HANG_EXIT_CODE",
    "BatchCountMismatchError",
    "BatchParityGuard",
    "CheckpointMemoryError",
    "CheckpointPlan",
    "CheckpointPlanner",
    "DataConsistencyGuard",
    "DataInconsistencyError",
    "DataStallError",
    "DataStallMonitor",
    "DropLastGuard",
    "DropLastMismatchError",
    "Event",
    "EventFacts",
    "Guard",
    "GuardRunner",
    "HangDetectedError",
    "HangWatchdog",
    "LoaderFacts",
    "LoaderPass",
    "NodeLocalDirError",
    "RankGuardError",
    "RanksMissingError",
    "SharedDirBarrier",
    "SharedDirCreateError",
    "SharedDirTimeoutError",
    "SideChannel",
    "StragglerError",
    "StragglerMonitor",
    "build_guards",
    "ensure_shared_dirs",
    "estimate_state_size",
]
