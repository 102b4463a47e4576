"""Deadline policy: ceilings, fitting them under NCCL's timeout, calibration, settle times.

Pure: the watchdog passes its settings and its interval history, and logs what changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from rankguard.callbacks.hang.calibration import (
    KIND_LABELS,
    MIN_SAMPLES,
    QUANTILE,
    Deadline,
    IntervalHistory,
    calibrate,
    describe,
    quantile,
)
from rankguard.callbacks.hang.kinds import Phase

__all__ = [
    "DEFAULT_DEADLINES",
    "RECORD_SETTLE_S",
    "Calibration",
    "Liveness",
    "Settings",
    "Settle",
    "ceiling_arguments",
    "ceilings",
    "fit_defaults_under",
    "liveness",
    "plan",
    "recalibrate",
    "settle_times",
]

#: Ceilings used when an argument is left at ``None``; under NCCL they are
#: lowered to fit inside the process-group timeout (see :func:`fit_defaults_under`).
DEFAULT_DEADLINES = {
    "timeout_s": 600.0,
    "eval_timeout_s": 600.0,
    "post_eval_timeout_s": 600.0,
    "checkpoint_timeout_s": 1800.0,
}
#: The least quiet time of a rank's record once calibrated (seconds; see :func:`settle_times`).
RECORD_SETTLE_S = 1.0
#: Missed status exchanges after which a rank heard before is named, then ended (see
#: :func:`liveness`).
SILENT_EXCHANGES, SILENT_END_EXCHANGES = 2, 6


class Liveness(NamedTuple):
    """How long a rank heard before may be silent on the side channel (seconds).

    Its watchdog thread answers whatever its training thread does (a slow step, a
    long save): one that stops answering is frozen, dead, or held out of the
    interpreter by one long call, whatever phase it was last seen in.
    """

    name_s: float  # named (stage 1: a report, its stacks; training goes on)
    end_s: float  # the incident ends (stage 2: exit 75 with action="abort")


def liveness(exchange_period_s: float, exchange_timeout_s: float) -> Liveness:
    """The silences after which a rank is named, then ended: two, then six missed exchanges.

    At the defaults (10 s, 10 s) 30 and 70 s of silence: a rank frozen at any point is
    named within 30 s and the job ends within 90 s, while a rank whose Python is busy
    for a few seconds (a collection, a fork) misses at most one exchange.
    """
    return Liveness(
        exchange_period_s + SILENT_EXCHANGES * exchange_timeout_s,
        exchange_period_s + SILENT_END_EXCHANGES * exchange_timeout_s,
    )


def ceilings(
    *,
    first_step_timeout_s: float,
    timeout_s: float,
    eval_timeout_s: float,
    post_eval_timeout_s: float,
    checkpoint_timeout_s: float,
) -> dict[str, float]:
    """The ceiling per phase kind (stage 2), from the deadline arguments."""
    return {
        Phase.STARTUP: first_step_timeout_s,
        Phase.TRAIN: timeout_s,
        Phase.DATA: timeout_s,
        Phase.EVAL: eval_timeout_s,
        Phase.POST_EVAL: post_eval_timeout_s,
        Phase.CHECKPOINT: checkpoint_timeout_s,
    }


def ceiling_arguments(ceilings: Mapping[str, float]) -> dict[str, float]:
    """The ceilings by the argument that sets each (``timeout_s``...), start-up's aside."""
    return {
        f"{k}_timeout_s" if k != Phase.TRAIN else "timeout_s": v
        for k, v in ceilings.items()
        if k not in (Phase.STARTUP, Phase.DATA)
    }


def fit_defaults_under(
    values: Mapping[str, float],
    defaulted: Iterable[str],
    pg_timeout: float | None,
    *,
    exchange_period_s: float,
    exchange_timeout_s: float,
) -> dict[str, float]:
    """The defaulted ceilings to lower so a hang ends before NCCL ends the job.

    Args:
        values: Each ceiling argument's value now, by name (``timeout_s``...).
        defaulted: The arguments left at their default (only those are lowered).
        pg_timeout: The process group's timeout (seconds), or ``None`` if unknown.
        exchange_period_s: Time between status exchanges.
        exchange_timeout_s: How long the deciding rank waits for every status.

    Returns:
        The new value of each argument to lower, by name, in ``defaulted``'s order.
    """
    if pg_timeout is None:
        return {}
    detect = exchange_period_s + exchange_timeout_s
    fitted = max(exchange_period_s, 0.8 * pg_timeout - detect)
    return {name: fitted for name in defaulted if values[name] > fitted}


