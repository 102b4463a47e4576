"""rankguard's framework-free core: guards, the side channel, events and errors.

Nothing here imports a training framework. Adapters in
``rankguard.integrations`` translate framework events into
:class:`~rankguard.callbacks.core.events.Event` s and drive the guards.
"""

from rankguard.callbacks.batches.batch_parity_guard import BatchParityGuard
from rankguard.callbacks.batches.drop_last_guard import DropLastGuard
from rankguard.callbacks.checkpoint.checkpoint_planner import CheckpointPlanner
from rankguard.callbacks.checkpoint.plan import CheckpointPlan
from rankguard.callbacks.checkpoint.shared_dir_barrier import SharedDirBarrier, ensure_shared_dirs
from rankguard.callbacks.checkpoint.state_size import estimate_state_size
from rankguard.callbacks.core.errors import (
    BatchCountMismatchError,
    CheckpointMemoryError,
    DataInconsistencyError,
    DataStallError,
    DropLastMismatchError,
    HangDetectedError,
    MetricMismatchError,
    NodeLocalDirError,
    RankGuardError,
    RanksMissingError,
    ReplicaDivergenceError,
    ResumeMismatchError,
    SharedDirCreateError,
    SharedDirTimeoutError,
    StragglerError,
)
from rankguard.callbacks.core.events import (
    Event,
    EventFacts,
    LoaderFacts,
    LoaderPass,
    ResumeFacts,
)
from rankguard.callbacks.core.guard import Guard, GuardRunner
from rankguard.callbacks.core.side_channel import SideChannel
from rankguard.callbacks.data.data_consistency_guard import DataConsistencyGuard
from rankguard.callbacks.data.data_stall_monitor import DataStallMonitor
from rankguard.callbacks.hang.hang_watchdog import DEADLOCK_EXIT_CODE, HANG_EXIT_CODE, HangWatchdog
from rankguard.callbacks.registry import GUARDS, build_guards
from rankguard.callbacks.replica.replica_guard import ReplicaGuard
from rankguard.callbacks.resume.resume_guard import ResumeGuard
from rankguard.callbacks.straggler.straggler_monitor import StragglerMonitor

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
    "MetricMismatchError",
    "NodeLocalDirError",
    "RankGuardError",
    "RanksMissingError",
    "ReplicaDivergenceError",
    "ReplicaGuard",
    "ResumeFacts",
    "ResumeGuard",
    "ResumeMismatchError",
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
