"""A hand-written loop under torchrun whose ranks build their train loader differently.

``DropLastGuard`` (through the core ``GuardRunner``) raises at fit start on
every rank and nothing catches it, so every rank exits non-zero; torchrun
then stops the job. Usage::

    torchrun --nproc-per-node 2 tests/e2e/torchrun_error_job.py
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.callbacks import DropLastGuard, Event, EventFacts, GuardRunner, LoaderFacts
from tests.e2e.common import Points


def main() -> None:
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    data = Points(20)
    sampler = DistributedSampler(data, dist.get_world_size(), rank)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=rank == 0)
    runner = GuardRunner([DropLastGuard()], exchange_timeout_s=60)
    runner.fire(Event.FIT_START, EventFacts(loaders=[LoaderFacts("train", loader, True)]))


if __name__ == "__main__":
    main()
