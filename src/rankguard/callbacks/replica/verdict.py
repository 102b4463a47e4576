"""The replica checks' decisions and words: pure functions of what the ranks sent.

:func:`compare_prints` decides a check (which replica sets hold ranks whose prints
differ); :func:`differing_tensors` and :func:`difference_sizes` decide the two
narrower exchanges that follow a difference (which tensors, and by how much);
:func:`likely_causes` orders the causes by the evidence, and :func:`describe`
writes the message. ``tests/replica/test_replica_verdict.py`` holds their cases.
See docs/replica.md#what-the-message-says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from rankguard.callbacks.core.ranks import format_groups, group_ranks, rank_label
from rankguard.callbacks.replica.layout import DDP, MESH
from rankguard.callbacks.replica.prints import ReplicaPrint, Sample

__all__ = [
    "Evidence",
    "ReplicaVerdict",
    "SetVerdict",
    "Which",
    "compare_prints",
    "describe",
    "difference_sizes",
    "differing_tensors",
    "likely_causes",
]

#: Distinct prints (and differing replica sets) a message names; the rest are counted.
MAX_GROUPS = 4
#: Differing tensors per replica set the narrower exchanges name and size.
MAX_NAMED = 3
#: Below this share of a set's tensors differing, an update of a few tensors is likelier
#: than gradients or steps, which move every trained tensor.
FEW = 0.5


class PrintGroup(NamedTuple):
    """Ranks of one replica set that sent the same print.

    Attributes:
        ranks: Their label (``"ranks 0-3"``).
        first: The lowest of them: the one that sends more in the narrower exchanges.
        digest: Their print, shortened for messages.
    """

    ranks: str
    first: int
    digest: str


@dataclass(frozen=True)
class SetVerdict:
    """One replica set whose ranks differ.

    Attributes:
        key: The set's key (:func:`~rankguard.callbacks.replica.layout.set_key`).
        ranks: The label of every rank in it.
        prints: The distinct prints, most ranks first (at most :data:`MAX_GROUPS`).
        more: Further distinct prints, not listed.
        optimizer_steps: Per-rank optimizer step counts where they differ, else ``None``.
        steps_known: Whether every rank of the set keeps an optimizer step count.
    """

    key: bytes
    ranks: str
    prints: tuple[PrintGroup, ...]
    more: int = 0
    optimizer_steps: str | None = None
    steps_known: bool = True


@dataclass(frozen=True)
class ReplicaVerdict:
    """A check's verdict, the same on every rank.

    Attributes:
        step: The framework's step at the check (the most ranks' count).
        steps: Every rank's step where they count differently, else ``None``.
        compared: Replica sets compared.
        differ: The sets whose ranks differ (at most :data:`MAX_GROUPS`).
        more: Further differing sets, not listed.
    """

    step: int
    steps: str | None = None
    compared: int = 0
    differ: tuple[SetVerdict, ...] = ()
    more: int = 0

    def representatives(self) -> dict[bytes, tuple[int, ...]]:
        """Per differing set, the ranks that send more: one per listed print."""
        return {s.key: tuple(p.first for p in s.prints) for s in self.differ}


def _label(values: Mapping[int, object]) -> str:
    return format_groups(values, lambda v: "none" if v is None else str(v))


def _set_verdict(key: bytes, prints: Mapping[int, ReplicaPrint]) -> SetVerdict | None:
    digests = {rank: p.digests[key] for rank, p in prints.items()}
    steps = {rank: p.optimizer_steps for rank, p in prints.items()}
    steps_differ = len(set(steps.values())) > 1
    groups = group_ranks(digests)
    if len(groups) == 1 and not steps_differ:
        return None
    listed = tuple(PrintGroup(rank_label(r), r[0], d.hex()[:8]) for r, d in groups[:MAX_GROUPS])
    return SetVerdict(
        key=key,
        ranks=rank_label(prints),
        prints=listed,
        more=max(0, len(groups) - MAX_GROUPS),
        optimizer_steps=_label(steps) if steps_differ else None,
        steps_known=all(s is not None for s in steps.values()),
    )


def compare_prints(per_rank: Mapping[int, ReplicaPrint]) -> ReplicaVerdict:
    """The check's decision: per replica set, whether its ranks sent the same print.

    A set's ranks are those that sent its key; they differ where their digests or
    their optimizer step counts do.
    """
    step_groups = group_ranks({rank: p.step for rank, p in per_rank.items()})
    keys = list(dict.fromkeys(key for p in per_rank.values() for key in p.digests))
    differ = []
    for key in keys:
        members = {rank: p for rank, p in per_rank.items() if key in p.digests}
        found = _set_verdict(key, members)
        if found is not None:
            differ.append(found)
    return ReplicaVerdict(
        step=step_groups[0][1] if step_groups else 0,
        steps=_label({r: p.step for r, p in per_rank.items()}) if len(step_groups) > 1 else None,
        compared=len(keys),
        differ=tuple(differ[:MAX_GROUPS]),
        more=max(0, len(differ) - MAX_GROUPS),
    )


class Which(NamedTuple):
    """The tensors of one replica set whose sums differ between its representatives.

    Attributes:
        kind: The set's layout kind (``"ddp"``, ``"mesh"``, ``"world"``).
        how: What makes its ranks replicas, for messages.
        indices: The first :data:`MAX_NAMED` differing tensors' places in the set.
        differing: How many of its tensors differ.
        total: How many it holds.
    """

    kind: str
    how: str
    indices: tuple[int, ...]
    differing: int
    total: int


#: What a representative sends in the first narrower exchange: per set, its kind, what
#: makes it a replica set, and its tensors' sums.
WhichPayload = dict[bytes, tuple[str, str, list[int]]]


def differing_tensors(
    per_rank: Mapping[int, WhichPayload | None], verdict: ReplicaVerdict
) -> dict[bytes, Which]:
    """The first narrower exchange's decision: which tensors differ, per differing set."""
    found: dict[bytes, Which] = {}
    for key, reps in verdict.representatives().items():
        sent = [payload[key] for r in reps if (payload := per_rank.get(r)) and key in payload]
        if not sent:
            continue
        kind, how, _ = sent[0]
        columns = list(zip(*(sums for _, _, sums in sent), strict=False))
        differing = [i for i, column in enumerate(columns) if len(set(column)) > 1]
        total = max(len(sums) for _, _, sums in sent)
        found[key] = Which(kind, how, tuple(differing[:MAX_NAMED]), len(differing), total)
    return found


