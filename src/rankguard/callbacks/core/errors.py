"""Errors raised by rankguard.

Every error is a :class:`RankGuardError`. A message always says what differs
per rank (or which ranks did not arrive), where (loader, path, phase), and
the fix.
"""

from __future__ import annotations

__all__ = [
    "BatchCountMismatchError",
    "CheckpointMemoryError",
    "DataInconsistencyError",
    "DataStallError",
    "DropLastMismatchError",
    "HangDetectedError",
    "MetricMismatchError",
    "NodeLocalDirError",
    "RankGuardError",
    "RanksMissingError",
    "ReplicaDivergenceError",
    "ResumeMismatchError",
    "SharedDirCreateError",
    "SharedDirTimeoutError",
    "StragglerError",
]


class RankGuardError(RuntimeError):
    """Base class of every error rankguard raises."""


class RanksMissingError(RankGuardError):
    """Some ranks did not reach a side-channel exchange within its timeout.

    Attributes:
        name: The exchange that timed out (e.g. ``"batch_parity/eval_end/eval"``).
        missing: The ranks that did not arrive, sorted.
        timeout_s: The timeout that passed, in seconds.
    """

    def __init__(self, message: str, *, name: str, missing: list[int], timeout_s: float) -> None:
        super().__init__(message)
        self.name = name
        self.missing = missing
        self.timeout_s = timeout_s


class BatchCountMismatchError(RankGuardError):
    """Ranks would run (or ran) different numbers of batches of one loader."""


class DropLastMismatchError(RankGuardError):
    """Loader or sampler settings (drop_last, batch size, sampler) differ between ranks."""


class SharedDirTimeoutError(RankGuardError):
    """Some ranks could not see a directory another rank created within the timeout."""


class SharedDirCreateError(RankGuardError):
    """A directory could not be created (permission, a file in the way) on some rank."""


class NodeLocalDirError(RankGuardError):
    """A checkpoint folder or resume path is on storage some nodes do not share."""


class CheckpointMemoryError(RankGuardError):
    """A checkpoint save would not fit in the host memory available."""


class DataInconsistencyError(RankGuardError):
    """Ranks see different datasets, splits or sampler seeds."""


class DataStallError(RankGuardError):
    """Some ranks spend most of their step time waiting for the next batch."""


class HangDetectedError(RankGuardError):
    """A rank made no progress within its deadline."""


class StragglerError(RankGuardError):
    """A rank or node has been computing slower than the others for several intervals."""


class ResumeMismatchError(RankGuardError):
    """Ranks resumed from different checkpoints, counters, data positions or random states."""


class ReplicaDivergenceError(RankGuardError):
    """Ranks that should hold equal copies of the model's parameters (replicas) do not."""


class MetricMismatchError(RankGuardError):
    """Ranks would reduce different metric names (or steps) in one collective."""
