"""A straggler: rank 1's forward 1.5 times as long."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import seed_everything
from tests.e2e.torch_loop_concerns.harness import COUNTERS, QUICK


def straggler() -> None:
    """Rank 1's forward takes 1.5x as long (tests/e2e/straggler_common.py), 20 batches."""
    from tests.e2e.common import Points
    from tests.e2e.straggler_common import BATCH, BATCHES, STRAGGLER, SlowForward, forward_delay

    COUNTERS.clear()
    seed_everything(0)
    torch.set_num_threads(1)  # two ranks on two shared cores
    model = DistributedDataParallel(SlowForward(forward_delay(dist.get_rank(), slow=True)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Points(2 * BATCHES * BATCH)
    train_loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data))
    guard = RankGuard(straggler_monitor=STRAGGLER, **QUICK)
    with guard.fit(model, optimizer, train_loader) as run:
        for x, y in run.train(train_loader):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    COUNTERS["straggler_rank"] = run.metrics["rankguard/straggler_rank"]


SCENARIOS = {
    "straggler": straggler,
}
