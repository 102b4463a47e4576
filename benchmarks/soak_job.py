"""One healthy 2-rank training with realistic jitter, watched by ``RankGuard()`` (for soak.py).

Run: ``composer -n 2 soak_job.py composer OUT SEED [WATCHDOG_JSON]`` or
``python soak_job.py lightning OUT SEED [WATCHDOG_JSON]`` (Lightning's ``ddp``
launcher starts rank 1). Steps of ~50 ms with:

- a slow first step (3 s: compile, warm-up);
- "GC pauses": each step, with probability 1/40, a pause of 0.2-1.0 s (per-rank random);
- an eval every 40 steps whose first pass is 10x slower than the later ones;
- a checkpoint save every 30 steps;
- rank 1 slowed 2x for steps 100-160 (a straggler, not a hang);
- train and eval loaders with 2 worker processes, re-created each epoch/eval;
- a user callback that takes 3 s at every eval end, then 5 s of work on rank 0
  only (writing a file) while the other ranks wait in a barrier: slow, not a
  deadlock.

Each rank writes ``OUT/rank{N}.json``: steps, rankguard's warnings and
errors, and the watchdog's closest call (the healthy interval that came
nearest its deadline).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

FRAMEWORK, OUT, SEED = sys.argv[1], sys.argv[2], int(sys.argv[3])
WATCHDOG: dict[str, Any] = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
STEP_S, EVAL_BATCH_S, FIRST_STEP_S, EVAL_END_S = 0.05, 0.05, 3.0, 3.0
RANK0_ONLY_S = 5.0  # rank-0-only work at eval end while the others wait in a barrier
EPOCHS, STEPS_PER_EPOCH, EVAL_EVERY, EVAL_BATCHES, SAVE_EVERY = 3, 80, 40, 4, 30
GC_PAUSE_P, GC_PAUSE_S = 1 / 40, (0.2, 1.0)
STRAGGLER_RANK, STRAGGLER_STEPS = 1, range(100, 160)


class Log(logging.Handler):
    """rankguard's WARNING and ERROR lines on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


class Pace:
    """The jitter, shared by both frameworks' hooks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.rng = random.Random(SEED * 1000 + rank)
        self.steps = 0
        self.evals = 0

    def train_step(self) -> None:
        seconds = FIRST_STEP_S if self.steps == 0 else STEP_S
        if self.rank == STRAGGLER_RANK and self.steps in STRAGGLER_STEPS:
            seconds *= 2
        if self.rng.random() < GC_PAUSE_P:
            seconds += self.rng.uniform(*GC_PAUSE_S)
        time.sleep(seconds)
        self.steps += 1

    def eval_batch(self) -> None:
        time.sleep(EVAL_BATCH_S * (10 if self.evals == 0 else 1))

    def eval_end(self) -> None:
        self.evals += 1
        time.sleep(EVAL_END_S)  # a user callback: samples, uploads, a slow logger
        if self.rank == 0:  # writes a file on rank 0 only, the others wait for it
            path = os.path.join(OUT, f"samples{self.evals}.txt")
            with open(path, "w") as file:
                deadline = time.monotonic() + RANK0_ONLY_S
                while time.monotonic() < deadline:
                    file.write("sample\n")
                    time.sleep(0.01)
        torch.distributed.barrier()


def dataset(batches_per_rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(batches_per_rank)
    n = batches_per_rank * 8 * 2
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def write(rank: int, pace: Pace, log: Log, guard: Any) -> None:
    watchdog = next(g for g in guard.runner.guards if g.name == "hang_watchdog")
    record = {
        "steps": pace.steps,
        "evals": pace.evals,
        "rankguard": log.lines,
        "incidents": watchdog.incidents,
        "closest_call": watchdog.closest_call,
        "deadlines": watchdog.deadlines,
    }
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as file:
        json.dump(record, file, indent=1)


def composer_main(log: Log) -> None:
    from composer import Callback, Evaluator, Trainer
    from composer.models import ComposerClassifier
    from composer.utils import dist

    from rankguard.integrations.composer import RankGuard

    rank = dist.get_global_rank()
    pace = Pace(rank)

    class Jitter(Callback):
        def before_forward(self, state, logger):
            pace.train_step()

        def eval_before_forward(self, state, logger):
            pace.eval_batch()

        def eval_end(self, state, logger):
            pace.eval_end()

    def loader(batches: int) -> DataLoader:
        data = dataset(batches)
        sampler = dist.get_sampler(data)
        return DataLoader(data, batch_size=8, sampler=sampler, num_workers=2)

    guard = RankGuard(hang_watchdog={"report_dir": os.path.join(OUT, "reports"), **WATCHDOG})
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=loader(STEPS_PER_EPOCH),
        eval_dataloader=Evaluator(label="eval", dataloader=loader(EVAL_BATCHES)),
        eval_interval=f"{EVAL_EVERY}ba",
        max_duration=f"{EPOCHS}ep",
        save_folder=os.path.join(OUT, "checkpoints"),
        save_interval=f"{SAVE_EVERY}ba",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[guard, Jitter()],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    write(rank, pace, log, guard)


def lightning_main(log: Log) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rankguard.integrations.lightning import RankGuard

    pace = Pace(int(os.environ.get("LOCAL_RANK", "0")))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            pace.train_step()
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if not self.trainer.sanity_checking:
                pace.eval_batch()
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.layer(x), y)
            self.log("val_loss", loss, sync_dist=True)

        def train_dataloader(self) -> DataLoader:  # re-created each epoch
            return DataLoader(dataset(STEPS_PER_EPOCH), batch_size=8, num_workers=2)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(dataset(EVAL_BATCHES), batch_size=8, num_workers=2)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class EvalEnd(L.Callback):
        def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if not trainer.sanity_checking:
                pace.eval_end()

    guard = RankGuard(hang_watchdog={"report_dir": os.path.join(OUT, "reports"), **WATCHDOG})
    saves = ModelCheckpoint(
        dirpath=os.path.join(OUT, "checkpoints"), every_n_train_steps=SAVE_EVERY, save_top_k=-1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        val_check_interval=EVAL_EVERY,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[guard, EvalEnd(), saves],
    )
    trainer.fit(Module())
    write(trainer.global_rank, pace, log, guard)


def main() -> None:
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    log = Log()
    logging.getLogger("rankguard").addHandler(log)
    composer_main(log) if FRAMEWORK == "composer" else lightning_main(log)


if __name__ == "__main__":
    main()
