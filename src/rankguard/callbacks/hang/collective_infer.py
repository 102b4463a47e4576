"""The collectives DDP's reducer issued from C++, told from what the record saw around them.

Pure. DDP all-reduces its gradient buckets from C++ (autograd's hooks): the record counts
them by the group's sequence number but no Python call describes them. The reducer
launches one all-reduce per bucket, in bucket order, once per backward (then, with
``find_unused_parameters=True``, one of its map of used parameters); the record marks
each DDP forward's end (:class:`~rankguard.callbacks.hang.collective_compare.Mark`). So the
numbers after a forward that no Python call took are its backward's buckets, in order.
The flight recorder, where the running torch keeps one, says what each number was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from rankguard.callbacks.hang.collective_compare import GroupRecord, Issued, Mark

__all__ = [
    "BUCKET",
    "USED_MAP",
    "Buckets",
    "buckets_list",
    "buckets_of",
    "flight_calls",
    "group_record",
]

#: What issued the all-reduce of a DDP gradient bucket (``{at}``: the phase of its forward).
BUCKET = "gradient bucket {j} of {{at}}'s backward (DDP)"
#: What issued DDP's all-reduce of its map of used parameters.
USED_MAP = "DDP's map of used parameters in {at}'s backward (find_unused_parameters=True)"
#: The element size of the dtypes DDP's logger names, by rankguard's dtype names.
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
#: DDP's logger's dtype names (C++'s) as the record names dtypes (torch's).
_LOGGER_DTYPES = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
}


class Buckets(NamedTuple):
    """A DDP module's gradient buckets, as its reducer all-reduces them.

    Attributes:
        sizes: Bytes of each bucket, in the order all-reduced (``()``: not known, e.g.
            rebuilt buckets before DDP's logger has them).
        dtype: The parameters' element type where they share one, else ``None``.
        used_map: Parameters in the map of used ones DDP all-reduces after its buckets
            (``find_unused_parameters=True``), else ``None``.
    """

    sizes: tuple[int, ...]
    dtype: str | None
    used_map: int | None


def buckets_of(logged: Mapping[str, Any] | None) -> Buckets | None:
    """The buckets DDP's logger names (``_get_ddp_logging_data()``), or ``None`` if unknown.

    Its rebuilt sizes where it logged them (DDP rebuilds its buckets in its second
    forward, in the order gradients became ready), else its first ones.
    """
    if not logged:
        return None
    sizes = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or "")
    dtypes = {d for d in str(logged.get("dtypes", "")).split(",") if d.strip()}
    names = {_LOGGER_DTYPES.get(d.strip(), d.strip()) for d in dtypes}
    used = logged.get("num_parameter_tensors") if logged.get("find_unused_parameters") else None
    return Buckets(
        sizes=tuple(int(s) for s in sizes.split(",") if s.strip().isdigit()),
        dtype=names.pop() if len(names) == 1 else None,
        used_map=int(used) if used is not None else None,
    )


def buckets_list(kept: Sequence[Mapping[str, Any] | None]) -> list[Buckets | None]:
    """Each DDP module's buckets as the record's names keep them (``Buckets._asdict()``)."""
    return [
        Buckets(tuple(k.get("sizes", ())), k.get("dtype"), k.get("used_map")) if k else None
        for k in kept
    ]


def _bucket(seq: int, j: int, buckets: Buckets, mark: Mark) -> Issued | None:
    """The all-reduce DDP issued ``j``-th after ``mark``'s forward, or ``None`` past its last.

    Rebuilt buckets whose sizes DDP's logger does not hold yet are told without a size,
    each number of the window a bucket (their count is not known either).
    """
    thread, t, phase = mark.thread, mark.t, mark.phase
    if not buckets.sizes:
        return Issued(seq, "all_reduce", "?", -1, None, thread, t, BUCKET.format(j=j), phase)
    if j < len(buckets.sizes):
        itemsize = _ITEMSIZE.get(buckets.dtype or "")
        size = buckets.sizes[j]
        dtype, numel = (buckets.dtype, size // itemsize) if itemsize else ("uint8", size)
        origin = BUCKET.format(j=j)
    elif j == len(buckets.sizes) and buckets.used_map is not None:
        dtype, numel, origin = "int32", buckets.used_map, USED_MAP
    else:
        return None
    return Issued(seq, "all_reduce", dtype, numel, None, thread, t, origin, phase)


def _ddp_issued(
    count: int,
    described: set[int],
    marks: Sequence[Mark],
    buckets: Sequence[Buckets | None],
    known_from: int,
) -> dict[int, Issued]:
    """Per number no Python call took after a reducing DDP forward: its bucket's all-reduce.

    Only numbers every Python call of which the record still holds (``known_from`` on)
    are told; numbers inside a forward (its bucket rebuild) and past the last bucket stay
    undescribed.
    """
    told: dict[int, Issued] = {}
    ordered = sorted(marks, key=lambda m: (m.end, m.t))
    for n, mark in enumerate(ordered):
        layout = buckets[mark.ddp] if 0 <= mark.ddp < len(buckets) else None
        if not mark.reduces or layout is None or mark.end + 1 < known_from:
            continue
        upper = ordered[n + 1].start if n + 1 < len(ordered) else count  # the next forward
        free = [s for s in range(mark.end + 1, min(upper, count) + 1) if s not in described]
        for j, seq in enumerate(free):
            issued = _bucket(seq, j, layout, mark)
            if issued is None:
                break
            told[seq] = issued
    return told


def group_record(
    name: str,
    ranks: tuple[int, ...],
    count: int,
    issued: Sequence[Issued],
    marks: Sequence[Mark],
    buckets: Sequence[Buckets | None],
    *,
    last: int,
    cut: bool,
    flight: Mapping[int, Issued] | None = None,
) -> GroupRecord:
    """A group's record: the calls it saw, DDP's bucket all-reduces told, the last ``last``.

    Args:
        name: The group's name.
        ranks: Its members.
        count: Its count of collectives issued.
        issued: The Python calls the record holds for it, in the order written.
        marks: Its DDP forwards' ends the record holds.
        buckets: Each DDP module's buckets (by the marks' index), ``None`` where unknown.
        last: How many of its newest collectives to keep.
        cut: Whether older Python calls of the group may have left the record (it held
            ``last`` of them): numbers before the oldest held are not told.
        flight: The flight recorder's calls of this group, by number, where it keeps them:
            they tell what a number no Python call took was, and correct a told size.
    """
    described = {i.seq for i in issued}
    known_from = min(described) if cut and described else 0
    told = _ddp_issued(count, described, marks, buckets, known_from)
    for seq, call in (flight or {}).items():
        if seq in described or seq < known_from:
            continue
        guess = told.get(seq)
        if guess is not None and guess.op == call.op:
            told[seq] = call._replace(
                origin=guess.origin, phase=guess.phase, thread=guess.thread, t=guess.t
            )
        else:
            told[seq] = call
    calls = sorted([*issued, *told.values()], key=lambda i: i.seq)
    return GroupRecord(name, ranks, count, tuple(calls[-last:]))


#: The flight recorder's op names (``"nccl:all_reduce"`` less its backend) as the record's.
_FLIGHT_OPS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall_base": "all_to_all_single",
    "alltoall": "all_to_all",
}
#: The flight recorder's dtype names (ATen's) as the record's (torch's).
_FLIGHT_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Byte": "uint8",
    "Bool": "bool",
}


def flight_calls(entries: Iterable[Mapping[str, Any]], group: str) -> dict[int, Issued]:
    """The flight recorder's entries of group ``group`` as calls, by collective number.

    An entry names its group as ``[name, description]``, its op as ``"gloo:all_reduce"``,
    its inputs' sizes and dtypes; it has no issuing line, and names a C++ thread
    ``"python"`` at best (its thread is left empty).
    """
    calls: dict[int, Issued] = {}
    for entry in entries:
        pg = entry.get("process_group") or ()
        seq = entry.get("collective_seq_id")
        if not pg or str(pg[0]) != group or not isinstance(seq, int) or seq <= 0:
            continue
        op = str(entry.get("profiling_name", "?")).split(":")[-1]
        sizes = entry.get("input_sizes") or [[]]
        dtypes = entry.get("input_dtypes") or ["?"]
        numel = math.prod(sizes[0]) if sizes and sizes[0] is not None else 0
        dtype = _FLIGHT_DTYPES.get(str(dtypes[0]), str(dtypes[0]))
        start = entry.get("time_created_ns")
        t = start / 1e9 if isinstance(start, int | float) else 0.0
        calls[seq] = Issued(seq, _FLIGHT_OPS.get(op, op), dtype, int(numel), None, "", t)
    return calls
