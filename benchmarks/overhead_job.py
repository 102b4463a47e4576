"""One framework's side of benchmarks/overhead.py: interleaved fits with and without RankGuard.

Composer: ``composer -n 2 overhead_job.py composer ROUNDS STEPS OUT``.
Lightning: ``python overhead_job.py lightning ROUNDS STEPS OUT`` (ddp re-launches rank 1).
Rank 0 writes the wall time of every fit to OUT as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 512
BATCH = 64


def data(steps: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH * 2, WIDTH, generator=gen)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, 2)
    )


def composer_fit(guarded: bool, steps: int) -> float:
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.utils import dist

    from rankguard.integrations.composer import RankGuard

    dataset = data(steps)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=dist.get_sampler(dataset))
    trainer = Trainer(
        model=ComposerClassifier(mlp(), num_classes=2),
        train_dataloader=loader,
        max_duration=f"{steps}ba",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[RankGuard(**CONFIG)] if guarded else [],
    )
    start = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - start
    trainer.close()
    return elapsed


def lightning_fit(guarded: bool, steps: int) -> float:
    import lightning as L

    from rankguard.integrations.lightning import RankGuard

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RankGuard(**CONFIG)] if guarded else [],
    )
    loader = DataLoader(data(steps), batch_size=BATCH)
    start = time.perf_counter()
    trainer.fit(Module(), loader)
    return time.perf_counter() - start


RANKGUARD_S = [0.0]
#: RankGuard's settings (``overhead.py --config``); all guards with defaults if unset.
CONFIG = json.loads(os.environ.get("RANKGUARD_BENCH_CONFIG") or "{}")


def time_rankguard() -> None:
    """Accumulates the time spent inside rankguard on this rank.

    That is its event dispatch and the straggler monitor's forward hooks (the
    hooks are bound when a fit starts, so timing the methods here times them).
    """
    from rankguard.callbacks.forward_clock import ForwardClock
    from rankguard.callbacks.guard import GuardRunner

    def timed(method):
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                RANKGUARD_S[0] += time.perf_counter() - start

        return run

    GuardRunner.fire = timed(GuardRunner.fire)
    ForwardClock._enter = timed(ForwardClock._enter)
    ForwardClock._leave = timed(ForwardClock._leave)


def main() -> None:
    framework, rounds, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)  # two ranks share this machine's cores
    fit = composer_fit if framework == "composer" else lightning_fit
    fit(False, 5)  # warm-up: imports, process group, allocator
    time_rankguard()
    times: dict[str, list[float]] = {"without": [], "with": [], "inside_rankguard": []}
    for i in range(2 * rounds):
        guarded = i % 2 == (i // 2) % 2  # ABBA order cancels drift
        RANKGUARD_S[0] = 0.0
        times["with" if guarded else "without"].append(fit(guarded, steps))
        if guarded:
            times["inside_rankguard"].append(RANKGUARD_S[0])
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"framework": framework, "steps": steps, **times}, f)


if __name__ == "__main__":
    main()
