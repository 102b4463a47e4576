"""What split the ranks, read from each rank's history: the first difference and its fix.

Pure: :func:`split_cause` compares the ranks' :class:`~rankguard.callbacks.hang.history.Phases`
batch by batch and names the first difference it has words for: a batch one rank left
without a backward, accumulation windows that end at different backward passes, a pass over
the train loader that ended earlier on one rank. :func:`lead_with` puts it first in a proof's
words. See docs/hang.md#what-split-them-each-ranks-history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from rankguard.callbacks.core.events import SplitDecision
from rankguard.callbacks.core.ranks import group_ranks, rank_label
from rankguard.callbacks.hang.history import EPOCH_END, FIT_END, BatchPhases, Phases
from rankguard.callbacks.hang.status import DEADLOCK_EXIT_CODE, RankStatus
from rankguard.callbacks.hang.verdict_text import stop_of

__all__ = ["NO_BACKWARD", "PASS", "WINDOW", "Cause", "lead_with", "split_cause"]

#: The causes, in the order they are looked for at one batch.
NO_BACKWARD = "no backward"
PASS = "pass"
WINDOW = "window"
_REPLAYS = f"A restart would replay it: exit code {DEADLOCK_EXIT_CODE}, do not restart."
_FIXES = {
    NO_BACKWARD: (
        "Next: decide a skip on every rank together: {who} left a batch without its backward "
        "(a `continue` on a non-finite loss, a `training_step` that returns None, a "
        "`manual_backward` left out) while the others all-reduce their gradients in it. "
        "Reduce a skip flag across ranks first (`dist.all_reduce(flag, op=dist.ReduceOp.MAX)`) "
        "and skip on every rank where it is set."
    ),
    WINDOW: (
        "Next: keep the accumulation windows equal on every rank, the same number of backward "
        "passes (microbatches) per optimizer step: a window decided from something of one "
        "rank's own (its token count, its own batch count, a `no_sync()` condition), or an "
        "uneven last window (passes of different lengths), pairs one rank's gradient "
        "all-reduce with another's other collective."
    ),
    PASS: (
        "Next: give every rank the same number of batches per pass: {who}'s pass ended first, "
        "so the others wait in a collective it never reaches (shards of different lengths: "
        "shard evenly, a `DistributedSampler`, `drop_last=True`, or end every rank's pass "
        "when the first runs out, e.g. DDP's `join()`)."
    ),
}


class Cause(NamedTuple):
    """The first difference between the ranks' histories.

    Attributes:
        kind: :data:`NO_BACKWARD`, :data:`WINDOW` or :data:`PASS`.
        first: The rank to read first (the one whose history differs, where one does).
        sentence: What split them, e.g. ``"rank 1 ran no backward for train batch 5 (it
            waits in train batch 6's forward; rank 0 waits in train batch 5's backward)"``.
        fix: The "Next" line.
    """

    kind: str
    first: int
    sentence: str
    fix: str


#: A difference found at a place of the runs: (train batch n, order within it, the cause or
#: ``None`` where the first difference is one without words here).
_Found = tuple[int, int, Cause | None]


def split_cause(
    statuses: Mapping[int, RankStatus], split_decisions: Mapping[str, SplitDecision] | None = None
) -> Cause | None:
    """The first difference between the ranks' recent phases, or ``None``.

    Every rank's history must be known. Train batches pair by their place in the fit,
    backward passes by their count; the first difference wins, and at one batch a batch
    left without a backward, then a pass that ended, then a window. A stop decision an
    adapter saw set is the cause instead (its words are the adapter's) unless the
    history differs before it (the HF Trainer stops a rank at its own last step: a
    window that differed is why); a pass it ended early is its doing.
    """
    phases = {r: s.phases for r, s in statuses.items()}
    if len(phases) < 2 or any(p is None or not p.batches for p in phases.values()):
        return None
    known: dict[int, Phases] = phases  # type: ignore[assignment]
    batches = {r: {b.n: b for b in p.batches} for r, p in known.items()}
    common = sorted(set.intersection(*(set(b) for b in batches.values())))
    found = [
        f
        for look in (_no_backward, _ended_pass, _window)
        if (f := look(statuses, known, batches, common)) is not None
    ]
    stops = [_stop_at(s, known[r], split_decisions or {}) for r, s in statuses.items()]
    stopped = min((n for n in stops if n is not None), default=None)
    if stopped is not None:
        found = [f for f in found if f[0] < stopped and (f[2] is None or f[2].kind != PASS)]
    return min(found, key=lambda f: f[:2])[2] if found else None


def _stop_at(
    status: RankStatus, phases: Phases, split_decisions: Mapping[str, SplitDecision]
) -> int | None:
    """The train batch (``n``) at which this rank holds a stop decision set, or ``None``."""
    stop = stop_of(status, split_decisions)
    if stop is None:
        return None
    step = stop[1] if stop[1] is not None else status.step
    later = [b.n for b in phases.batches if b.step >= step]
    return min(later) if later else phases.batches[-1].n + 1


def lead_with(
    cause: Cause, kind: str, summary: str, details: Sequence[str]
) -> tuple[str, tuple[str, ...]]:
    """A proof's summary and details with ``cause`` first.

    Where the ranks wait (the proof's summary) becomes a detail line; the proof's "Next"
    gives way to the cause's fix: the wait point is evidence, not the cause.
    """
    where = summary[len(kind) + 2 :] if summary.startswith(f"{kind}, ") else summary
    kept = [d for d in details if not d.startswith("Next: ")]
    return f"{kind}, {cause.sentence}", (f"Where they wait: {where}", *kept, cause.fix)


# -- the differences ----------------------------------------------------------------------

Batches = Mapping[int, Mapping[int, BatchPhases]]


def _no_backward(
    statuses: Mapping[int, RankStatus],
    phases: Mapping[int, Phases],
    batches: Batches,
    common: Sequence[int],
) -> _Found | None:
    """The first batch a rank ended without a backward while another ran one in it."""
    if not all(p.knows_backwards for p in phases.values()):
        return None
    for n in common:
        of = {r: b[n] for r, b in batches.items()}
        skipped = sorted(r for r, b in of.items() if b.ended and not b.backwards)
        ran = sorted(r for r, b in of.items() if b.backwards)
        if skipped and ran:
            step = of[skipped[0]].step
            who = rank_label(skipped)
            sentence = (
                f"{who} ran no backward for train batch {step} "
                f"({_doing(statuses, skipped, ran, phases)})"
            )
            fix = f"{_FIXES[NO_BACKWARD].format(who=who)} {_REPLAYS}"
            return n, 0, Cause(NO_BACKWARD, skipped[0], sentence, fix)
    return None


def _ended_pass(
    statuses: Mapping[int, RankStatus],
    phases: Mapping[int, Phases],
    batches: Batches,
    common: Sequence[int],
) -> _Found | None:
    """The first batch after which one rank's pass ended while another went on in it.

    What ran after each batch is compared where every rank has it; the first difference
    that is not a pass's end (an eval, a save on some ranks) is none of these causes.
    """
    for n in common:
        after = {}
        for r, b in batches.items():
            done = any(m > n for m in b) or FIT_END in b[n].after
            after[r] = (b[n].after, done)
        k = _first_difference(after)
        if k is None:
            continue
        ended = sorted(r for r, (a, _) in after.items() if len(a) > k and a[k] == EPOCH_END)
        went_on = sorted(r for r, (a, done) in after.items() if len(a) == k and done)
        if (
            not ended
            or not went_on
            or any(len(a) > k and a[k] != EPOCH_END for a, _ in after.values())
        ):
            return n, 1, None  # another difference first (an eval, a save on some ranks)
        last = batches[ended[0]][n]
        size = _pass_size(phases[ended[0]], last)
        length = f"train batch {last.step}"
        if size:
            length = f"{size} batches ({length} its last)"
        nxt = min(m for m in batches[went_on[0]] if m > n)
        sentence = (
            f"{rank_label(ended)}'s pass over the train loader ended after {length}; "
            f"{rank_label(went_on)} went on to train batch {batches[went_on[0]][nxt].step} in "
            f"{'its' if len(went_on) == 1 else 'their'} pass "
            f"({_doing(statuses, went_on, ended, phases)})"
        )
        fix = f"{_FIXES[PASS].format(who=rank_label(ended))} {_REPLAYS}"
        return n, 1, Cause(PASS, ended[0], sentence, fix)
    return None


def _first_difference(after: Mapping[int, tuple[tuple[str, ...], bool]]) -> int | None:
    """Where the ranks' sequences after one batch first differ, or ``None`` (not yet).

    A rank not done with that batch's sequence (``done`` false) may still add to it: only
    what it has so far is compared.
    """
    longest = max(len(a) for a, _ in after.values())
    for k in range(longest + 1):
        items = set()
        for a, done in after.values():
            if len(a) > k:
                items.add(a[k])
            elif done:
                items.add(None)  # its sequence ended here
        if len(items) > 1:
            return k
    return None


def _pass_size(phases: Phases, last: BatchPhases) -> int | None:
    """The batches of ``last``'s pass, where the history holds its first batch."""
    mine = [b for b in phases.batches if b.epoch == last.epoch and b.n <= last.n]
    first = mine[0] if mine else None
    if first is None or (first.n != 1 and first is phases.batches[0]):
        return None  # its first batch is older than the history
    return len(mine)


def _window(
    statuses: Mapping[int, RankStatus],
    phases: Mapping[int, Phases],
    batches: Batches,
    common: Sequence[int],
) -> _Found | None:
    """The first backward pass that ends an accumulation window on some ranks only.

    A backward ends its window where the optimizer stepped after it, or where the rank
    waits in it (its gradient all-reduce: under DDP only a window's last backward syncs);
    it does not where another backward or the batch's end came first.
    """
    if not all(p.knows_backwards and p.knows_steps for p in phases.values()):
        return None
    ends = {r: _window_ends(statuses[r], p) for r, p in phases.items()}
    ordinals = sorted(set.intersection(*(set(e) for e in ends.values())))
    for ordinal in ordinals:
        at = {r: e[ordinal] for r, e in ends.items()}
        enders = sorted(r for r, (_, _, end) in at.items() if end)
        goers = sorted(r for r, (_, _, end) in at.items() if not end)
        if not enders or not goers:
            continue
        n = min(batch for batch, _, _ in at.values())
        if n not in common:
            return None
        sentence = _window_sentence(statuses, phases, batches, ends, at, enders, goers, ordinal)
        first = (goers if len(goers) < len(enders) else enders)[0]
        return n, 2, Cause(WINDOW, first, sentence, f"{_FIXES[WINDOW]} {_REPLAYS}")
    return None


#: Per backward pass (by its count in the fit): (train batch n, place in its window, ends it).
_Ends = dict[int, tuple[int, int, bool]]


def _window_ends(status: RankStatus, phases: Phases) -> _Ends:
    """Each backward pass whose end of window is known; the one the rank waits in ends one."""
    ends = {b.ordinal: (b.n, b.window, b.ends_window) for b in phases.backwards}
    known: _Ends = {o: (n, w, e) for o, (n, w, e) in ends.items() if e is not None}
    if status.waits_at == "backward" and phases.batches:
        last = phases.backwards[-1] if phases.backwards else None
        if phases.knows_starts and last is not None and last.ends_window is None:
            known[last.ordinal] = (last.n, last.window, True)
        elif not phases.knows_starts:  # the one running is not announced yet
            ordinal = last.ordinal + 1 if last is not None else 1
            window = 1 if last is None or last.ends_window else last.window + 1
            known[ordinal] = (phases.batches[-1].n, window, True)
    return known


def _window_sentence(
    statuses: Mapping[int, RankStatus],
    phases: Mapping[int, Phases],
    batches: Batches,
    ends: Mapping[int, _Ends],
    at: Mapping[int, tuple[int, int, bool]],
    enders: list[int],
    goers: list[int],
    ordinal: int,
) -> str:
    """``"the ranks' accumulation windows differ: rank 0 ends one after 2 backward..."``."""
    n, size, _ = at[enders[0]]
    step = batches[enders[0]][n].step
    # It waits there: in a backward, of the batch whose window it ended (a rank that went on
    # and waits in a later batch's backward stepped its optimizer at that window's end).
    waits = all(
        statuses[r].waits_at == "backward"
        and (not phases[r].batches or phases[r].batches[-1].n == at[r][0])
        for r in enders
    )
    how = "and waits there in its gradient all-reduce" if waits else "and steps its optimizer"
    last = " (the last window of its pass)" if EPOCH_END in batches[enders[0]][n].after else ""
    later = [(o, w) for o, (_, w, e) in sorted(ends[goers[0]].items()) if o > ordinal and e]
    goes = f"its window goes on past {size}"
    if later:
        o, w = later[0]
        goes += f": it ends it after {w}, at train batch {_step_of(goers[0], o, phases, batches)}"
    passes = "backward pass" if size == 1 else "backward passes"
    return (
        f"the ranks' accumulation windows differ: {rank_label(enders)} ends one after {size} "
        f"{passes}, in train batch {step}{last}, {how}; {rank_label(goers)} does not, "
        f"{goes} ({_doing(statuses, goers, () if waits else enders, phases)})"
    )


def _step_of(rank: int, ordinal: int, phases: Mapping[int, Phases], batches: Batches) -> int:
    """The framework step of the batch a rank's backward pass ran in."""
    n = next(b.n for b in phases[rank].backwards if b.ordinal == ordinal)
    return batches[rank][n].step


# -- where each rank is ---------------------------------------------------------------------


def _doing(
    statuses: Mapping[int, RankStatus],
    odd: Sequence[int],
    others: Sequence[int],
    phases: Mapping[int, Phases],
) -> str:
    """``"it waits in train batch 6's forward; rank 0 waits in train batch 5's backward"``.

    The odd ranks, just named, are "it" (or "they") where they are in one place.
    """
    parts = []
    for ranks, pronoun in ((odd, True), (others, False)):
        groups = group_ranks({r: _where(statuses[r], phases[r]) for r in ranks})
        for group, (verb, where) in groups:
            subject = _it(group) if pronoun and len(groups) == 1 else rank_label(group)
            parts.append(f"{subject} {_verb(verb, len(group))} {where}")
    return "; ".join(parts)


def _it(ranks: Sequence[int]) -> str:
    return "it" if len(ranks) == 1 else "they"


def _verb(verb: str, count: int) -> str:
    if count == 1:
        return verb
    plural = {"is": "are", "waits": "wait"}
    first, _, rest = verb.partition(" ")
    return " ".join(w for w in (plural.get(first, first), rest) if w)


def _where(status: RankStatus, phases: Phases) -> tuple[str, str]:
    """What a rank does now and where: ``("waits in", "train batch 5's backward")``."""
    if status.left:
        return "left", status.phase.removeprefix("left ")
    verb = "waits in" if status.waits_at else "is in"
    if status.phase == "epoch end":
        return verb.replace(" in", " at"), "the end of its pass"
    now = "backward" if status.waits_at == "backward" else phases.now
    if now == "forward" and status.waits_at not in (None, "broadcast"):
        now = ""  # waits at a rendezvous of its own before its backward: its phase says where
    last = phases.batches[-1] if phases.batches else None
    if now and last is not None:
        part = "after its backward" if now == "after backward" else None
        return (
            verb,
            f"train batch {last.step}, {part}" if part else f"train batch {last.step}'s {now}",
        )
    if last is not None and last.ended and status.phase.startswith("data fetch"):
        # The next batch's step may be the last one's where a step was skipped (Lightning
        # counts optimizer steps): the batch it left says where it is.
        return verb.removesuffix(" in"), f"after train batch {last.step}"
    return verb, status.phase
