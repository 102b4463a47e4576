"""What every loop scenario shares: the launch's state, the model, the loop itself.

``OUT`` is set by ``tests/e2e/torch_loop_job.py`` (read it as ``harness.OUT``); ``COUNTERS``
is what a scenario records beside its outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import VOCAB, seed_everything

COUNTERS: dict[str, int] = {}
OUT = Path(".")
#: Fast watchdog exchanges, so that a fit's end is quick; deadlines stay at their defaults.
QUICK = {"hang_watchdog": {"exchange_period_s": 0.5}}


class BagOfTokens(torch.nn.Module):
    """Mean token embedding -> 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(VOCAB, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def loader(dataset) -> DataLoader:
    data = dataset.with_format("torch")
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))


def count(name: str) -> None:
    COUNTERS[name] = COUNTERS.get(name, 0) + 1


def fit(
    guard: RankGuard,
    train_set,
    eval_set,
    *,
    eval_at_fit: bool = True,
    epochs: int = 1,
    after_eval: Callable[[], None] | None = None,
    check: Callable[[dict, int], None] | None = None,
) -> None:
    """The loop: train, eval every 4 steps (loss summed over ranks), save every 4 steps.

    ``check(batch, step)``: the user's data check, first thing in each step; ``step`` as a
    loop's own counter has it (the steps done before this one: 0 in the first, where
    ``run.step`` is 1) and as rankguard's reports name it.
    """
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(BagOfTokens())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader, eval_loader = loader(train_set), loader(eval_set)
    ckpt = OUT / "ckpt"
    evals = {"eval": eval_loader} if eval_at_fit else None
    with guard.fit(model, optimizer, train_loader, eval_loaders=evals, save_dirs=[ckpt]) as run:
        for epoch in range(epochs):
            train_loader.sampler.set_epoch(epoch)
            for batch in run.train(train_loader):
                count("train_batches")
                if check is not None:
                    check(batch, run.step - 1)
                loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if run.step % 4 == 0:
                    model.eval()
                    with torch.no_grad():
                        for batch in run.eval(eval_loader):
                            count("eval_batches")
                            out = model(batch["input_ids"])
                            eval_loss = torch.nn.functional.cross_entropy(out, batch["labels"])
                            dist.all_reduce(eval_loss)
                    model.train()
                    if after_eval is not None:
                        after_eval()
                    with run.checkpoint(ckpt):
                        if dist.get_rank() == 0:
                            torch.save(model.module.state_dict(), ckpt / f"step{run.step}.pt")
                        count("saves")
    COUNTERS["steps"] = run.step
    COUNTERS["epochs"] = run.epoch + 1


def check_batch(batch: dict, step: int, bad_step: int) -> None:
    """The user's data check: on rank 1, train step ``bad_step`` has a sample with no tokens."""
    if dist.get_rank() == 1 and step == bad_step:
        raise ValueError("sample 4711 has no tokens after filtering")
