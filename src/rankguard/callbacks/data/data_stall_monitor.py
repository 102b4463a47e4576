"""DataStallMonitor: how long each rank waits for its next batch, and who is starved.

Its cross-rank verdict is in :mod:`rankguard.callbacks.data.stall`.
See docs/data.md#how-datastallmonitor-works.
"""

from __future__ import annotations

import logging
import math
from functools import partial

from rankguard.callbacks.core import step_log
from rankguard.callbacks.core.background_exchange import AUTO_INTERVAL, PartPending
from rankguard.callbacks.core.errors import DataStallError, RanksMissingError
from rankguard.callbacks.core.events import Event, EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.settings import check_fraction, check_int
from rankguard.callbacks.core.step_log import (
    BATCH_END_FETCH_START,
    BATCH_START,
    FETCH_END,
    FETCH_END_BATCH_START,
    FETCH_START,
    Entry,
)
from rankguard.callbacks.data.data_fetch import LoaderReturnClock
from rankguard.callbacks.data.data_worker import worker_failure
from rankguard.callbacks.data.loaders import loader_settings
from rankguard.callbacks.data.stall import (
    IntervalStats,
    StallVerdict,
    describe_raise,
    describe_stall,
    stall_verdict,
)

__all__ = ["EARLY_POSTS", "DataStallMonitor"]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.data_stall")

#: The train batches of the fit's first exchanges, before the first ``interval`` ends: a
#: loader starved from its first batch is named by its third to fifth (one that dies at
#: its eighth is named before it does). Each is one exchange: a handful per fit.
EARLY_POSTS = (3, 6, 12, 24)
#: The store key (under the channel's prefix) where a rank whose loader raised leaves
#: what was measured, read by the other ranks' error reports.
RAISED_KEY = "data_stall_monitor/loader_raised"
#: What each step-log kind this monitor reads does: opens a fetch window, closes one,
#: starts a train batch (a fetch that ends as its batch starts does both of the last).
_OPENS, _CLOSES, _STARTS = 1, 2, 4
_ROLES = {
    FETCH_START: _OPENS,
    BATCH_END_FETCH_START: _OPENS,
    FETCH_END: _CLOSES,
    BATCH_START: _STARTS,
    FETCH_END_BATCH_START: _CLOSES | _STARTS,
}


