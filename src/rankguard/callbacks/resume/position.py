"""What a rank resumed to, reduced to short digests that compare across ranks.

A data position is whatever state a loader, its dataset or its sampler keeps
(``state_dict()``, a sampler's ``epoch``); a random state is the full state of
each global generator (python ``random``, numpy's, torch's CPU one and, once
CUDA is up, each device's). Each becomes a short hash of a canonical form:
two ranks compare equal exactly when their states do. Nothing here iterates a
loader or draws a random number.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "brief",
    "checkpoint_identity",
    "digest",
    "loader_positions",
    "rng_digests",
    "sibling_checkpoints",
]

logger = logging.getLogger("rankguard.callbacks.resume")

#: Hex digits of a digest: 2**-32 odds that two different states compare equal.
DIGEST_CHARS = 8


def _canonical(value: Any, depth: int = 0) -> Any:
    """A form of ``value`` whose ``repr`` is equal exactly when the values are."""
    if depth > 12:
        return "..."
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return ("tensor", str(data.dtype), tuple(data.shape), _hash(data.numpy().tobytes()))
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # a numpy array or scalar
        return ("array", str(value.dtype), getattr(value, "shape", ()), _hash(value.tobytes()))
    if isinstance(value, Mapping):
        items = [(repr(k), _canonical(v, depth + 1)) for k, v in value.items()]
        return ("map", tuple(sorted(items)))
    if isinstance(value, list | tuple):
        return tuple(_canonical(v, depth + 1) for v in value)
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted(repr(_canonical(v, depth + 1)) for v in value)))
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    return (type(value).__qualname__, repr(value) if _plain_repr(value) else None)


def _plain_repr(value: Any) -> bool:
    """Whether ``repr(value)`` says more than its type and address."""
    return type(value).__repr__ is not object.__repr__


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def digest(value: Any) -> str:
    """A short hash of ``value`` (tensors, arrays, nested dicts and lists of plain values)."""
    return _hash(repr(_canonical(value)).encode())[:DIGEST_CHARS]


def brief(value: Any, limit: int = 72) -> str:
    """``value`` in a message: its ``repr``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _state_of(obj: Any) -> Any:
    """``obj.state_dict()`` where it takes no argument, else ``None`` (never raises)."""
    method = getattr(obj, "state_dict", None)
    if not callable(method) or isinstance(obj, torch.nn.Module):
        return None
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return None
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.default is p.empty and p.kind in required for p in params):
        return None  # e.g. a streaming dataset's state_dict(num_samples, from_beginning)
    try:
        return method()
    except Exception as exc:  # a loader that cannot say where it is now
        logger.debug("rankguard resume: %s.state_dict() failed: %s", type(obj).__name__, exc)
        return None


def loader_positions(loader: Any) -> dict[str, Any]:
    """Where ``loader`` stands: each state it keeps, by where it was read.

    Returns:
        Under ``"loader"``, ``"dataset"``, ``"sampler"`` and ``"batch sampler"`` the
        ``state_dict()`` of each that has one; under ``"sampler epoch"`` a sampler's
        ``epoch`` (``DistributedSampler.set_epoch``). Empty where it keeps none.
    """
    if loader is None:
        return {}
    positions: dict[str, Any] = {}
    sampler = getattr(loader, "sampler", None)
    dataset = getattr(loader, "dataset", None)
    for _ in range(4):  # a wrapper's inner dataset (accelerate's IterableDatasetShard, Subset)
        if callable(getattr(dataset, "state_dict", None)) or not hasattr(dataset, "dataset"):
            break
        dataset = dataset.dataset
    parts = (
        ("loader", loader),
        ("dataset", dataset),
        ("sampler", sampler),
        ("batch sampler", getattr(loader, "batch_sampler", None)),
    )
    for where, obj in parts:
        if obj is not None and (state := _state_of(obj)) is not None:
            positions[where] = state
    epoch = getattr(sampler, "epoch", None)
    if isinstance(epoch, int) and not isinstance(epoch, bool):
        positions["sampler epoch"] = epoch
    return positions


def rng_digests() -> dict[str, str]:
    """A digest of each global generator's full state (draws change it)."""
    digests = {"python random": digest(random.getstate())}
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        pass
    else:
        _, keys, pos, *_ = np.random.get_state()
        digests["numpy"] = digest((keys, pos))
    digests["torch"] = digest(torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        digests["torch.cuda"] = digest(torch.cuda.get_rng_state_all())
    return digests


#: Small files whose size tells two copies of a checkpoint folder apart.
METADATA_FILES = ("trainer_state.json", ".metadata", "metadata.json", ".metadata.json")


def checkpoint_identity(path: str) -> str | None:
    """A cheap identity of a checkpoint: a file's size, or its folder's metadata file's.

    ``None`` where neither can be read (a remote URI, a folder without a known
    metadata file).
    """
    try:
        if os.path.isfile(path):
            return f"{os.path.getsize(path)} bytes"
        for name in METADATA_FILES:
            meta = os.path.join(path, name)
            if os.path.isfile(meta):
                return f"{name}: {os.path.getsize(meta)} bytes"
    except OSError:
        return None
    return None


def sibling_checkpoints(folder: str | None, like: str | None) -> tuple[str, ...]:
    """The entries of ``folder`` that look like checkpoints, as this rank sees them.

    Args:
        folder: Where the framework looked for the checkpoint to resume from.
        like: The checkpoint this rank loaded (its name guides what looks like
            one: same extension for a file, a folder for a folder); ``None``: any.

    Returns:
        Sorted names; empty where the folder cannot be listed.
    """
    if not folder:
        return ()
    try:
        names = os.listdir(folder)
    except OSError:
        return ()
    if like and os.path.isfile(like):
        ext = os.path.splitext(like)[1]
        return tuple(sorted(n for n in names if n.endswith(ext) and not n.startswith(".")))
    return tuple(
        sorted(n for n in names if not n.startswith(".") and os.path.isdir(os.path.join(folder, n)))
    )
