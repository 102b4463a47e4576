"""StragglerMonitor: names the rank or node whose compute makes every other rank wait.

Holds :class:`StragglerMonitor`, the guard; the scores are in ``score``,
the forward timing in ``forward_clock``.
See docs/straggler.md#how-stragglermonitor-works.
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from functools import partial

import torch

from rankguard.callbacks.core.background_exchange import AUTO_INTERVAL, PartPending
from rankguard.callbacks.core.errors import RanksMissingError, StragglerError
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.nodes import node_identity
from rankguard.callbacks.core.settings import check_fraction, check_int, check_seconds
from rankguard.callbacks.core.step_log import (
    BATCH_END,
    BATCH_END_FETCH_START,
    BATCH_START,
    FETCH_END_BATCH_START,
    Entry,
)
from rankguard.callbacks.straggler.forward_clock import ForwardClock
from rankguard.callbacks.straggler.score import (
    RankTimes,
    StragglerVerdict,
    advance_streaks,
    describe_straggler,
    straggler_verdict,
)

__all__ = ["StragglerMonitor"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.straggler")


def _median(values: list[float]) -> float | None:
    """The median (a sort: ``statistics.median`` costs 3x as much per interval)."""
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class StragglerMonitor(Guard):
    """Names the rank or node whose compute is slower than the others', every rank waiting for it.

    Metrics, logged by every rank when an interval's verdict arrives:

    ========================================  ==============================================
    key                                       value
    ========================================  ==============================================
    ``rankguard/straggler_score_min``         the lowest rank score (median rank's forward
                                              time / that rank's; 1.0 = as fast as the median)
    ``rankguard/straggler_rank``              the rank with that score
    ``rankguard/straggler_score``             this rank's score
    ``rankguard/straggler_forward_s``         this rank's median forward time per batch (s;
                                              the device's on CUDA)
    ``rankguard/straggler_node_score_min``    the lowest node score (2 or more nodes only)
    ``rankguard/straggler_node``              that node's index, nodes ordered by lowest rank
    ========================================  ==============================================

    Args:
        on_violation: ``"warn"`` (default) logs a warning on every rank;
            ``"raise"`` raises :class:`~rankguard.callbacks.core.errors.StragglerError`
            on every rank at the same batch.
        threshold: A rank or node is slow while its score is below this, in
            (0, 1). 0.7: 1.43x the median rank's forward time.
        window: Consecutive slow intervals before it is reported (>= 1).
        interval: Train batches per interval: measured, exchanged and scored
            together (>= 1). ``None`` (default): 50, or at fast steps the
            smallest multiple of 50 that lasts 5 s (every rank agrees on it at
            each exchange), so an exchange costs a step nothing noticeable
            however short the step.
        warmup_steps: Train batches at the start of each fit that are not
            measured (>= 0).
        timed_batches: Train batches per interval whose forward is timed, the
            interval's last ones (>= 1; of a stretched interval, the last ones
            of its last 50): the forward hooks are on the model for those
            batches only. Every batch when ``interval`` is at most this.
        min_excess_s: A score below ``threshold`` names a rank or node only when
            its forward takes at least this much longer per batch than the one
            it is scored against (seconds, >= 0): smaller gaps are scheduling
            noise, however large the ratio.
        min_forward_s: Deprecated (a floor on the median rank's own forward
            time, which left a rank 200x slower than a fast reference unnamed);
            ``min_excess_s`` replaces it. ``None`` (default) or 0: every interval
            is scored; a value > 0 keeps its old meaning (intervals whose median
            forward time per batch is below it are not scored) and warns once
            with a ``FutureWarning``.

    Errors: :class:`~rankguard.callbacks.core.errors.StragglerError` (with
    ``on_violation="raise"``). A model whose forward cannot be hooked, or whose
    hooked modules never run (compiled in place), is said once at INFO; the
    monitor then stays off for that fit.

    Raises:
        ValueError: A setting out of range.
        StragglerError: A rank or node stayed slow for ``window`` intervals
            (``on_violation="raise"``).

    Example::

        monitor = StragglerMonitor(threshold=0.7, window=3)
        # Composer: Trainer(..., callbacks=[rankguard.integrations.composer.StragglerMonitor()])
    """

    name = "straggler_monitor"
    step_events = (Event.TRAIN_BATCH_START, Event.TRAIN_BATCH_END)

    def __init__(
        self,
        *,
        on_violation: str = "warn",
        threshold: float = 0.7,
        window: int = 3,
        interval: int | None = None,
        warmup_steps: int = 20,
        timed_batches: int = 8,
        min_excess_s: float = 0.001,
        min_forward_s: float | None = None,
    ) -> None:
        super().__init__(on_violation=on_violation)
        self.threshold = check_fraction("threshold", threshold, one=False)
        self.window = check_int("window", window)
        #: Whether rankguard stretches the interval at fast steps (``interval=None``).
        self.auto_interval = interval is None
        self.interval = check_int("interval", AUTO_INTERVAL if interval is None else interval)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.timed_batches = check_int("timed_batches", timed_batches)
        #: The first place in an interval (batch % interval) whose batch is timed.
        self._timed_from = self.interval - self.timed_batches
        #: Where in an interval (batch % interval) the hooks go on (True) or off, and how
        #: many batches until the next such place.
        self._switches = self._schedule()
        self.min_excess_s = check_seconds("min_excess_s", min_excess_s)
        self.min_forward_s = (
            None if min_forward_s is None else check_seconds("min_forward_s", min_forward_s)
        )
        if self.min_forward_s:
            warnings.warn(
                "StragglerMonitor's `min_forward_s` is deprecated: noise is now judged on "
                "the gap (`min_excess_s`, seconds of excess per batch). Remove "
                "`min_forward_s`; set to a value > 0 it still keeps intervals whose median "
                "forward is below it from being scored.",
                FutureWarning,
                stacklevel=2,
            )
        #: The interval exchange's decision over every rank's times (the settings are fixed).
        self._decide = partial(
            straggler_verdict,
            threshold=self.threshold,
            min_excess_s=self.min_excess_s,
            min_forward_s=self.min_forward_s or 0.0,
        )
        self._clock = ForwardClock()
        #: The batch after which only the hooked modules the loop called keep their hooks.
        self._learned_at = max(1, self.warmup_steps)
        self._reset()

    def _reset(self) -> None:
        self._on = False
        self._node = ""
        self._batches = 0
        self._pending: PartPending | None = None
        self._collect_at = math.inf
        #: The train batch the next interval ends at (a multiple of ``interval``, set by
        #: the last verdict; ``inf`` while it is awaited), and from which the reader
        #: closes one (the last posted until that verdict is in).
        self._post_at: float = self.interval
        self._close_from = self.interval
        self._last_closed = 0  # the last batch the reader closed an interval at
        self._posted_at = 0
        self._span = self.interval
        self._posted: RankTimes | None = None
        self._verdicts = 0
        self._forward: list[float] = []
        self._rest: list[float] = []
        self._between: list[float] = []
        #: Each interval's samples, closed by the reader at the batch that ends it, until posted.
        self._closed: dict[int, tuple[list[float], list[float], list[float]]] = {}
        self._baseline_samples: list[float] = []
        self._baseline: float | None = None
        self._streaks: dict[tuple[str, str], int] = {}
        self._started: float | None = None
        self._ended: float | None = None
        self.due = math.inf

    # --- events ------------------------------------------------------------------------------

    def on_fit_start(self, facts: EventFacts) -> None:
        """Hooks the model's forward and starts measuring."""
        self._stop()
        self._reset()
        model = facts.model
        try:
            hooked = self._clock.attach(model) if isinstance(model, torch.nn.Module) else 0
        except Exception as exc:  # never turn a healthy run into a failed one
            logger.info(
                "rankguard %s: cannot hook the model's forward (%s: %s); the monitor is off "
                "for this fit",
                self.name,
                type(exc).__name__,
                exc,
            )
            return
        if not hooked:
            logger.info(
                "rankguard %s: the model (%s) is not a torch.nn.Module with a forward to "
                "time; the monitor is off for this fit",
                self.name,
                type(model).__name__,
            )
            return
        self._node = node_identity().key
        self._on = True
        self.due = min(self.interval, self._learned_at + 1)

    def read_steps(self, entries: list[Entry]) -> None:
        """Reads train batch starts and ends from the step log: forward, rest and gap per batch.

        The start of every ``interval``-th batch closes the interval's samples,
        whichever thread reads the log (the exchange thread posts them).
        """
        if not self._on:
            return
        for at, event, _, _, _, _ in entries:
            if event == FETCH_END_BATCH_START or event == BATCH_START:
                if self._ended is not None:
                    self._between.append(at - self._ended)
                    self._ended = None
                self._batches = batch = self._batches + 1
                self._started = at
                if batch % self.interval == 0 and batch >= self._close_from:
                    self._closed[batch] = self._samples()
                    self._last_closed = batch
            elif (event == BATCH_END or event == BATCH_END_FETCH_START) and (
                self._started is not None
            ):
                started, self._started = self._started, None
                batch = self._batches
                if batch > self.warmup_steps and (
                    batch <= self._learned_at
                    or (
                        batch % self.interval >= self._timed_from
                        and (
                            self._close_from <= self._last_closed
                            or batch >= self._close_from - self.interval
                        )
                    )
                ):  # measured (``_timed_now``, inline; the next close not set: as hooked)
                    forward = self._clock.close_batch(started, at)
                    # The rest: the batch's host time outside its forwards' host time.
                    self._rest.append(at - started - forward)
                    self._ended = at
                elif self._clock.spans:  # forwards of a batch not measured (warm-up): dropped
                    self._clock.close_batch(started, at, keep=False)

    def on_due(self, batches: int) -> None:
        """Collects and posts exchanges when due; hooks the model for the timed batches.

        Until the batch after warm-up every batch is hooked; that batch keeps only the
        hooks of the modules the loop called, and from then on the hooks are on for
        the timed batches only (:meth:`_timed`).
        """
        if batches >= self._collect_at and not self.verdict_late(self._pending, batches):
            self._collect()
            if not self._on:
                self.due = math.inf
                return
        if batches == self._learned_at + 1:  # warm-up showed which hooked modules the loop calls
            self._clock.keep_entered()
            if self._switches:  # only some batches are timed: the log's switch hooks them
                self._clock.arm(self._timed_now(batches))
                self.steps.switch = self._switch
                self.steps.switch_at = self._next_switch(batches)
        if batches >= self._post_at:
            self._post(batches)
        self.due = min(self._collect_at, self._post_at)
        if batches <= self._learned_at:
            self.due = min(self.due, self._learned_at + 1)

    def _timed(self, batch: int) -> bool:
        """Whether train batch ``batch`` (from 1) has its forward timed."""
        # The interval's last ones, in one run: the hooks go on and off once an interval.
        return batch % self.interval >= self._timed_from

    def _timed_now(self, batch: int) -> bool:
        """:meth:`_timed`, in the last ``interval`` batches of the interval in progress.

        An interval longer than ``interval`` (``interval=None`` at fast steps) times
        its last ``interval`` batches' last ``timed_batches``, as a short one does.
        """
        return self._timed(batch) and batch >= self._close_from - self.interval

    def _schedule(self) -> dict[int, tuple[bool, int]]:
        """The places in an interval where the timing changes: ``{position: (on, ahead)}``."""
        timed = [self._timed(position) for position in range(self.interval)]
        if all(timed):
            return {}  # every batch is timed: the hooks stay on
        changes = [p for p in range(self.interval) if timed[p] != timed[p - 1]]
        return {
            p: (timed[p], (changes[(i + 1) % len(changes)] - p) % self.interval or self.interval)
            for i, p in enumerate(changes)
        }

    def _switch(self, batch: int) -> float:
        """At a train batch's start (the step log's ``switch``): hooks on or off; the next batch."""
        on, ahead = self._switches[batch % self.interval]
        if on and batch < self._close_from - self.interval:
            return batch + self.interval  # not the last ``interval`` of a longer interval
        self._clock.arm(on)
        return batch + ahead

    def _next_switch(self, batch: int) -> float:
        """The first batch after ``batch`` where the timing changes."""
        position = batch % self.interval
        after = min(
            (p for p in self._switches if p > position), default=min(self._switches) + self.interval
        )
        return batch - position + after

    def on_epoch_start(self, facts: EventFacts) -> None:
        """The gap across an epoch boundary holds loader start-up: not measured."""
        self._ended = None

    def on_eval_start(self, facts: EventFacts) -> None:
        """The gap across evaluation is not measured, nor are evaluation's forwards timed."""
        self._ended = None
        self._clock.paused = True

    def on_eval_end(self, facts: EventFacts) -> None:
        """Training's forwards are timed again."""
        self._clock.paused = False

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """The gap across a checkpoint save is not measured."""
        self._ended = None

    def on_fit_end(self, facts: EventFacts) -> None:
        """Collects the last verdict, so its report and metrics are not lost."""
        if self._on and self._pending is not None:
            self._collect()

    def close(self) -> None:
        """Removes the hooks; safe to call twice."""
        self._stop()
        self._on = False

    def _stop(self) -> None:
        if self.steps.switch == self._switch:
            self.steps.switch, self.steps.switch_at = None, math.inf
        self._clock.detach()
        self._pending = None

    # --- exchange ----------------------------------------------------------------------------

    def _samples(self) -> tuple[list[float], list[float], list[float]]:
        """The samples since the last interval closed: forward, rest, gap; the next start empty.

        The forward times are those the clock has ready: on CUDA, the batches
        whose events have completed; the others join the next interval.
        """
        self._forward.extend(self._clock.ready())
        samples = self._forward, self._rest, self._between
        self._forward, self._rest, self._between = [], [], []
        return samples

    def _post(self, batches: int) -> None:
        """Hands the interval that ends here to the exchange thread, which summarizes it.

        The exchange thread reads the log up to this batch's start first, so reading
        the interval's batches costs the training thread nothing.
        """
        node, baseline = self._node, self._baseline

        def summarize() -> RankTimes:
            forward, rest, between = self.steps.take_closed(self._closed, batches) or ([], [], [])
            return RankTimes(
                node=node,
                steps=len(forward),
                forward_s=_median(forward) or 0.0,
                rest_s=_median(rest) or 0.0,
                between_s=_median(between),
                baseline_s=baseline,
            )

        self._pending = self._runner.intervals.post(
            self.channel, batches, self.name, summarize, self._decide
        )
        self._collect_at = batches + max(1, self.interval // 2)
        self._span, self._posted_at = batches - self._posted_at, batches
        self._post_at = math.inf  # the next: set by the verdict

    def _collect(self) -> None:
        pending, self._pending = self._pending, None
        self._collect_at = math.inf
        if pending is None:
            return
        try:
            verdict: StragglerVerdict = pending.result()
        except RanksMissingError as missing:
            self.warn_once("missing", "skipping a straggler exchange: %s", missing)
            return
        except Exception as exc:
            self.skip_failed("a straggler exchange", exc)
            return
        finally:  # the reader is not past the next multiple of ``interval`` yet
            self._close_from = self._post_at = pending.next_post(
                self._posted_at, self.interval, self.auto_interval
            )
        self._posted = pending.payload
        if not verdict.steps:  # every batch of the interval was warm-up
            return
        self._verdicts += 1
        if verdict.reference is None and self._verdicts == 1:
            # Batches were measured, but no rank's hooked modules ran a forward in them:
            # every rank got this verdict and turns off together.
            logger.info(
                "rankguard %s: no forward pass of the hooked modules ran in the %d train "
                "batches measured (a model compiled in place, or a loop that calls none of "
                "them); the monitor is off for this fit",
                self.name,
                verdict.steps,
            )
            self._stop()
            self._on = False
            return
        if verdict.scored:
            self._log(verdict)
            self._learn_baseline()
            self._judge(verdict)

    def _log(self, verdict: StragglerVerdict) -> None:
        metrics = {
            "rankguard/straggler_score_min": verdict.score_min,
            "rankguard/straggler_rank": float(verdict.slowest_rank),
        }
        mine = self._posted
        if mine is not None and mine.steps and mine.forward_s > 0 and verdict.reference:
            metrics["rankguard/straggler_score"] = verdict.reference.forward_s / mine.forward_s
            metrics["rankguard/straggler_forward_s"] = mine.forward_s
        if verdict.node_score_min is not None and verdict.slowest_node is not None:
            metrics["rankguard/straggler_node_score_min"] = verdict.node_score_min
            metrics["rankguard/straggler_node"] = float(verdict.slowest_node)
        self.log_metrics(metrics)

    def _learn_baseline(self) -> None:
        """This rank's own forward time over its first ``window`` scored intervals."""
        mine = self._posted
        if self._baseline is None and mine is not None and mine.steps and mine.forward_s > 0:
            self._baseline_samples.append(mine.forward_s)
            if len(self._baseline_samples) >= self.window:
                self._baseline = statistics.median(self._baseline_samples)

    def _judge(self, verdict: StragglerVerdict) -> None:
        self._streaks, named = advance_streaks(self._streaks, verdict.slow, self.window)
        if not named or verdict.reference is None:
            return
        reference = verdict.reference
        message = "\n".join(
            describe_straggler(
                s, reference, threshold=self.threshold, window=self.window, interval=self._span
            )
            for s in named
        )
        self.violation(StragglerError(message))