#: What a representative sends in the second narrower exchange: per set, a sample of each
#: differing tensor named by the first.
SizePayload = dict[bytes, list[Sample]]


def _differ(a: float, b: float) -> bool:
    return a != b and not (math.isnan(a) and math.isnan(b))


def _size_line(reference: Sample, ref_label: str, other: Sample, other_label: str) -> str:
    pairs = list(zip(reference.values, other.values, strict=False))
    gaps = [abs(a - b) for a, b in pairs if _differ(a, b)]
    shape = "x".join(map(str, reference.shape)) or "scalar"
    what = f"`{reference.name}` ({shape})"
    elements = f"{len(pairs)} {'sampled ' if reference.sampled else ''}elements"
    if not gaps:
        return f"{what}: {other_label} and {ref_label} agree in all {elements}"
    largest = max((abs(v) for v in reference.values if not math.isnan(v)), default=0.0)
    by = max((g for g in gaps if not math.isnan(g)), default=math.nan)
    verb = "differs" if other_label.startswith("rank ") else "differ"
    return (
        f"{what}: {other_label} {verb} from {ref_label} in {len(gaps)} of {elements}, "
        f"by up to {by:.3g} (largest |value| {largest:.3g})"
    )


def difference_sizes(
    per_rank: Mapping[int, SizePayload | None], verdict: ReplicaVerdict
) -> dict[bytes, list[str]]:
    """The second narrower exchange's decision: per set, a line per named tensor.

    Each listed print's sample is compared with the first's (the most ranks').
    """
    lines: dict[bytes, list[str]] = {}
    for replica_set in verdict.differ:
        samples = [
            (group.ranks, payload[replica_set.key])
            for group in replica_set.prints
            if (payload := per_rank.get(group.first)) and replica_set.key in payload
        ]
        if len(samples) < 2:
            continue
        (ref_label, reference), others = samples[0], samples[1:]
        lines[replica_set.key] = [
            _size_line(ref, ref_label, other, label)
            for label, tensors in others
            for ref, other in zip(reference, tensors, strict=False)
        ]
    return lines


