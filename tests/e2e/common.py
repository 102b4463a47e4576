"""Tiny data and a per-rank outcome recorder shared by the end-to-end jobs."""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset


class Points(Dataset):
    """``n`` deterministic (x, label) pairs: 4 features, 2 classes."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class LyingSampler(DistributedSampler):
    """Claims ``claimed`` samples but yields ``actual`` (a loader whose __len__ lies)."""

    def __init__(self, dataset: Dataset, claimed: int, actual: int) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=False)
        self.claimed, self.actual = claimed, actual

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.actual))


class WarningCollector(logging.Handler):
    """Collects rankguard's warnings (the job configures logging, rankguard never does)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Recorder:
    """Writes each scenario's outcome on this rank to ``out_dir/rank{N}.json``."""

    def __init__(self, out_dir: str) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.path = Path(out_dir) / f"rank{self.rank}.json"
        self.results: dict[str, dict] = {}
        self.collector = WarningCollector()
        logging.getLogger("rankguard").addHandler(self.collector)

    def run(self, name: str, fn, counters: dict) -> None:
        self.collector.messages.clear()
        result: dict = {"outcome": "ok"}
        try:
            fn()
        except Exception as exc:
            result = {
                "outcome": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
            }
        result["warnings"] = list(self.collector.messages)
        result["counters"] = dict(counters)
        self.results[name] = result
        self.path.write_text(json.dumps(self.results, indent=1))
        if result["outcome"] != "ok" and os.environ.get("E2E_RERAISE") == "1":
            raise SystemExit(f"{result['outcome']}: {result['message']}")


class Stream(IterableDataset):
    """An iterable (streaming-style) dataset without ``__len__``: ``n`` points."""

    def __init__(self, n: int) -> None:
        self.points = Points(n)

    def __iter__(self):
        return (self.points[i] for i in range(len(self.points)))


class ClaimedStream(Stream):
    """An iterable dataset whose ``__len__`` says ``claimed`` samples; it yields ``n``."""

    def __init__(self, n: int, claimed: int) -> None:
        super().__init__(n)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed
