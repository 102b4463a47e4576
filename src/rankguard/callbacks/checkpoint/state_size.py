"""The size of a model's full (consolidated) checkpoint state, by dtype.

Pure functions over a ``torch.nn.Module`` and an optional optimizer; they
read shapes and dtypes only, never copy a tensor.

* Parameters and buffers count at their global size: a ``DTensor`` (FSDP2,
  tensor parallel) reports its global ``numel``; an FSDP1 ``FlatParameter``
  holds only this rank's shard, so it is multiplied by ``shard_world_size``
  (the padding FSDP adds is counted too, a slight over-estimate).
* Optimizer state is measured when it exists (after the first step). Before
  it, it is predicted from the optimizer's class: Adam and AdamW keep two
  copies of every parameter (``exp_avg``, ``exp_avg_sq``) plus a 4-byte
  ``step`` per parameter tensor; SGD with momentum one copy; and so on.
  ``torch.optim`` keeps the copies in the parameter's dtype, so with fp32
  parameters (mixed precision keeps fp32 master weights) that is two extra
  fp32 copies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StateSize", "estimate_state_size", "optimizer_state_copies"]

#: Parameter-sized state tensors per parameter, by lower-case optimizer class name.
STATE_COPIES: dict[str, float] = {
    "adam": 2,
    "adamw": 2,
    "decoupledadamw": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,
    "lamb": 2,
    "lion": 1,
    "decoupledlionw": 1,
    "rmsprop": 1,
    "adagrad": 1,
    "adadelta": 2,
}

#: Optimizers that also keep a scalar ``step`` tensor (fp32) per parameter.
_STEP_TENSOR = {"adam", "adamw", "nadam", "radam", "adamax", "adagrad", "decoupledadamw"}


@dataclass(frozen=True)
class StateSize:
    """Bytes of a full checkpoint state.

    Attributes:
        params: Bytes of parameters, by dtype name (``"float32"``...).
        buffers: Bytes of buffers, by dtype name.
        optimizer: Bytes of optimizer state, by dtype name.
        optimizer_measured: Whether optimizer state was measured (else predicted).
        largest: Bytes of the largest single tensor (``torch.save`` of an
            unsharded GPU model holds one such host copy at a time).
        sharded: Whether the model is sharded (FSDP1/FSDP2, DTensor): a full
            save then gathers a consolidated copy into host memory, whereas
            ``torch.save`` of an unsharded model streams one storage at a time.
    """

    params: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, int] = field(default_factory=dict)
    optimizer: dict[str, int] = field(default_factory=dict)
    optimizer_measured: bool = False
    largest: int = 0
    sharded: bool = False

    @property
    def total(self) -> int:
        """Total bytes."""
        return sum(self.by_dtype().values())

    def by_dtype(self) -> dict[str, int]:
        """Bytes of everything, by dtype name."""
        out: dict[str, int] = defaultdict(int)
        for part in (self.params, self.buffers, self.optimizer):
            for dtype, nbytes in part.items():
                out[dtype] += nbytes
        return dict(out)


_SHARDED_TENSORS = ("DTensor", "FlatParameter")


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _global_bytes(tensor: Any, shard_world_size: int) -> int:
    # DTensor.numel() is already global; a FlatParameter is a local shard.
    scale = shard_world_size if type(tensor).__name__ == "FlatParameter" else 1
    return tensor.numel() * tensor.element_size() * scale


def _sum_by_dtype(tensors: Iterable[Any], shard_world_size: int) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for tensor in tensors:
        out[_dtype_name(tensor)] += _global_bytes(tensor, shard_world_size)
    return dict(out)


def optimizer_state_copies(optimizer: Any) -> float:
    """Parameter-sized state tensors the optimizer keeps per parameter (2 if unknown)."""
    name = type(optimizer).__name__.lower()
    if name == "sgd":
        momentum = any(g.get("momentum", 0) for g in getattr(optimizer, "param_groups", []))
        return 1.0 if momentum else 0.0
    return float(STATE_COPIES.get(name, 2))


def _optimizer_state(optimizer: Any, shard_world_size: int) -> tuple[dict[str, int], bool]:
    import torch

    tensors = [
        value
        for state in getattr(optimizer, "state", {}).values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    if tensors:
        return _sum_by_dtype(tensors, shard_world_size), True
    params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
    copies = optimizer_state_copies(optimizer)
    out: dict[str, int] = defaultdict(int)
    for dtype, nbytes in _sum_by_dtype(params, shard_world_size).items():
        out[dtype] += int(nbytes * copies)
    if type(optimizer).__name__.lower() in _STEP_TENSOR and params:
        out["float32"] += 4 * len(params)
    return dict(out), False


def estimate_state_size(
    model: Any, optimizer: Any = None, *, shard_world_size: int = 1
) -> StateSize:
    """Estimates the bytes of a full checkpoint of ``model`` (and ``optimizer``).

    Args:
        model: A ``torch.nn.Module`` (possibly FSDP-wrapped).
        optimizer: Its optimizer, or ``None`` to count the model only.
        shard_world_size: Ranks an FSDP1 ``FlatParameter`` is sharded over.

    Returns:
        The sizes by part and dtype.

    Example::

        size = estimate_state_size(model, torch.optim.Adam(model.parameters()))
        size.total  # 12 bytes per fp32 parameter (+4 bytes per tensor for `step`)
    """
    params = list(model.parameters())
    buffers = list(model.buffers())
    opt, measured = _optimizer_state(optimizer, shard_world_size) if optimizer else ({}, False)
    sharded = any(type(t).__name__ in _SHARDED_TENSORS for t in params) or any(
        type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()
    )
    largest = max((_global_bytes(t, shard_world_size) for t in params + buffers), default=0)
    return StateSize(
        params=_sum_by_dtype(params, shard_world_size),
        buffers=_sum_by_dtype(buffers, shard_world_size),
        optimizer=opt,
        optimizer_measured=measured,
        largest=largest,
        sharded=sharded,
    )