@dataclass(frozen=True)
class Evidence:
    """What the causes are told apart by.

    Attributes:
        kind: The layout kind of the set (``"ddp"``, ``"mesh"``, ``"world"``).
        steps_differ: Whether the ranks' optimizer step counts differ (``None``: the
            optimizer keeps none, so a skipped step cannot be told).
        before_training: The check came before any train step of the fit.
        never_equal: No earlier check of the fit found the set equal.
        share: The share of the set's tensors that differ (``None``: unknown).
    """

    kind: str
    steps_differ: bool | None
    before_training: bool = False
    never_equal: bool = False
    share: float | None = None


SKIPPED_STEP = (
    "a skipped `optimizer.step()` on some ranks: a per-rank condition (an inf/NaN check "
    "of this rank's own gradients or loss, a condition on the rank, a `return` before the "
    "step in Lightning's manual optimization) leaves those ranks a step behind. Fix: decide "
    "a skip on every rank together: reduce the flag across ranks first (an `all_reduce` of "
    "a found-inf tensor, as `torch.amp.GradScaler` does), then skip everywhere or nowhere."
)
UNSYNCED = (
    "gradients not averaged across ranks before a step: an inverted `no_sync()` condition "
    "(the micro-batch before `optimizer.step()` ran under it, so its gradients stayed "
    "rank-local), or a forward under `no_sync()` whose backward ran outside it (DDP decides "
    "at the forward whether the backward synchronizes: `no_sync()` around the backward alone "
    "changes nothing); under FSDP2, `set_requires_gradient_sync(False)` left on for the last "
    "micro-batch. Fix: only micro-batches before the last skip the sync, e.g. "
    "`model.no_sync() if (i + 1) % accumulation else contextlib.nullcontext()` around the "
    "forward and the backward."
)
OUTSIDE_OPTIMIZER = (
    "an update outside the optimizer on some ranks only: an EMA, a clamp, a weight "
    "normalization or a copy under `if rank == 0` (`trainer.is_global_zero`, "
    "`is_world_process_zero()`), or a tensor DDP does not synchronize (`requires_grad=False`, "
    "a buffer) updated from each rank's own data. Fix: apply such updates on every rank; "
    "keep `if rank == 0` for logging and saving."
)
INIT = {
    MESH: (
        "an unseeded initialization: FSDP2's `fully_shard` and HSDP do not copy one rank's "
        "initial weights to the others (DDP does, when it is built), so ranks that built the "
        "model from different random states (or restored different checkpoints) hold "
        "different replicas from the start. Fix: seed "
        "every rank alike before building the model (`torch.manual_seed(s)`), or load the same "
        "initial weights on every rank (`set_model_state_dict(..., "
        "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`)."
    ),
    DDP: (
        "weights changed on some ranks after DDP was built: `DistributedDataParallel` copies "
        "rank 0's weights to every rank when it is built, so replicas that differ before the "
        "first step were changed since (a checkpoint loaded on some ranks only, or each rank "
        "restoring its own or another rank's checkpoint into the wrapped model). Fix: load "
        "the weights before wrapping the model, on every rank from the same checkpoint."
    ),
}
INIT_OTHER = (
    "ranks that started from different weights: an unseeded initialization, or ranks "
    "restoring different checkpoints. Fix: seed every rank alike before building the model "
    "(`torch.manual_seed(s)`), and load every rank's weights from the same checkpoint."
)