class DataStallMonitor(Guard):
    """Measures per-rank data-wait time and reports ranks starved of data.

    Metrics, logged by every rank at each interval's verdict (a key is left out
    when nothing was measured in that interval):

    =====================================  ==================================================
    key                                    value
    =====================================  ==================================================
    ``rankguard/data_wait_s``              this rank's mean wait per batch over the interval (s)
    ``rankguard/data_wait_fraction``       this rank's wait / step time over the interval
    ``rankguard/data_wait_fraction_max``   the largest ``data_wait_fraction`` of any rank
    ``rankguard/data_wait_slowest_rank``   the rank with that largest fraction
    =====================================  ==================================================

    Args:
        on_violation: ``"warn"`` (default) logs a warning; ``"raise"`` raises
            :class:`DataStallError` on every rank.
        threshold: Wait fraction of a step above which the step is slow,
            in (0, 1].
        window: Consecutive slow steps that make a stall (>= 1).
        interval: Train batches between cross-rank exchanges and metric logs
            (>= 1). ``None`` (default): 50, or at fast steps the smallest multiple
            of 50 that lasts 5 s (every rank agrees on it at each exchange), so an
            exchange costs a step nothing noticeable however short the step.

    Raises:
        ValueError: A setting out of range.
        DataStallError: A rank was starved of data for ``window`` steps (``on_violation="raise"``).

    Example::

        monitor = DataStallMonitor(threshold=0.5, window=10)
        # Composer: BEFORE_DATALOADER/AFTER_DATALOADER/BATCH_START, in the step log.
    """

    name = "data_stall_monitor"
    step_events = (Event.DATA_FETCH_START, Event.DATA_FETCH_END, Event.TRAIN_BATCH_START)

    def __init__(
        self,
        *,
        on_violation: str = "warn",
        threshold: float = 0.5,
        window: int = 10,
        interval: int | None = None,
    ) -> None:
        super().__init__(on_violation=on_violation)
        self.threshold = check_fraction("threshold", threshold, one=True)
        self.window = check_int("window", window)
        #: Whether rankguard stretches the interval at fast steps (``interval=None``).
        self.auto_interval = interval is None
        self.interval = check_int("interval", AUTO_INTERVAL if interval is None else interval)
        self._decide = partial(stall_verdict, window=self.window, threshold=self.threshold)
        self.batch_size: int | None = None
        self._clock = LoaderReturnClock()
        self._pending: PartPending | None = None
        #: Train batches the log's reader has seen start in this fit.
        self._started = 0
        #: Each interval's totals, closed by the reader at the batch that ends it, until posted.
        self._closed: dict[int, IntervalStats] = {}
        self._posted_at = 0  # the train batch of the last interval posted
        self._next_interval(self._first_post())
        self._reset_fit()
        self._reset_interval(run=0)
        self._discard()
        self._reported: frozenset[int] = frozenset()
        #: Whether the clock can watch the train loader (a DataLoader).
        self._can_watch = False

    def _next_interval(self, batch: int) -> None:
        """The next interval ends at train batch ``batch`` (a multiple of ``interval``).

        The reader closes an interval at a multiple of ``interval`` from ``batch`` on;
        it is set once the last interval's verdict is in, before the reader can reach
        the next multiple.
        """
        self._close_from = self._post_at = self.due = batch

    def _first_post(self) -> int:
        """The fit's first exchange: the first early one, or the interval's end."""
        return min(EARLY_POSTS[0], self.interval)

    def _after(self, pending: PartPending) -> int:
        """The exchange after the one just collected: the next early one, then intervals."""
        posted = self._posted_at
        early = [b for b in (*EARLY_POSTS, self.interval) if posted < b <= self.interval]
        if early:
            return early[0]
        return pending.next_post(posted, self.interval, self.auto_interval)

    def _reset_fit(self) -> None:
        """The fit's totals (read on whichever thread reads the log) and the last verdict."""
        self._fit_wait = self._fit_step = 0.0
        self._fit_steps = self._fit_slow = 0
        self._last_verdict: StallVerdict | None = None
        self._last_verdict_at = 0

    def _reset_interval(self, run: int) -> None:
        self._sum_wait = 0.0
        self._sum_step = 0.0
        self._steps = 0
        self._run = run
        self._longest = run

    def _discard(self) -> None:
        """Forgets the step in progress (not measured across it)."""
        self._fetch_start: float | None = None
        self._saving = False  # a save paused the fetch window: it opens again at its end
        self._wait = 0.0
        self._exact = True
        self._last_start: float | None = None

    def on_fit_start(self, facts: EventFacts) -> None:
        """Starts measuring; reads the train batch size for samples/s."""
        train = next((lf for lf in facts.loaders if lf.is_train), None)
        self.batch_size = loader_settings(train.loader).batch_size if train else None
        self._can_watch = train is not None and self._clock.can_watch(train.loader)
        self._reported = frozenset()
        self._watch(False)
        self._started = 0
        self._closed = {}
        self._reset_fit()
        self._reset_interval(run=0)
        self._discard()
        self._pending = None
        self._next_interval(self._first_post())

    def read_steps(self, entries: list[Entry]) -> None:
        """Reads the fetch windows and train batch starts from the step log.

        A step runs from a train batch's start to the next one's; its wait is the
        fetch window between them, which ends at the loader's return where the
        window was watched (Composer's also holds a collective: see ``_watch``).
        The start of every ``interval``-th batch closes the interval's totals,
        whichever thread reads the log (the exchange thread posts them).
        """
        watched = self.steps.watched
        for at, event, step, _, loader, _ in entries:
            role = _ROLES.get(event)
            if role is None:
                continue
            if role == _OPENS:
                self._fetch_start = at
                # Given the loader, the window also holds a collective: only its return is ours.
                self._exact = loader is None or not self._can_watch
                continue
            if role & _CLOSES:
                if self._fetch_start is not None:
                    self._wait += max(0.0, at - self._fetch_start)
                    self._fetch_start = None
                if step in watched:  # ended at the loader's return (or could not be watched)
                    watched.discard(step)
                    self._exact = True
            if role & _STARTS:
                last = self._last_start
                if last is not None:
                    step_s, wait = at - last, self._wait
                    if wait <= self.threshold * step_s and self.steps.fetch_clock is None:
                        # The usual step: not slow, the loader not watched (``_close_step``).
                        self._sum_step += step_s
                        self._sum_wait += wait
                        self._steps += 1
                        self._run = 0
                        self._fit_step += step_s
                        self._fit_wait += wait
                        self._fit_steps += 1
                    else:
                        self._close_step(step_s)
                self._wait = 0.0
                self._last_start = at
                self._started += 1
                since = self._started - self._close_from
                if since >= 0 and since % self.interval == 0:
                    self._closed[self._started] = self._interval_totals()

    def on_due(self, batches: int) -> None:
        """Acts on the last verdict; at the interval's end, posts it."""
        if self._pending is not None and not self.verdict_late(self._pending, batches):
            self._collect()
        if batches >= self._post_at:
            self._post(batches)
        self.due = batches + 1 if self._pending is not None else self._post_at

    def _watch(self, on: bool) -> None:
        """Times the next fetch windows to the loader's return (``on``), or not."""
        self.steps.fetch_clock = self._clock if on and self._can_watch else None

    def _close_step(self, step: float) -> None:
        slow = self._wait > self.threshold * step
        if slow and not self._exact:
            self._watch(True)  # maybe another rank's fetch: time the next one exactly
            return
        self._watch(slow)
        self._sum_step += step
        self._sum_wait += self._wait
        self._steps += 1
        self._fit_step += step
        self._fit_wait += self._wait
        self._fit_steps += 1
        if slow:
            self._fit_slow += 1
            self._run += 1
            self._longest = max(self._longest, self._run)
        else:
            self._run = 0

    def on_epoch_start(self, facts: EventFacts) -> None:
        """Does not measure across the epoch boundary."""
        self._discard()

    def on_eval_start(self, facts: EventFacts) -> None:
        """Does not measure across evaluation."""
        self._discard()

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """A save inside the fetch window is no wait for data: the window pauses over it.

        Lightning's ``ModelCheckpoint`` and the HF Trainer save after the hooks that end
        the batch, where the window opens. The log is read to here (every event but a
        per-step one drains it first), so the window open now is this step's.
        """
        if self._fetch_start is not None:
            self._wait += max(0.0, step_log.perf_counter() - self._fetch_start)
            self._fetch_start, self._saving = None, True

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        """The fetch window a save paused opens again."""
        if self._saving:
            self._fetch_start, self._saving = step_log.perf_counter(), False

    def on_error(self, exc: BaseException, facts: EventFacts | None = None) -> bool:
        """Explains a loader that failed: a dead worker, or an error raised while fetching.

        Logs, with this rank and step, why the loader failed (a worker that died) and
        what rankguard measured of its waits before it did, against the other ranks'
        at the last exchange. Adapters call this from their exception hook; it never raises.

        Args:
            exc: The exception the framework is about to propagate.
            facts: The facts of the last event, for the step.

        Returns:
            Whether ``exc`` was recognised as a data-loader failure.
        """
        step = facts.step if facts is not None else self.steps.batches
        reason: str | None = None
        # torch's SIGCHLD handler raises (once per dead worker) wherever this thread is: while
        # the error is explained, or while it is logged. Either way, explain and log again.
        for _ in range(3):
            try:
                reason = reason or worker_failure(exc)
                measured = self._measured(reason is not None)
                if reason is None and measured is None:
                    return False
                if reason is None:
                    logger.error("rankguard %s: %s", self.name, measured)
                    return True
                logger.error(
                    "rankguard %s: rank %d, step %d: %s%s",
                    self.name,
                    self.channel.rank,
                    step,
                    reason,
                    "" if measured is None else f" {measured}",
                )
                return True
            except Exception as late:
                reason = reason or worker_failure(late)
        return False

    def _measured(self, worker: bool) -> str | None:
        """What the fit measured before a loader error, if it came out of the loader.

        ``None`` where no train fetch was open (the error came from elsewhere) and no
        worker died, or where a dead worker's rank had measured nothing yet.
        """
        try:
            self.steps.drain()
        except Exception:  # never mask the error being explained
            logger.debug("rankguard: could not read the step log", exc_info=True)
        verdict = self._last_verdict
        if worker and not self._fit_steps and verdict is None:
            return None
        if not worker and self._fetch_start is None:
            return self._peer_failure()  # not raised while fetching: maybe another's loader
        message = describe_raise(
            self.channel.rank,
            self._started + 1,
            self._fit_totals(),
            None if verdict is None else verdict.others_wait_s,
            self._last_verdict_at if verdict is not None else None,
        )
        self._share(message)
        return message

    def _share(self, message: str) -> None:
        """Leaves a loader failure in the store, for the other ranks' error reports."""
        store = self.channel.store
        if store is not None:
            try:
                store.set(f"{self.channel.prefix}/{RAISED_KEY}", message)
            except Exception:  # the store's host may be gone with the job
                logger.debug("rankguard: could not share a loader failure", exc_info=True)

    def _peer_failure(self) -> str | None:
        """Another rank's loader failure (shared in the store), or the last verdict's stall."""
        store = self.channel.store
        if store is not None:
            key = f"{self.channel.prefix}/{RAISED_KEY}"
            try:
                if store.check([key]):
                    shared = store.get(key).decode()
                    return f"this rank's error follows another rank's loader failure: {shared}"
            except Exception:
                logger.debug("rankguard: could not read a shared loader failure", exc_info=True)
        verdict = self._last_verdict
        if verdict is None or not verdict.stalled:
            return None
        stalled = ", ".join(
            f"rank {r} {s.wait_per_batch:.2f} s per batch" for r, s in verdict.detailed.items()
        )
        rest = verdict.undetailed
        if rest > 0:
            stalled += f" and {rest:,} more ranks"
        return (
            f"at the data-wait exchange of batch {self._last_verdict_at}, {stalled} waited "
            f"for data (other ranks {verdict.others_wait_s:.2f} s): if this error is a "
            f"collective that lost a peer, look for that rank's loader error in its log."
        )

    def _fit_totals(self) -> IntervalStats:
        """This rank's waits over the fit's measured steps."""
        return IntervalStats(
            self._fit_wait,
            self._fit_step,
            self._fit_steps,
            self._longest,
            self.batch_size,
            self._fit_steps,
            self._fit_slow,
        )

    def on_fit_end(self, facts: EventFacts) -> None:
        """Acts on the last interval's exchange, so its report and metrics are not lost."""
        if self._pending is not None:
            self._collect()

    def close(self) -> None:
        """Stops watching the loader; safe to call twice, after an error."""
        self._watch(False)
        self._clock.disarm()
        self._pending = None

    def _interval_totals(self) -> IntervalStats:
        """The totals since the last interval closed; the next interval starts from zero."""
        stats = IntervalStats(
            self._sum_wait,
            self._sum_step,
            self._steps,
            self._longest,
            self.batch_size,
            self._fit_steps,
            self._fit_slow,
        )
        self._reset_interval(run=self._run)
        return stats

    def _posted(self, batches: int) -> IntervalStats:
        """The interval that ended at batch ``batches``: reads the log to its start first.

        Runs on the exchange thread, so reading the interval's steps costs the
        training thread nothing.
        """
        stats = self.steps.take_closed(self._closed, batches)
        if stats is None:  # never read: an empty interval, so every rank still exchanges
            stats = IntervalStats(
                0.0, 0.0, 0, self._run, self.batch_size, self._fit_steps, self._fit_slow
            )
        return stats

    def _post(self, batches: int) -> None:
        """Hands the interval that ends here to the exchange thread; the verdict comes next batch.

        The exchange thread reads the log up to this batch's start (:meth:`_posted`).
        """
        self._pending = self._runner.intervals.post(
            self.channel, batches, self.name, partial(self._posted, batches), self._decide
        )
        self._posted_at, self._post_at = batches, math.inf  # the next: set by the verdict

    def _collect(self) -> None:
        """Acts on the posted exchange's verdict (waits for it if it has not arrived)."""
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            verdict: StallVerdict = pending.result()
        except RanksMissingError as missing:
            self.warn_once("missing", "skipping a data-wait exchange: %s", missing)
            return
        except Exception as exc:  # never turn a healthy run into a failed one
            self.skip_failed("a data-wait exchange", exc)
            return
        finally:
            self._next_interval(self._after(pending))
        self._last_verdict, self._last_verdict_at = verdict, self._posted_at
        stats: IntervalStats = pending.payload
        metrics: dict[str, float] = {}
        if verdict.slowest_rank >= 0:  # some rank measured a step
            metrics["rankguard/data_wait_fraction_max"] = verdict.fraction_max
            metrics["rankguard/data_wait_slowest_rank"] = float(verdict.slowest_rank)
        if stats.steps:
            metrics["rankguard/data_wait_s"] = stats.wait_s / stats.steps
            metrics["rankguard/data_wait_fraction"] = stats.fraction or 0.0
        if metrics:
            self.log_metrics(metrics)
        newly = set(verdict.stalled) - self._reported
        # A reported rank stays reported until it keeps up for a whole interval.
        self._reported = frozenset(verdict.stalled) | (self._reported - verdict.recovered)
        if newly:
            message = describe_stall(verdict, self.threshold, self.window)
            self.violation(DataStallError(message))
