"""What the straggler jobs share: a forward that takes a set time, slow reads, the settings.

A rank "computing 1.5x slower" is a forward pass that takes 1.5x as long: the
model's own layers plus a sleep, as the host sees a slower device (it waits
for it). Sleeping, unlike busy compute, does not take the 2 shared cores from
the other rank, so the two ranks' times stay what the scenario says.
"""

from __future__ import annotations

import time

import torch

from tests.e2e.common import Points, SlowItems

#: Forward time of a healthy rank (seconds) and a straggler's factor.
FORWARD_S, SLOW_FACTOR = 0.02, 1.5
#: Scored every 4 batches after 2 of warm-up, named after 3 slow intervals. A 1.5x forward
#: scores 0.67; on shared cores the layers' own time lifts it towards 0.7, hence 0.8.
STRAGGLER = {"threshold": 0.8, "window": 3, "interval": 4, "warmup_steps": 2}
#: The data-stall monitor in the slow-data scenario (its e2e tests' settings).
STALL = {"threshold": 0.5, "window": 3, "interval": 4}
#: Rank 1's reads in the slow-data scenario: a batch of 4 items takes 160 ms, about 2.5x a
#: whole step on 2 busy cores (~60 ms), so every step waits well over half its time.
SLOW_ITEM_S = 0.04
#: Train batches per rank: 2 of warm-up, 4 intervals of 4, the last verdict's 2.
BATCHES = 20
BATCH = 4
#: The third slow verdict arrives 2 batches after the third interval's post (batch 12).
NAMED_AT_BATCH = 14


class SlowForward(torch.nn.Module):
    """``Linear(4, width)``, ReLU, ``Linear(width, 2)`` whose forward takes ``delay_s`` more.

    BatchNorm's buffers make DDP broadcast them at the start of every forward:
    a rank that gets there first waits in it for the others.
    """

    def __init__(self, delay_s: float, width: int = 16) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.norm = torch.nn.BatchNorm1d(4)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.net(self.norm(x))


def forward_delay(rank: int, slow: bool, base_s: float = FORWARD_S) -> float:
    """Rank ``rank``'s extra forward time: ``base_s``, 1.5x on rank 1 when ``slow``."""
    return base_s * (SLOW_FACTOR if slow and rank == 1 else 1.0)


def slow_reads(n: int, rank: int, slow: bool, seed: int = 0) -> SlowItems:
    """``Points(n, seed)`` whose items take ``SLOW_ITEM_S`` to read on rank 1 when ``slow``."""
    return SlowItems(Points(n, seed), SLOW_ITEM_S if slow and rank == 1 else 0.0)
