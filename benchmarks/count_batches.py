"""What counting a loader's batches before the first batch costs (``BatchParityGuard``).

``count_batches`` iterates the batch sampler for indices only, with every
random generator restored. Prints, per sampler over a dataset of
``--samples`` items (default: the cap, ``DEFAULT_MAX_SAMPLES``), the batches
counted and the median wall time of ``--repeats`` counts::

    python benchmarks/count_batches.py [--samples N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from rankguard.callbacks.batches.loader_passes import DEFAULT_MAX_SAMPLES, count_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_MAX_SAMPLES)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = TensorDataset(torch.zeros(args.samples, 1))
    samplers = {
        "DistributedSampler, 8 ranks, shuffled": DistributedSampler(data, 8, 0, shuffle=True),
        "DistributedSampler, 1 rank, shuffled": DistributedSampler(data, 1, 0, shuffle=True),
        "RandomSampler": RandomSampler(data),
        "SequentialSampler": None,
    }
    print(f"{args.samples} samples, batch size 32, median of {args.repeats}")
    for name, sampler in samplers.items():
        loader = DataLoader(data, batch_size=32, sampler=sampler)
        times, counted = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            counted = count_batches(loader, max_samples=args.samples)
            times.append(time.perf_counter() - started)
        print(f"{name:40s} {counted.batches:>7} batches  {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
