"""How long one rank's dataset fingerprint takes, by dataset size and item type.

Run: ``python benchmarks/fingerprint.py``. The cost is ``sample_items`` item
reads plus hashing, whatever the dataset's length; the claim checked here is
"a 1M-item dataset fingerprints in < 1 s".
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from rankguard.callbacks.data.fingerprint import fingerprint_loader
from rankguard.callbacks.data.rng_state import rng_digest


class TokenDataset(Dataset):
    """1M tokenized samples as dicts of numpy arrays (a typical LM dataset)."""

    def __init__(self, n: int, seq_len: int = 2048) -> None:
        self.n = n
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        ids = rng.integers(0, 50_000, self.seq_len, dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "id": f"doc-{i}"}


def bench(label: str, loader: object, k: int = 16, repeats: int = 5) -> None:
    fingerprint_loader(loader, k)  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        fp = fingerprint_loader(loader, k)
    per = (time.perf_counter() - start) / repeats
    verdict = "OK" if per < 1.0 else "TOO SLOW"
    print(f"{label:<48} k={k:<3} {per * 1e3:8.2f} ms  {fp.content_kind:<5} {verdict}")


def main() -> None:
    n = 1_000_000
    tensors = TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    sampler = DistributedSampler(tensors, num_replicas=8, rank=0, seed=0)
    bench("TensorDataset 1M x (64 floats, label)", DataLoader(tensors, sampler=sampler))
    bench("list of 1M python dicts", DataLoader([{"text": f"s{i}", "y": i} for i in range(n)]))
    tokens = TokenDataset(n)
    bench("1M tokenized samples (2 x 2048 int64 + str)", DataLoader(tokens))
    bench("1M tokenized samples (2 x 2048 int64 + str)", DataLoader(tokens), k=64)
    bench("1M-row numpy memmap-like array", DataLoader(np.zeros((n, 128), dtype=np.float16)))
    start = time.perf_counter()
    for _ in range(100):
        rng_digest()
    per_ms = (time.perf_counter() - start) * 10
    print(f"{'rng_digest (python, numpy, torch)':<48} {'':6}{per_ms:8.2f} ms")


if __name__ == "__main__":
    main()
