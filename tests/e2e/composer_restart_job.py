"""A Composer job that hangs on its first attempt, for ``torchrun --max-restarts=1``.

Run: ``torchrun --standalone --nproc-per-node=2 --max-restarts=1 composer_restart_job.py OUT``.

Both attempts run the same fit: 12 train batches, an eval every 4 and a
checkpoint every 2, with ``autoresume`` and ``RankGuard`` (hang watchdog
aborting at its calibrated deadline, 4 s floor). On the first attempt rank 1
never returns from the second eval (batch 8): the watchdog ends every rank
with exit code 75 and torchrun starts the second attempt, which resumes from
the last checkpoint and finishes. Each rank writes
``OUT/attempt{N}_rank{R}.json`` at fit start (pid, the batch it starts from,
whether the watchdog's calibration came from the checkpoint, its deadlines)
and again at fit end (the batch it ended at).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
from composer import Callback, Evaluator, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import Points

OUT = sys.argv[1]
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
WATCHDOG = {
    "abort_at": "calibrated",
    "floor_s": 4.0,
    "warmup_steps": 0,
    "exchange_period_s": 0.5,
    "report_dir": os.path.join(OUT, "reports"),
}


def stall_after_eval() -> None:
    """The bug, on the first attempt only: rank 1 never comes back from its second eval."""
    with open(os.path.join(OUT, "stall.json"), "w") as file:
        json.dump({"t": time.time()}, file)
    time.sleep(3600)


class Record(Callback):
    """Writes what this rank starts from and ends at; stalls rank 1 once."""

    def __init__(self, guard: RankGuard) -> None:
        self.guard = guard
        self.record: dict = {"pid": os.getpid()}

    def _write(self) -> None:
        path = os.path.join(OUT, f"attempt{ATTEMPT}_rank{dist.get_global_rank()}.json")
        with open(path, "w") as file:
            json.dump(self.record, file, indent=1)

    def fit_start(self, state, logger):
        watchdog = next(g for g in self.guard.runner.guards if g.name == "hang_watchdog")
        self.record.update(
            start_batch=int(state.timestamp.batch),
            restored=watchdog._restored,
            deadlines=watchdog.deadlines,
        )
        self._write()

    def eval_end(self, state, logger):
        if ATTEMPT == 0 and dist.get_global_rank() == 1 and int(state.timestamp.batch) == 8:
            stall_after_eval()

    def fit_end(self, state, logger):
        self.record["end_batch"] = int(state.timestamp.batch)
        self._write()


def sharded(n: int) -> DataLoader:
    data = Points(n)
    return DataLoader(data, batch_size=4, sampler=dist.get_sampler(data))


def main() -> None:
    # Composer reads the node's index from NODE_RANK; torchrun names it GROUP_RANK.
    os.environ.setdefault("NODE_RANK", os.environ["GROUP_RANK"])
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("rankguard.callbacks.hang_watchdog").setLevel(logging.INFO)
    torch.manual_seed(0)
    guard = RankGuard(hang_watchdog=WATCHDOG)  # first: it sees EVAL_END before the stall
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=sharded(64),  # 8 batches per rank and epoch
        eval_dataloader=Evaluator(label="eval", dataloader=sharded(32)),
        eval_interval="4ba",
        max_duration="12ba",
        save_folder=os.path.join(OUT, "checkpoints"),
        save_interval="2ba",
        run_name="restart",
        autoresume=True,
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[guard, Record(guard)],
    )
    try:
        trainer.fit()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
