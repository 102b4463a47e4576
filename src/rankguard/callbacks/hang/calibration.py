"""Calibrated hang deadlines: each phase's deadline from the intervals this rank has seen.

Pure rules and a small interval record (no thread, file or process group):
:class:`IntervalHistory`, :func:`calibrate`, :class:`Deadline`.
See docs/hang.md#how-the-deadlines-are-calibrated.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard.callbacks.hang.kinds import Phase

__all__ = [
    "CALIBRATED_KINDS",
    "HEADROOM",
    "KIND_LABELS",
    "MIN_SAMPLES",
    "QUANTILE",
    "SAVE_BYTES_PER_PARAM",
    "SAVE_BYTES_PER_S",
    "UNSEEN_FACTOR",
    "WINDOW",
    "Deadline",
    "IntervalHistory",
    "calibrate",
    "describe",
    "quantile",
    "save_estimate_s",
]

#: Phase kinds whose deadline is calibrated ("startup" keeps ``first_step_timeout_s``).
CALIBRATED_KINDS = (Phase.TRAIN, Phase.DATA, Phase.EVAL, Phase.POST_EVAL, Phase.CHECKPOINT)
#: How each kind is named in log lines.
KIND_LABELS = {
    Phase.STARTUP: "first step",
    Phase.TRAIN: "train",
    Phase.DATA: "data fetch",
    Phase.EVAL: "eval",
    Phase.POST_EVAL: "after eval",
    Phase.CHECKPOINT: "checkpoint save",
}
#: The quantile of recent intervals a deadline is a multiple of.
QUANTILE = 0.99
#: A deadline is never below this multiple of the longest interval seen in its phase.
HEADROOM = 2.0
#: Intervals a phase needs before its own quantile alone sets its deadline.
MIN_SAMPLES = 8
#: Derived deadlines use this many times ``factor`` (a phase not seen yet is less certain).
UNSEEN_FACTOR = 3.0
#: Recent intervals kept per phase (and saved with checkpoints).
WINDOW = 512
#: A first checkpoint save is assumed to write this much per parameter: bf16 weights,
#: fp32 master weights and two fp32 Adam moments (14 B), rounded up.
SAVE_BYTES_PER_PARAM = 16
#: ... at this rate (a slow shared filesystem).
SAVE_BYTES_PER_S = 20e6


@dataclass(frozen=True)
class Deadline:
    """A phase's deadline and where it came from.

    Attributes:
        seconds: The deadline.
        source: ``"calibrated"`` (from the phase's own intervals), ``"derived"``
            (from other phases, it has too few), ``"floor"`` or ``"ceiling"``
            (clamped to either).
    """

    seconds: float
    source: str


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (the smallest value >= a share ``q``)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def save_estimate_s(num_params: int, floor_s: float) -> float:
    """Deadline of a first checkpoint save of a model with ``num_params`` parameters."""
    return floor_s + num_params * SAVE_BYTES_PER_PARAM / SAVE_BYTES_PER_S


class IntervalHistory:
    """The intervals a rank has seen per phase kind: the state saved with checkpoints.

    The watchdog thread records the intervals between the heartbeats the training
    loop's thread appended, a read's worth per kind at once (:meth:`record_many`);
    :meth:`snapshot` copies.

    Attributes:
        peaks: Longest interval seen per kind.
    """

    def __init__(self) -> None:
        self._recent: dict[str, collections.deque] = {
            kind: collections.deque(maxlen=WINDOW) for kind in CALIBRATED_KINDS
        }
        self.peaks: dict[str, float] = {}

    def record(self, kind: str, seconds: float) -> None:
        """Adds one interval spent in a phase of ``kind`` (other kinds are ignored)."""
        recent = self._recent.get(kind)
        if recent is not None:
            recent.append(seconds)
            if seconds > self.peaks.get(kind, 0.0):
                self.peaks[kind] = seconds

    def record_many(self, kind: str, seconds: list[float]) -> None:
        """Adds intervals spent in phases of ``kind``, in order (other kinds are ignored)."""
        recent = self._recent.get(kind)
        if recent is not None and seconds:
            recent.extend(seconds)
            longest = max(seconds)
            if longest > self.peaks.get(kind, 0.0):
                self.peaks[kind] = longest

    def snapshot(self) -> dict[str, tuple[float, ...]]:
        """Recent intervals per kind, copied (safe to read while ``record`` runs)."""
        return {kind: tuple(recent) for kind, recent in self._recent.items()}

    def count(self, kind: str) -> int:
        """Recent intervals held for ``kind``."""
        return len(self._recent[kind])

    def state_dict(self) -> dict[str, Any]:
        """Plain values (lists of floats) to save with a checkpoint."""
        return {
            "version": 1,
            "recent": {str(k): [round(s, 6) for s in r] for k, r in self._recent.items() if r},
            "peaks": {str(kind): seconds for kind, seconds in self.peaks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Replaces the intervals with saved ones; returns whether ``state`` held any."""
        if not state or state.get("version") != 1:
            return False
        for kind, values in state.get("recent", {}).items():
            if kind in self._recent:
                self._recent[kind].clear()
                self._recent[kind].extend(float(v) for v in values)
        self.peaks = {k: float(v) for k, v in state.get("peaks", {}).items() if k in self._recent}
        return any(self._recent.values())


def _round_up(seconds: float) -> float:
    """To 0.1 s below 10 s, else to whole seconds, up (never below what was computed)."""
    if seconds < 10:
        return math.ceil(round(seconds * 10, 6)) / 10
    return float(math.ceil(round(seconds, 6)))


def _own(values: Sequence[float], peak: float, factor: float) -> float:
    return max(factor * quantile(values, QUANTILE), HEADROOM * peak)


def calibrate(
    history: IntervalHistory,
    ceilings: Mapping[str, float],
    *,
    factor: float,
    floor_s: float,
    save_estimate: float | None = None,
) -> dict[str, Deadline]:
    """Each calibrated kind's deadline from the intervals seen.

    The rules: docs/hang.md#how-the-deadlines-are-calibrated.

    Args:
        history: The intervals seen.
        ceilings: The configured (or NCCL-fitted) deadline per kind, the upper bound.
        factor: Multiple of the 99th percentile.
        floor_s: The lowest deadline.
        save_estimate: Derived deadline of a checkpoint save (see
            :func:`save_estimate_s`), ``None`` when the model is unknown.

    Returns:
        A :class:`Deadline` per kind of :data:`CALIBRATED_KINDS`.

    Example::

        history = IntervalHistory()
        for seconds in (0.05,) * 40:
            history.record("train", seconds)
        calibrate(history, {"train": 600.0, ...}, factor=10, floor_s=30)["train"]
        # Deadline(seconds=30.0, source='floor')
    """
    recent = history.snapshot()
    peaks = history.peaks
    train, evals = recent[Phase.TRAIN], recent[Phase.EVAL]
    base = quantile(train, QUANTILE) if len(train) >= MIN_SAMPLES else None
    eval_q = quantile(evals, QUANTILE) if evals else 0.0
    unseen = UNSEEN_FACTOR * factor
    derived = {
        Phase.TRAIN: None,
        Phase.DATA: None if base is None else unseen * base,
        Phase.EVAL: None if base is None else unseen * base,
        Phase.POST_EVAL: None if base is None else unseen * (base + eval_q),
        Phase.CHECKPOINT: save_estimate,
    }
    deadlines = {}
    for kind in CALIBRATED_KINDS:
        ceiling, values, fallback = ceilings[kind], recent[kind], derived[kind]
        fallback = ceiling if fallback is None else fallback
        if len(values) >= MIN_SAMPLES:
            seconds, source = _own(values, peaks.get(kind, 0.0), factor), "calibrated"
        elif values:
            own = _own(values, peaks.get(kind, 0.0), factor)
            seconds, source = max(own, fallback), "calibrated" if own >= fallback else "derived"
        else:
            seconds, source = fallback, "derived"
        seconds = _round_up(seconds)
        if seconds < floor_s:
            seconds, source = floor_s, "floor"
        if seconds >= ceiling:
            seconds, source = ceiling, "ceiling"
        deadlines[kind] = Deadline(seconds, source)
    return deadlines


def describe(deadlines: Mapping[str, Deadline]) -> str:
    """One line, e.g. ``"train 30 s (floor), eval 42 s (calibrated), ..."`` (seconds rounded up)."""
    return ", ".join(
        f"{KIND_LABELS[kind]} {d.seconds:g} s ({d.source})" for kind, d in deadlines.items()
    )