class Settle(NamedTuple):
    """How long a quiet rank must stay so before its state counts toward a deadlock."""

    stack_s: float  # the loop's wait at one rendezvous, before its status says "settled"
    record_s: float  # no progress and no collective issued, before its record is compared


def settle_times(
    deadlock_after_s: float, factor: float, train: tuple[float, ...] | None = None
) -> Settle:
    """The settle times, before calibration (``train`` ``None``) or from the train intervals.

    Ranks leave a collective milliseconds apart and their counts of collectives
    differ briefly all the time, so a wait or a quiet record counts only once it
    has lasted longer than a train step normally does. Before calibration both
    are ``deadlock_after_s``. Calibrated (at least ``MIN_SAMPLES`` train
    intervals), the stack wait is ``max(deadlock_after_s, factor x train p99)``
    and the record's quiet time ``max(RECORD_SETTLE_S, factor x train p99)``:
    a record proves a desync no stack shows, so it need not wait the user's
    ``deadlock_after_s`` once the steps' length is known.

    Args:
        deadlock_after_s: The ``deadlock_after_s`` setting.
        factor: The ``calibration_factor`` setting.
        train: The recent train intervals, or ``None`` before calibration.

    Returns:
        The settle times; uncalibrated ones when ``train`` holds too few intervals.
    """
    if train is None or len(train) < MIN_SAMPLES:
        return Settle(deadlock_after_s, deadlock_after_s)
    step_p99 = quantile(train, QUANTILE)
    return Settle(max(deadlock_after_s, factor * step_p99), max(RECORD_SETTLE_S, factor * step_p99))


class Settings(NamedTuple):
    """The watchdog's settings that the deadline policy reads (its arguments, as checked)."""

    auto_calibrate: bool
    warmup_steps: int
    factor: float  # calibration_factor
    floor_s: float
    first_step_timeout_s: float
    deadlock_after_s: float
    action: str
    abort_at: str


class Calibration(NamedTuple):
    """Deadlines recalibrated from the intervals seen (:func:`recalibrate`)."""

    deadlines: dict[str, float]  # per phase kind: stage 1
    calibrated: dict[str, Deadline]  # per calibrated kind, for the log line
    settle: Settle | None  # None: too few train intervals yet, the last settle times hold


def recalibrate(
    history: IntervalHistory,
    ceilings: Mapping[str, float],
    settings: Settings,
    save_estimate: float | None,
) -> Calibration:
    """The deadlines from the intervals seen (at each status exchange, once warmed up).

    Start-up keeps ``first_step_timeout_s``; the settle times change only once
    ``MIN_SAMPLES`` train intervals are held (see :func:`settle_times`).

    Args:
        history: The intervals seen per phase kind.
        ceilings: The ceiling per phase kind.
        settings: The watchdog's settings.
        save_estimate: A checkpoint save's expected seconds (from the model's size), or ``None``.
    """
    factor = settings.factor
    calibrated = calibrate(
        history, ceilings, factor=factor, floor_s=settings.floor_s, save_estimate=save_estimate
    )
    deadlines = {Phase.STARTUP: settings.first_step_timeout_s}
    deadlines.update({kind: d.seconds for kind, d in calibrated.items()})
    train = history.snapshot()[Phase.TRAIN]
    enough = len(train) >= MIN_SAMPLES
    settle = settle_times(settings.deadlock_after_s, factor, train) if enough else None
    return Calibration(deadlines, calibrated, settle)


def plan(
    ceilings: Mapping[str, float], settings: Settings, restored: Mapping[str, Deadline] | None
) -> str:
    """The INFO line at fit start: what is reported when, and when the job ends.

    Args:
        ceilings: The ceiling per phase kind.
        settings: The watchdog's settings.
        restored: The deadlines calibrated from a checkpoint's history, or ``None``.
    """
    text = ", ".join(f"{KIND_LABELS[k]} {v:.0f} s" for k, v in ceilings.items() if k != Phase.DATA)
    end = "aborts" if settings.action == "abort" else "reports again (action='report')"
    if not settings.auto_calibrate:
        return f"deadlines (no calibration): {text}; past one it {end}."
    if restored is not None:
        calibrated = f"calibrated from the checkpoint: {describe(restored)}"
    else:
        calibrated = (
            f"calibrated after {settings.warmup_steps} warm-up train steps to "
            f"{settings.factor:g} x the 99th percentile of each phase's intervals, "
            f"at least {settings.floor_s:g} s"
        )
    if settings.abort_at == "calibrated":
        return f"deadlines {calibrated}, at most {text}; past one it {end}."
    return f"reports at deadlines {calibrated}; {end} at the ceilings: {text}."
