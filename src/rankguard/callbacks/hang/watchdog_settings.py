"""The hang watchdog's settings as its thread reads them: one frozen value, fitted to the job.

:class:`~rankguard.callbacks.hang.hang_watchdog.HangWatchdog` checks its arguments and keeps
them as its attributes; at its start it hands :class:`WatchdogSettings` to its thread, fitted
here to the world size and the process group's timeout, and keeps the fitted values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from rankguard.callbacks.core.side_channel import SideChannel, spread_period
from rankguard.callbacks.hang import deadlines
from rankguard.callbacks.hang.incident import Policy

__all__ = ["DEFAULT_PERIOD_S", "FITTED", "STATUS_RANKS_PER_S", "WatchdogSettings"]

logger = logging.getLogger("rankguard.callbacks.hang_watchdog")

#: ``HangWatchdog(exchange_period_s=...)``'s default (seconds).
DEFAULT_PERIOD_S = 10.0
#: Ranks a second whose status exchange the store serves, job-wide, at the default period
#: (three requests each on a rank but 0): beyond 2,560 ranks the default period grows
#: (:func:`spread_exchanges`). With the polls and the interval exchanges, rankguard's steady
#: load on the store stays under 10% of its one thread at 16,384 ranks (docs/scale.md).
STATUS_RANKS_PER_S = 256.0
#: The settings fitted to the job at the watchdog's start (the guard keeps their new values).
FITTED = (
    "timeout_s",
    "eval_timeout_s",
    "post_eval_timeout_s",
    "checkpoint_timeout_s",
    "exchange_period_s",
    "exchange_timeout_s",
)


@dataclass(frozen=True)
class WatchdogSettings:
    """The watchdog's settings (its arguments, as checked; see ``HangWatchdog``'s).

    Attributes:
        defaulted: The ceiling arguments left at their default (they fit under NCCL's timeout).
    """

    timeout_s: float
    eval_timeout_s: float
    post_eval_timeout_s: float
    checkpoint_timeout_s: float
    first_step_timeout_s: float
    action: str
    abort_at: str
    report_dir: str
    exchange_period_s: float
    exchange_timeout_s: float
    auto_calibrate: bool
    warmup_steps: int
    calibration_factor: float
    floor_s: float
    deadlock_action: str
    deadlock_after_s: float
    collective_mismatch: str
    teardown_timeout_s: float
    defaulted: frozenset[str] = frozenset()

    @property
    def ceilings(self) -> dict[str, float]:
        """The ceiling per phase kind (stage 2)."""
        return deadlines.ceilings(
            first_step_timeout_s=self.first_step_timeout_s,
            timeout_s=self.timeout_s,
            eval_timeout_s=self.eval_timeout_s,
            post_eval_timeout_s=self.post_eval_timeout_s,
            checkpoint_timeout_s=self.checkpoint_timeout_s,
        )

    @property
    def deadline_policy(self) -> deadlines.Settings:
        """The settings the deadline policy reads."""
        return deadlines.Settings(
            self.auto_calibrate,
            self.warmup_steps,
            self.calibration_factor,
            self.floor_s,
            self.first_step_timeout_s,
            self.deadlock_after_s,
            self.action,
            self.abort_at,
        )

    @property
    def incident_policy(self) -> Policy:
        """The settings that decide what an incident does."""
        return Policy(self.action, self.abort_at, self.deadlock_action, self.collective_mismatch)

    @property
    def liveness(self) -> deadlines.Liveness:
        """How long a rank heard before may be silent (see :func:`deadlines.liveness`)."""
        return deadlines.liveness(self.exchange_period_s, self.exchange_timeout_s)


def spread_exchanges(
    settings: WatchdogSettings, channel: SideChannel, name: str
) -> WatchdogSettings:
    """A default ``exchange_period_s`` grows with the world beyond 2,560 ranks.

    Every rank's status exchange costs the store's one thread three requests: at
    ``world_size / STATUS_RANKS_PER_S`` seconds (64 s at 16,384 ranks) the job's
    status exchanges ask it for a bounded rate (docs/scale.md). A period the user
    set to anything but the default stays as set.
    """
    if settings.exchange_period_s != DEFAULT_PERIOD_S or not channel.is_distributed:
        return settings
    period = spread_period(DEFAULT_PERIOD_S, channel.world_size, STATUS_RANKS_PER_S)
    if period <= settings.exchange_period_s:
        return settings
    logger.info(
        "rankguard %s: `exchange_period_s` set to %.0f s for %d ranks (the job's store "
        "serves every rank's status exchange; docs/scale.md)",
        name,
        period,
        channel.world_size,
    )
    return replace(settings, exchange_period_s=period, exchange_timeout_s=max(2.0, period))


def fit_defaults_under(
    settings: WatchdogSettings, pg_timeout: float | None, name: str
) -> WatchdogSettings:
    """Lowers defaulted ceilings so a hang ends before NCCL ends the job (logs each)."""
    values = {arg: getattr(settings, arg) for arg in settings.defaulted}
    fitted = deadlines.fit_defaults_under(
        values,
        settings.defaulted,
        pg_timeout,
        exchange_period_s=settings.exchange_period_s,
        exchange_timeout_s=settings.exchange_timeout_s,
    )
    for arg, seconds in fitted.items():
        logger.info(
            "rankguard %s: `%s` set to %.0f s to report before NCCL's %.0f s timeout",
            name,
            arg,
            seconds,
            pg_timeout,
        )
    return replace(settings, **fitted)
