"""ReplicaGuard: ranks that should hold equal copies of the model do, and say which do not.

Holds :class:`ReplicaGuard`, the guard; which ranks are replicas is in ``layout``, the
fingerprints in ``prints``, the decisions and words in ``verdict``.
See docs/replica.md#how-replicaguard-works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from rankguard.callbacks.core.background_exchange import AUTO_INTERVAL, Decide, PartPending
from rankguard.callbacks.core.errors import RanksMissingError, ReplicaDivergenceError
from rankguard.callbacks.core.events import EventFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.settings import check_choice, check_int
from rankguard.callbacks.replica.layout import ReplicaLayout, replica_layout
from rankguard.callbacks.replica.prints import Launched, ReplicaPrint, launch, sample
from rankguard.callbacks.replica.verdict import (
    Details,
    Evidence,
    ReplicaVerdict,
    SizePayload,
    WhichPayload,
    compare_prints,
    describe,
    difference_sizes,
    differing_tensors,
    likely_causes,
)

__all__ = ["ReplicaGuard"]

logger = logging.getLogger("rankguard.callbacks.replica")


@dataclass
class _Check:
    """One check in flight: where it was taken, and what this rank sent."""

    batches: int  # the train batches started in the fit when it was taken
    interval: bool  # at a train batch's start (else at an eval's or save's)
    step: int
    why: str
    launched: Launched | None
    sums: list[int] | None = None

    @property
    def trained(self) -> int:
        """Train batches of the fit whose steps it saw."""
        return self.batches - 1 if self.interval else self.batches

    def build(self) -> ReplicaPrint:
        """The print (on the exchange thread: it waits for the device's sums)."""
        if self.launched is None:
            raise RuntimeError("this rank could not fingerprint its tensors")
        replica_print, self.sums = self.launched.read(self.step)
        return replica_print


class ReplicaGuard(Guard):
    """Checks that ranks holding copies of the same parameters (replicas) still hold equal ones.

    At the first train batch and every ``interval``-th (the monitors' exchange batches), and
    at each eval's and save's start (acted on at its end), each rank reduces each of its
    parameters to one integer on the device it lives on (the sum of its bits) without
    waiting for the device; the exchange thread reads the sums back and compares a digest
    per replica set across its ranks. Which ranks are replicas comes from the job's
    structure: every rank of a ``DistributedDataParallel`` (or ``replicate``); for DTensor
    parameters (FSDP2, HSDP, tensor parallel), the ranks their mesh places them on with
    ``Replicate()``; none under pure FSDP sharding. The first check that finds replicas
    differing names the ranks by print, the step, the tensors that differ and by how much
    (two narrower exchanges), and the likely causes with their fixes.

    Metrics, logged by every rank when a check's verdict arrives:

    ======================================  ===============================================
    key                                     value
    ======================================  ===============================================
    ``rankguard/replica_sets_differing``    replica sets whose ranks differ (0: all equal)
    ======================================  ===============================================

    Args:
        on_violation: ``"raise"`` (default) raises
            :class:`~rankguard.callbacks.core.errors.ReplicaDivergenceError` on every
            rank; ``"warn"`` logs it once and stops checking for the fit.
        interval: Train batches between checks (>= 1). ``None`` (default): 50, or at
            fast steps the smallest multiple of 50 that lasts 5 s (every rank agrees on
            it at each exchange).
        replicas: ``"auto"`` (default): replicas as the job's structure says (above);
            plain parameters no data-parallel wrapper keeps in sync are not compared.
            ``"world"``: every rank holds the whole model (a data-parallel scheme of
            the job's own, over every rank).

    Errors: :class:`~rankguard.callbacks.core.errors.ReplicaDivergenceError` (with
    ``on_violation="raise"``). What each rank compares, and what it leaves out and
    why, is said once at INFO at fit start.

    Raises:
        ValueError: A setting out of range.
        ReplicaDivergenceError: Replicas differ (``on_violation="raise"``).

    Example::

        guard = ReplicaGuard(interval=100)
        # Lightning: Trainer(..., callbacks=[rankguard.integrations.lightning.ReplicaGuard()])
    """

    name = "replica_guard"

    def __init__(
        self, *, on_violation: str = "raise", interval: int | None = None, replicas: str = "auto"
    ) -> None:
        super().__init__(on_violation=on_violation)
        #: Whether rankguard stretches the interval at fast steps (``interval=None``).
        self.auto_interval = interval is None
        self.interval = check_int("interval", AUTO_INTERVAL if interval is None else interval)
        self.replicas = check_choice("replicas", replicas, ("auto", "world"))
        self._reset()

    def _reset(self) -> None:
        self._layout = ReplicaLayout()
        self._optimizer: Any = None
        self._pending: PartPending | None = None
        self._check: _Check | None = None
        self._post_at: float = math.inf
        self._collect_at: float = math.inf
        self._last_equal: int | None = None
        self._event_at = -1  # the train batches started at the last eval's or save's check
        self.due = math.inf

    # --- events ------------------------------------------------------------------------------

    def on_fit_start(self, facts: EventFacts) -> None:
        """Reads which ranks hold replicas of which tensors; the first check is at batch 1."""
        self._reset()
        if not self.channel.is_distributed:
            return
        try:
            self._layout = replica_layout(facts.model, facts.data_parallel, self.replicas)
        except Exception as exc:  # never turn a healthy run into a failed one
            logger.info("rankguard %s: cannot read the model's layout (%r): off", self.name, exc)
            return
        logger.info("rankguard %s: %s", self.name, self._layout.describe())
        if self._layout.sets:
            self._optimizer = facts.optimizer
            self._post_at = self.due = 1

    def on_due(self, batches: int) -> None:
        """Collects the check in flight and posts the next, when due."""
        if batches >= self._collect_at and not self.verdict_late(self._pending, batches):
            self._collect()
        if batches >= self._post_at and self._layout.sets:
            self._post(batches, self.steps.step, self._every(batches))
        self.due = min(self._collect_at, self._post_at)

    def on_eval_start(self, facts: EventFacts) -> None:
        """Checks at an eval's start (once for the loaders an eval starts together)."""
        self._at_event(facts, "at an eval's start")

    def on_checkpoint_save_start(self, facts: EventFacts) -> None:
        """Checks at a save's start: the checkpoint holds the replica it was taken from."""
        self._at_event(facts, "at a checkpoint save's start")

    def on_eval_end(self, facts: EventFacts) -> None:
        """Acts on the eval's check (before anything after the eval)."""
        self._collect_event()

    def on_checkpoint_save_end(self, facts: EventFacts) -> None:
        """Acts on the save's check."""
        self._collect_event()

    def on_fit_end(self, facts: EventFacts) -> None:
        """Acts on the check in flight."""
        self._collect()

    def close(self) -> None:
        """Drops the check in flight; safe to call twice."""
        self._reset()

    # --- checks --------------------------------------------------------------------------------

    def _every(self, batches: int) -> str:
        if batches == 1:
            return "at the first train batch's start"
        if self.interval == 1:
            return "at the check every train batch"
        every = f"{self.interval}+" if self.auto_interval else str(self.interval)
        return f"at the check every {every} train batches"

    def _at_event(self, facts: EventFacts, why: str) -> None:
        batches = self.steps.batches
        if not self._layout.sets or self._event_at == batches:
            return  # no train step since the last eval's or save's check: nothing changed
        self._collect()
        if not self._layout.sets:  # the check collected turned the guard off
            return
        self._event_at = batches
        self._post(batches, facts.step, why, interval=False)
        self._collect_at = min(self._collect_at, batches + 1)
        self.due = min(self._collect_at, self._post_at)

    def _next_post(self, pending: PartPending, batches: int) -> int:
        """After the first batch's check, the ``interval``-th batch; then as the verdict says.

        Multiples of ``interval``, as the monitors' exchanges: where they fall on one
        batch, one exchange carries them all.
        """
        if batches == 1:
            return max(2, self.interval)
        return pending.next_post(batches, self.interval, self.auto_interval)

    def _collect_event(self) -> None:
        if self._check is not None and not self._check.interval and self._pending is not None:
            self._collect()

    def _post(self, batches: int, step: int, why: str, *, interval: bool = True) -> None:
        """Launches the reductions on the device; the exchange thread reads and sends them."""
        try:
            launched: Launched | None = launch(self._layout.sets, self._optimizer)
        except Exception as exc:  # every rank still posts: the part fails on every rank
            logger.debug("rankguard %s: could not fingerprint: %r", self.name, exc)
            launched = None
        self._check = check = _Check(batches, interval, step, why, launched)
        self._pending = self._runner.intervals.post(
            self.channel, batches, self.name, check.build, compare_prints
        )
        if interval:
            self._collect_at = batches + max(1, self.interval // 2)
            self._post_at = math.inf  # the next: set when this one's verdict is in

    def _collect(self) -> None:
        pending, check = self._pending, self._check
        self._pending = None
        self._collect_at = math.inf
        if pending is None or check is None:
            return
        try:
            verdict: ReplicaVerdict = pending.result()
        except RanksMissingError as missing:
            self.warn_once("missing", "skipping a replica check: %s", missing)
            return
        except Exception as exc:
            self.skip_failed("a replica check", exc)
            return
        finally:
            if check.interval:
                self._post_at = self._next_post(pending, check.batches)
        self.log_metrics(
            {"rankguard/replica_sets_differing": float(len(verdict.differ) + verdict.more)}
        )
        if not verdict.differ:
            self._last_equal = verdict.step
            return
        self._report(verdict, check)

    def _report(self, verdict: ReplicaVerdict, check: _Check) -> None:
        """Names what differs (two narrower exchanges), then raises or warns once."""
        details = self._details(verdict, check)
        first = verdict.differ[0]
        which = details.which.get(first.key)
        steps_differ = bool(first.optimizer_steps) or (None if not first.steps_known else False)
        evidence = Evidence(
            kind=which.kind if which else "",
            steps_differ=steps_differ,
            before_training=check.trained == 0,
            never_equal=self._last_equal is None,
            share=which.differing / which.total if which and which.total else None,
        )
        message = describe(verdict, details, likely_causes(evidence), self._last_equal, check.why)
        if self.on_violation == "warn":  # said once: later checks would only repeat it
            logger.info("rankguard %s: no further checks in this fit", self.name)
            self._reset()
        self.violation(ReplicaDivergenceError(message))

    def _details(self, verdict: ReplicaVerdict, check: _Check) -> Details:
        """The two narrower exchanges: which tensors differ, then a sample of the first few.

        Every rank takes part in both (a rank that sends nothing sends ``None``), so a
        rank that cannot build its part leaves no other waiting.
        """
        reps = verdict.representatives()
        mine = [s for s in self._layout.sets if self.channel.rank in reps.get(s.key, ())]
        spans = check.launched.spans if check.launched else {}
        sums = check.sums or []

        def sums_of() -> WhichPayload:
            return {s.key: (s.kind, s.how, sums[spans[s.key]]) for s in mine if s.key in spans}

        which = self._narrower("which", sums_of, partial(differing_tensors, verdict=verdict))
        if which is None:
            return Details()

        def samples_of() -> SizePayload:
            return {
                s.key: [sample(s.names[i], s.tensors[i]) for i in which[s.key].indices]
                for s in mine
                if s.key in which
            }

        sizes = self._narrower("size", samples_of, partial(difference_sizes, verdict=verdict))
        return Details(which=which, sizes=sizes or {})

    def _narrower(self, name: str, build: Callable[[], Any], decide: Decide) -> Any:
        """One narrower exchange (``None`` where it failed: the message goes without it)."""
        try:
            payload = build() or None
        except Exception as exc:  # this rank still takes part, with nothing to say
            logger.debug("rankguard %s: could not build %s: %r", self.name, name, exc)
            payload = None
        try:
            return self.channel.exchange(f"{self.name}/{name}", payload, decide)
        except Exception as exc:
            logger.debug("rankguard %s: the %s exchange failed: %r", self.name, name, exc)
            return None