def likely_causes(evidence: Evidence) -> list[str]:
    """The likely causes of a difference, most likely first (each with its fix).

    A step count that differs proves a skipped step. A difference before any train
    step can only be the initial weights. Of the rest, a few tensors moved points at an
    update outside the optimizer; every trained tensor moved, at gradients or steps.
    """
    init = INIT.get(evidence.kind, INIT_OTHER)
    if evidence.before_training:
        return [init]
    causes = [SKIPPED_STEP] if evidence.steps_differ else []
    if evidence.never_equal:
        causes.append(init)
    if evidence.steps_differ:
        return causes
    skipped = [SKIPPED_STEP] if evidence.steps_differ is None else []
    if evidence.share is not None and evidence.share < FEW:
        return [*causes, OUTSIDE_OPTIMIZER, UNSYNCED, *skipped]
    return [*causes, UNSYNCED, *skipped, OUTSIDE_OPTIMIZER]


@dataclass(frozen=True)
class Details:
    """What the narrower exchanges found, for :func:`describe` (empty where they failed).

    Attributes:
        which: Per differing set, which tensors differ.
        sizes: Per differing set, a line per named tensor.
    """

    which: dict[bytes, Which] = field(default_factory=dict)
    sizes: dict[bytes, list[str]] = field(default_factory=dict)


def _set_lines(replica_set: SetVerdict, details: Details, several: bool) -> list[str]:
    which = details.which.get(replica_set.key)
    head = f"{replica_set.ranks}{f' ({which.how})' if which else ''}: " if several else ""
    prints = "; ".join(f"{p.ranks}: {p.digest}" for p in replica_set.prints)
    more = f"; {replica_set.more} more distinct prints" if replica_set.more else ""
    lines = [f"{head or 'Fingerprints: '}{prints}{more}."]
    if replica_set.optimizer_steps:
        lines.append(f"Optimizer steps taken: {replica_set.optimizer_steps}.")
    if which is not None:
        listed = details.sizes.get(replica_set.key, [])
        named = f": {'; '.join(listed)}" if listed else ""
        rest = which.differing - len(which.indices) if listed else 0
        more_named = f"; and {rest} more" if rest > 0 else ""
        lines.append(f"{which.differing} of {which.total} tensors differ{named}{more_named}.")
    return lines


def describe(
    verdict: ReplicaVerdict,
    details: Details,
    causes: Sequence[str],
    last_equal: int | None,
    why: str,
) -> str:
    """The message: one short sentence, then the details, then the likely causes.

    Args:
        verdict: The check's verdict, with at least one differing set.
        details: What the narrower exchanges found.
        causes: :func:`likely_causes`' list for the first differing set.
        last_equal: The step of the last check of the fit that found every set equal.
        why: When the check ran (``"every 50 train batches"``, ``"at an eval's start"``).
    """
    first = verdict.differ[0]
    others = len(verdict.differ) - 1 + verdict.more
    also = f" (and {others} more replica groups)" if others else ""
    lines = [f"Replicas differ: {first.ranks} should hold the same parameters and do not{also}."]
    counted = f" (counted per rank: {verdict.steps})" if verdict.steps else ""
    equal = (
        f"the check at step {last_equal} found them equal"
        if last_equal is not None
        else "no earlier check of this fit found them equal"
    )
    lines.append(f"First seen at step {verdict.step}{counted}, {why}; {equal}.")
    for replica_set in verdict.differ:
        lines += _set_lines(replica_set, details, len(verdict.differ) > 1)
    numbered = " ".join(f"({n}) {cause}" for n, cause in enumerate(causes, 1))
    lines.append(f"Likely causes, most likely first: {numbered}")
    return "\n".join(lines)
