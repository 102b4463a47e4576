"""The global random generators data code uses: preserving, seeding, comparing them.

Fingerprinting a dataset reads items whose ``__getitem__`` may draw random
numbers (augmentations). :func:`preserved_rng` and :func:`seed_generators`
let it read them reproducibly without touching training's random streams;
:func:`rng_digest` summarises how each generator was seeded, for comparing
across ranks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["TORCH_DEFAULT_SEED", "preserved_rng", "rng_digest", "seed_generators"]

#: ``torch.initial_seed()`` of a process that never seeded torch, on torch builds
#: with a fixed default seed (recent ones seed randomly, so ranks differ anyway).
TORCH_DEFAULT_SEED = 67280421310721


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restores python ``random``, numpy's global and torch's CPU generator on exit."""
    py_state = random.getstate()
    np_random = _numpy_random()
    np_state = np_random.get_state() if np_random is not None else None
    torch_state = torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        if np_random is not None:
            np_random.set_state(np_state)
        torch.set_rng_state(torch_state)


def seed_generators(seed: int) -> None:
    """Seeds python ``random``, numpy's global and torch's CPU generator (never CUDA)."""
    random.seed(seed)
    np_random = _numpy_random()
    if np_random is not None:
        np_random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)  # torch.manual_seed would queue CUDA seeding


def _numpy_random() -> Any:
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        return None
    return np.random


def rng_digest() -> dict[str, str | None]:
    """Short hashes of the global generators data code commonly uses.

    Python ``random`` and numpy are hashed by state. torch is described by
    ``torch.initial_seed()`` (unaffected by how many numbers a rank drew), and
    by ``None`` when it is torch's fixed default seed (equal in every process,
    so equality would say nothing).
    """

    def short(value: Any) -> str:
        return hashlib.blake2b(repr(value).encode(), digest_size=6).hexdigest()

    digest: dict[str, str | None] = {"python random": short(random.getstate())}
    np_random = _numpy_random()
    if np_random is not None:
        _, keys, pos, *_ = np_random.get_state()
        digest["numpy"] = short((keys.tobytes(), pos))
    seed = torch.initial_seed()
    digest["torch"] = None if seed == TORCH_DEFAULT_SEED else short(seed)
    return digest
