"""Cheap, deterministic fingerprints of a rank's dataset, compared across ranks.

A fingerprint's parts (length, content hash of sampled items, sampler,
StreamingDataset configuration, Hugging Face fingerprint) are compared one by
one by the DataConsistencyGuard, so a mismatch says what differs.
See docs/data.md#dataset-fingerprints.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from rankguard.callbacks.data.loaders import loader_settings
from rankguard.callbacks.data.rng_state import preserved_rng, seed_generators

__all__ = [
    "DatasetFingerprint",
    "fingerprint_loader",
    "hash_item",
    "loader_dataset",
    "sample_indices",
]

# The name users filter by and recorded outputs show, kept when the module moved.
logger = logging.getLogger("rankguard.callbacks.fingerprint")

#: Arrays and tensors above this many bytes hash their first and last half of it only.
MAX_HASHED_BYTES = 1 << 20
_MAX_DEPTH = 8
_MAX_ELEMENTS = 10_000
_STREAM_FIELDS = (
    "split",
    "shuffle",
    "shuffle_algo",
    "shuffle_seed",
    "shuffle_block_size",
    "num_canonical_nodes",
    "batch_size",
    "epoch_size",
    "sampling_method",
    "sampling_granularity",
    "partition_algo",
)

Pairs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class DatasetFingerprint:
    """One rank's fingerprint of one loader's dataset (see the module docstring).

    Attributes:
        dataset_type: Class name of the dataset (or of the loader without one).
        length: ``len(dataset)``, or ``None``.
        content: Short hash of the sampled items, or ``None`` if none were read.
        content_kind: ``"items"`` (by value), ``"weak"`` (types and shapes) or
            ``"none"`` (not read: iterable dataset, no dataset, or reading failed).
        sampled: Number of items hashed.
        sampler: Sampler type and its seed/shuffle/num_replicas/drop_last.
        streaming: StreamingDataset configuration, empty for other datasets.
        hf_fingerprint: A Hugging Face dataset's ``_fingerprint``, or ``None``.
        sharded: Whether a distributed sampler (one with ``num_replicas``, such as
            ``DistributedSampler``, or ``num_processes``, such as Accelerate's
            ``BatchSamplerShard``) splits the dataset between ranks, which
            assumes every rank holds the same dataset.
    """

    dataset_type: str
    length: int | None = None
    content: str | None = None
    content_kind: str = "none"
    sampled: int = 0
    sampler: Pairs = ()
    streaming: Pairs = ()
    hf_fingerprint: str | None = None
    sharded: bool = False

    @property
    def digest(self) -> str:
        """Short hash of every part: equal digests mean equal fingerprints."""
        return hashlib.blake2b(repr(self).encode(), digest_size=8).hexdigest()


def sample_indices(length: int, k: int) -> list[int]:
    """Returns ``min(k, length)`` evenly spaced indices, first and last included."""
    if length <= 0 or k <= 0:
        return []
    if length <= k:
        return list(range(length))
    if k == 1:
        return [0]
    return [round(j * (length - 1) / (k - 1)) for j in range(k)]


def hash_item(item: Any, *, weak: bool = False) -> str:
    """Hashes one item by value (or, with ``weak``, by types and shapes only)."""
    h = hashlib.blake2b(digest_size=8)
    _update(h, item, weak, 0)
    return h.hexdigest()


def _update(h: Any, obj: Any, weak: bool, depth: int) -> None:
    h.update(type(obj).__name__.encode() + b"|")
    if depth > _MAX_DEPTH:
        return
    if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
        if not weak:
            h.update(obj if isinstance(obj, bytes) else repr(obj).encode())
    elif isinstance(obj, torch.Tensor):
        h.update(f"{obj.dtype}{tuple(obj.shape)}".encode())
        if not weak:
            h.update(_tensor_bytes(obj))
    elif _is_numpy(obj):
        h.update(f"{obj.dtype.str}{getattr(obj, 'shape', ())}".encode())
        if weak:
            return
        if obj.dtype.hasobject:
            _update(h, obj.tolist(), weak, depth + 1)
        else:
            h.update(obj.tobytes() if obj.ndim == 0 else _numpy_bytes(obj))
    elif isinstance(obj, Mapping):
        h.update(str(len(obj)).encode())
        for key in sorted(obj, key=repr)[:_MAX_ELEMENTS]:
            h.update(repr(key).encode())
            _update(h, obj[key], weak, depth + 1)
    elif isinstance(obj, list | tuple):
        h.update(str(len(obj)).encode())
        for element in obj[:_MAX_ELEMENTS]:
            _update(h, element, weak, depth + 1)
    else:
        h.update(_weak_leaf(obj).encode())


def _weak_leaf(obj: Any) -> str:
    """Fallback for values rankguard cannot hash by value: shape, else repr length."""
    try:
        shape = getattr(obj, "shape", None) or getattr(obj, "size", None)
        if isinstance(shape, tuple | list):
            return f"shape{tuple(shape)}"
        size = len(repr(obj))
    except Exception:
        size = -1
    logger.debug("rankguard: hashing a %s by its repr length only", type(obj).__name__)
    return f"repr{size}"


def _is_numpy(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "tobytes")


def _numpy_bytes(array: Any) -> bytes | memoryview:
    import numpy as np

    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return _bounded(flat.data)


def _tensor_bytes(tensor: torch.Tensor) -> bytes | memoryview:
    if tensor.is_sparse or tensor.is_quantized or tensor.layout != torch.strided:
        return repr(tensor).encode()
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return _bounded(memoryview(flat.view(torch.uint8).numpy()))


def _bounded(data: memoryview) -> bytes | memoryview:
    if data.nbytes <= MAX_HASHED_BYTES:
        return data
    half = MAX_HASHED_BYTES // 2
    return bytes(data[:half]) + bytes(data[-half:]) + str(data.nbytes).encode()


def loader_dataset(loader: Any) -> Any | None:
    """The dataset behind ``loader``, or ``None`` where it has none rankguard can read.

    A ``DataLoader``'s ``dataset``; a dataset itself; or a framework loader's public
    ``dataset`` attribute holding a torch ``Dataset`` (OLMo-core 2.4 and 3.0's
    ``NumpyDataLoaderBase.dataset``: a ``NumpyFSLDataset``, ``NumpyVSLDataset``, ...).
    """
    if isinstance(loader, DataLoader):
        return loader.dataset
    if isinstance(loader, torch.utils.data.Dataset):
        return loader
    try:
        dataset = getattr(loader, "dataset", None)
    except Exception:  # a property that needs state not built yet
        return None
    return dataset if isinstance(dataset, torch.utils.data.Dataset) else None


def fingerprint_loader(loader: Any, sample_items: int) -> DatasetFingerprint:
    """Fingerprints the dataset behind ``loader`` without iterating the loader.

    Reads ``sample_items`` evenly spaced items whatever the dataset's length (a
    multi-terabyte token mix costs ``sample_items`` reads of one sequence each).
    """
    dataset = loader_dataset(loader)
    target = loader if dataset is None else dataset
    length = _length(target)
    content, kind, sampled = None, "none", 0
    if dataset is not None and length and _is_map_style(dataset):
        content, kind, sampled = _hash_sample(dataset, sample_indices(length, sample_items))
    hf = getattr(target, "_fingerprint", None)
    return DatasetFingerprint(
        dataset_type=type(target).__name__,
        length=length,
        content=content,
        content_kind=kind,
        sampled=sampled,
        sampler=_sampler_config(loader),
        streaming=_streaming_config(target),
        hf_fingerprint=hf if isinstance(hf, str) else None,
        sharded=_sharded(loader),
    )


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except Exception:  # no __len__, or one that raises (iterable datasets)
        return None


def _is_map_style(dataset: Any) -> bool:
    return not isinstance(dataset, IterableDataset) and hasattr(type(dataset), "__getitem__")


def _hash_sample(dataset: Any, indices: list[int]) -> tuple[str | None, str, int]:
    strong = hashlib.blake2b(digest_size=8)
    weak = hashlib.blake2b(digest_size=8)
    deterministic = True
    with preserved_rng():
        try:
            for n, index in enumerate(indices):
                seed_generators(index)
                item = dataset[index]
                strong.update(hash_item(item).encode())
                weak.update(hash_item(item, weak=True).encode())
                if n == 0:
                    seed_generators(index)
                    deterministic = hash_item(dataset[index]) == hash_item(item)
        except Exception as exc:  # a dataset that cannot be read here is not compared
            logger.debug("rankguard: could not read %s items: %r", type(dataset).__name__, exc)
            return None, "none", 0
    if not deterministic:
        logger.debug(
            "rankguard: %s[i] is not deterministic; comparing item types and shapes only",
            type(dataset).__name__,
        )
        return weak.hexdigest(), "weak", len(indices)
    return strong.hexdigest(), "items", len(indices)


#: Attributes of samplers that split a dataset between ranks: ``num_replicas``
#: (``DistributedSampler`` and its kin), ``num_processes`` (Accelerate's
#: ``BatchSamplerShard``, which the Hugging Face Trainer's loaders use).
SHARDING_ATTRIBUTES = ("num_replicas", "num_processes")
#: The attribute of a loader that splits its dataset itself: OLMo-core's data loaders
#: (``dp_world_size``, with ``dp_rank``).
LOADER_SHARDING_ATTRIBUTE = "dp_world_size"


def _sharded(loader: Any) -> bool:
    if not isinstance(loader, DataLoader) and hasattr(loader, LOADER_SHARDING_ATTRIBUTE):
        return True
    samplers = (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None))
    return any(
        hasattr(s, attribute)
        for s in samplers
        if s is not None
        for attribute in SHARDING_ATTRIBUTES
    )


def _sampler_config(loader: Any) -> Pairs:
    if not isinstance(loader, DataLoader):
        if not hasattr(loader, LOADER_SHARDING_ATTRIBUTE):
            return ()
        # A loader that shards itself (OLMo-core's): its order's seed and the shards' count.
        names = ("seed", LOADER_SHARDING_ATTRIBUTE)
        return (("type", type(loader).__name__), *((n, _plain(loader, n)) for n in names))
    settings = loader_settings(loader)
    if isinstance(loader.sampler, DistributedSampler):
        return (
            ("type", settings.sampler),
            ("seed", settings.dist_seed),
            ("shuffle", settings.dist_shuffle),
            ("num_replicas", settings.dist_num_replicas),
            ("drop_last", settings.dist_drop_last),
        )
    pairs: list[tuple[str, Any]] = [("type", settings.sampler)]
    for owner in (loader.sampler, loader.batch_sampler):  # custom samplers with a seed
        seed = getattr(owner, "seed", None)
        if isinstance(seed, int) and not isinstance(seed, bool):
            pairs.append(("seed", seed))
            break
    return tuple(pairs)


def _streaming_config(dataset: Any) -> Pairs:
    if not any(cls.__name__ == "StreamingDataset" for cls in type(dataset).__mro__):
        return ()
    pairs: list[tuple[str, Any]] = [(name, _plain(dataset, name)) for name in _STREAM_FIELDS]
    for n, stream in enumerate(getattr(dataset, "streams", None) or ()):
        remote = _plain(stream, "remote")
        # A local cache path may differ between nodes; it is the data only without a remote.
        local = _plain(stream, "local") if remote is None else None
        split = _plain(stream, "split")
        pairs += [(f"streams[{n}].remote", remote), (f"streams[{n}].local", local)]
        pairs.append((f"streams[{n}].split", split))
        for name in ("proportion", "repeat", "choose"):
            pairs.append((f"streams[{n}].{name}", _plain(stream, name)))
    return tuple(pairs)


def _plain(obj: Any, name: str) -> Any:
    try:
        value = getattr(obj, name, None)
    except Exception:  # properties that need state not built yet
        return None
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float) or hasattr(value, "item"):
        try:
            number = value.item() if hasattr(value, "item") else value
            return round(number, 9) if isinstance(number, float) else number
        except Exception:
            return repr(value)
    return repr(value)
