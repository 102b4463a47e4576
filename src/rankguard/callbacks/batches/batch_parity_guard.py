"""BatchParityGuard: every rank runs the same number of batches of every loader.

Holds :class:`BatchParityGuard`, the guard, and its pure decisions
(:func:`count_mismatches`, :func:`pass_verdict`, :func:`planned_verdict`).
See docs/data.md#how-batchparityguard-works.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from rankguard.callbacks.batches.loader_passes import (
    DEFAULT_MAX_SAMPLES,
    LoaderYield,
    PassRun,
    count_batches,
    left_behind,
    yield_mismatches,
)
from rankguard.callbacks.core.errors import BatchCountMismatchError, RanksMissingError
from rankguard.callbacks.core.events import Event, EventFacts, LoaderFacts
from rankguard.callbacks.core.guard import Guard
from rankguard.callbacks.core.ranks import format_groups, rank_label
from rankguard.callbacks.core.settings import check_int, check_positive
from rankguard.callbacks.core.step_log import BATCH_END, BATCH_END_FETCH_START, Entry
from rankguard.callbacks.data.loaders import planned_batches, promised_batches

__all__ = [
    "BatchParityGuard",
    "EvalRun",
    "count_mismatches",
    "eval_run_mismatch",
    "pass_verdict",
    "planned_verdict",
]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.batch_parity")

Counts = dict[str, int | None]

FIX_PLANNED = (
    "Fix: give every rank the same number of batches: shard with a DistributedSampler "
    "(or the framework's default sampler) over a dataset of the same length on every rank, "
    "or set drop_last=True (DataLoader and DistributedSampler); for streaming data, use the "
    "same num_canonical_nodes, batch size and epoch size on every rank."
)
FIX_YIELD = (
    "Fix: make the sampler's (or batch sampler's) __len__ return what its __iter__ yields, "
    "on every rank; or shard with a DistributedSampler over a dataset of the same length on "
    "every rank."
)
FIX_LEFT = (
    "Fix: give every rank the same number of batches: split iterable or streaming data "
    "evenly across ranks (the same number of samples on every rank, dropping the remainder) "
    "and make the loader's __len__ say that number; for a custom sampler, make __len__ match "
    "what it yields."
)
FIX_ACTUAL = (
    "Fix: the loader's __len__ does not match what it yields, or it yields a different "
    "number of batches per rank (iterable/streaming data): make every rank yield the same "
    "number of batches, e.g. drop_last=True or an explicit per-rank sample count."
)


_NO_LOADER = -1  # the loader does not exist on that rank


def _describe(count: int | None) -> str:
    if count == _NO_LOADER:
        return "no such loader"
    if count is None:
        return "unknown count (no __len__)"
    return f"{count} batch" if count == 1 else f"{count} batches"


def count_mismatches(per_rank: Mapping[int, Counts]) -> dict[str, str]:
    """Finds loaders whose batch counts differ between ranks.

    Args:
        per_rank: For each rank, the batch count of each loader by name.

    Returns:
        For each loader whose counts differ, the grouped description, e.g.
        ``{"eval": "ranks 0,2: 2 batches; ranks 1,3: 4 batches"}``. Loaders
        with no known count on every rank are not compared.
    """
    names = sorted({name for counts in per_rank.values() for name in counts})
    mismatches: dict[str, str] = {}
    for name in names:
        counts = {rank: counts.get(name, _NO_LOADER) for rank, counts in per_rank.items()}
        if len(set(counts.values())) > 1:
            mismatches[name] = format_groups(counts, _describe)
    return mismatches


@dataclass(frozen=True)
class EvalRun:
    """What one rank's pass over an eval loader did.

    Attributes:
        ran: Batches that actually ran.
        promised: Batches the loader's ``__len__`` promised (capped by the
            framework's limit), or ``None`` for loaders without ``__len__``.
        exhausted: Whether the loader's iterator ran out (``None``: not seen).
        yielded: Batches its iterator returned (``None``: not seen).
        total: Batches counted before the pass (``None``: not counted).
    """

    ran: int
    promised: int | None
    exhausted: bool | None = None
    yielded: int | None = None
    total: int | None = None

    def as_pass(self) -> PassRun:
        """The fields the data-left-behind check reads."""
        return PassRun(self.ran, self.exhausted, self.yielded, self.total)

    def __str__(self) -> str:
        if self.promised is None or self.promised == self.ran:
            return f"ran {_describe(self.ran)}"
        return f"ran {self.ran} of {_describe(self.promised)} its __len__ promised"


def eval_run_mismatch(per_rank: Mapping[int, EvalRun]) -> str:
    """Describes an eval pass that was uneven or broke a promise, or returns ``""``.

    Uneven: ranks ran different numbers of batches. Broken promise: a rank ran
    a different number of batches than its loader's ``__len__`` said (some
    frameworks stop every rank when the first runs out, which hides the
    uneven data but silently skips the rest of the others' data).
    """
    uneven = len({run.ran for run in per_rank.values()}) > 1
    broken = any(run.promised is not None and run.ran != run.promised for run in per_rank.values())
    return format_groups({r: _ran(run) for r, run in per_rank.items()}) if uneven or broken else ""


def _ran(run: EvalRun) -> str:
    return str(EvalRun(run.ran, run.promised))


def pass_verdict(per_rank: Mapping[int, EvalRun | PassRun]) -> tuple[str, str]:
    """The after-pass decision: ``(uneven or broken promise, data left behind)``, ``""`` if fine.

    Train passes (:class:`PassRun`) are checked for uneven counts and data
    left behind only: a framework may end a train epoch early on purpose
    (a step limit, a resumed epoch).
    """
    if all(isinstance(run, EvalRun) for run in per_rank.values()):
        counts = eval_run_mismatch(per_rank)  # type: ignore[arg-type]
        runs = {r: run.as_pass() for r, run in per_rank.items()}  # type: ignore[union-attr]
    else:
        runs = dict(per_rank)  # type: ignore[arg-type]
        uneven = len({run.ran for run in runs.values()}) > 1
        counts = format_groups({r: run.ran for r, run in runs.items()}, _describe) if uneven else ""
    return counts, left_behind(runs)


def planned_verdict(per_rank: Mapping[int, tuple[Counts, dict[str, LoaderYield]]]) -> tuple:
    """The before-the-first-batch decision: ``(count mismatches, yield mismatches)``."""
    counts = count_mismatches({r: planned for r, (planned, _) in per_rank.items()})
    yields = yield_mismatches({r: counted for r, (_, counted) in per_rank.items()})
    return counts, yields


class BatchParityGuard(Guard):
    """Checks that all ranks agree on the number of batches of each loader.

    Args:
        on_violation: ``"raise"`` (default) or ``"warn"``.
        eval_end_timeout_s: How long the after-eval check waits for ranks
            still in eval before naming them (seconds, > 0).
        check_train: Also check the train loader (fit start, epoch start and end).
        check_eval: Also check eval loaders (fit start, eval start, eval end).
        max_count_samples: Indices walked at most per loader to count the
            batches it yields before its first batch (an int >= 0; 0 turns the
            count off). A larger loader is not counted, said once at INFO.

    Raises:
        ValueError: A setting out of range.
        BatchCountMismatchError: Ranks would run, or ran, different numbers of batches
            (``on_violation="raise"``).

    Example::

        guard = BatchParityGuard(on_violation="raise", eval_end_timeout_s=120)
    """

    name = "batch_parity_guard"
    step_events = (Event.TRAIN_BATCH_END,)

    def __init__(
        self,
        *,
        on_violation: str = "raise",
        eval_end_timeout_s: float = 120.0,
        check_train: bool = True,
        check_eval: bool = True,
        max_count_samples: int = DEFAULT_MAX_SAMPLES,
    ) -> None:
        super().__init__(on_violation=on_violation)
        self.eval_end_timeout_s = check_positive("eval_end_timeout_s", eval_end_timeout_s)
        self.check_train = bool(check_train)
        self.check_eval = bool(check_eval)
        self.max_count_samples = check_int(
            "max_count_samples", max_count_samples, 0, must_be="an int >= 0 (0: do not count)"
        )
        self._eval_batches_run: dict[str, int] = {}
        self._eval_promised: dict[str, int | None] = {}
        self._train_checked_epoch: int | None = None
        self._train_batches_run = 0
        self._counted: dict[str, int | None] = {}

    def on_fit_start(self, facts: EventFacts) -> None:
        """Compares the planned batch count of every known loader, and what each yields."""
        self._counted = {}
        self._train_batches_run = 0
        loaders = [lf for lf in facts.loaders if self._wanted(lf)]
        if any(lf.is_train for lf in loaders):
            self._train_checked_epoch = facts.epoch
        self._compare_planned("fit_start", loaders, "at fit start")

    def on_epoch_start(self, facts: EventFacts) -> None:
        """Compares the train loader's planned count (once per epoch)."""
        if facts.loader is None or not self.check_train or self._train_checked_epoch == facts.epoch:
            return
        self._train_checked_epoch = facts.epoch
        self._compare_planned("epoch_start", [facts.loader], f"at the start of epoch {facts.epoch}")

    def read_steps(self, entries: list[Entry]) -> None:
        """Counts the train batches that ran, from the step log (no communication)."""
        self._train_batches_run += sum(
            1 for entry in entries if entry[1] == BATCH_END_FETCH_START or entry[1] == BATCH_END
        )

    def on_epoch_end(self, facts: EventFacts) -> None:
        """Compares the train batches that ran in the epoch; names data left behind."""
        ran, self._train_batches_run = self._train_batches_run, 0
        if facts.loader is None or not self.check_train:
            return
        seen = facts.loader_pass
        run = PassRun(
            ran,
            None if seen is None else seen.exhausted,
            None if seen is None else seen.yielded,
            self._counted.get(facts.loader.name),
        )
        what = f"Train loader {facts.loader.name!r} in epoch {facts.epoch}"
        self._compare_pass(f"epoch_end/{facts.loader.name}", run, what, "the train epoch")

    def on_eval_start(self, facts: EventFacts) -> None:
        """Compares the eval loader's planned count before its first batch."""
        if facts.loader is None or not self.check_eval:
            return
        name = facts.loader.name
        self._eval_batches_run[name] = 0
        self._eval_promised[name] = promised_batches(facts.loader)
        self._compare_planned(f"eval_start/{name}", [facts.loader], "before the first eval batch")

    def on_eval_batch_end(self, facts: EventFacts) -> None:
        """Counts an eval batch that ran (no communication)."""
        if facts.loader is not None:
            name = facts.loader.name
            self._eval_batches_run[name] = self._eval_batches_run.get(name, 0) + 1

    def on_eval_end(self, facts: EventFacts) -> None:
        """Compares the eval batches that actually ran; names ranks still in eval or data left.

        A plan that comes with the loader here (``facts.loader.num_batches``)
        caps what ``__len__`` promised: a hand-written loop that left the eval
        early on purpose says how many batches it meant to run only now.
        """
        if facts.loader is None or not self.check_eval:
            return
        name = facts.loader.name
        seen = facts.loader_pass
        promised = self._eval_promised.pop(name, None)
        if promised is not None and facts.loader.num_batches is not None:
            promised = min(promised, int(facts.loader.num_batches))  # a cap, never a promise
        ran = EvalRun(
            self._eval_batches_run.pop(name, 0),
            promised,
            None if seen is None else seen.exhausted,
            None if seen is None else seen.yielded,
            self._counted.get(name),
        )
        what = f"eval loader {name!r}"
        self._compare_pass(f"eval_end/{name}", ran, what[0].upper() + what[1:], what)

    def _compare_pass(self, where: str, run: EvalRun | PassRun, what: str, phase: str) -> None:
        try:
            counts, left = self.channel.exchange(
                f"{self.name}/{where}", run, pass_verdict, timeout_s=self.eval_end_timeout_s
            )
        except RanksMissingError as missing:
            self.violation(
                BatchCountMismatchError(
                    f"{rank_label(missing.missing)} did not finish {phase} within "
                    f"{missing.timeout_s:g} s of the other ranks (this rank "
                    f"{_ran(run) if isinstance(run, EvalRun) else _describe(run.ran)}). A rank "
                    "that runs more batches than the others waits in a collective that "
                    f"never completes. {FIX_ACTUAL} If it is just slow on those ranks, raise "
                    "`eval_end_timeout_s`."
                ),
                every_rank=False,
            )
            return
        if left:
            also = f" Batches run: {counts}." if counts else ""
            self.violation(
                BatchCountMismatchError(
                    f"{what} left data behind: {left}; those batches never ran.{also} {FIX_LEFT}"
                )
            )
        elif counts:
            self.violation(
                BatchCountMismatchError(
                    f"{what} did not run the same, promised number of batches on every rank: "
                    f"{counts}. {FIX_ACTUAL}"
                )
            )

    def _wanted(self, facts: LoaderFacts) -> bool:
        return self.check_train if facts.is_train else self.check_eval

    def _compare_planned(self, where: str, loaders: list[LoaderFacts], when: str) -> None:
        if not loaders:
            return
        counts: Counts = {lf.name: planned_batches(lf) for lf in loaders}
        yields = {lf.name: y for lf in loaders if (y := self._count(lf)) is not None}
        try:
            mismatches, odd = self.channel.exchange(
                f"{self.name}/{where}", (counts, yields), planned_verdict
            )
        except RanksMissingError as missing:  # honour on_violation="warn" here too
            self.violation(
                BatchCountMismatchError(f"Batch counts not compared ({when}): {missing}"),
                every_rank=False,
            )
            return
        problems = []
        if mismatches:
            lines = "; ".join(f"loader {name!r}: {desc}" for name, desc in mismatches.items())
            problems.append(
                f"Ranks would run different numbers of batches ({when}): {lines}. {FIX_PLANNED}"
            )
        if odd:
            lines = "; ".join(f"loader {name!r}: {desc}" for name, desc in odd.items())
            problems.append(
                f"Loaders yield a different number of batches than planned from their __len__ "
                f"({when}): {lines}. Batches past the plan never run; a rank that runs out "
                "early makes the others stop early (their rest silently skipped) or run more "
                f"batches than it does. {FIX_YIELD}"
            )
        if problems:
            self.violation(BatchCountMismatchError(" ".join(problems)))

    def _count(self, facts: LoaderFacts) -> LoaderYield | None:
        """Counts what the loader yields, once per loader per fit; ``None`` if not counted."""
        if facts.name in self._counted or not self.max_count_samples:
            return None
        counted = count_batches(facts.loader, max_samples=self.max_count_samples)
        self._counted[facts.name] = counted.batches
        if counted.skipped:
            logger.info(
                "rankguard %s: loader %r not counted before its first batch: %s "
                "(`max_count_samples`); checked after each pass instead.",
                self.name,
                facts.name,
                counted.skipped,
            )
        promised = promised_batches(LoaderFacts(facts.name, facts.loader, facts.is_train))
        planned = planned_batches(facts)
        if counted.batches is None or promised is None or planned is None:
            return None
        return LoaderYield(planned, promised, counted.batches)
