"""A preemption reaching rank 1 only, in a real 2-rank Composer job (CPU, gloo).

Run: ``composer -n 2 composer_stop_job.py OUT self|launcher [sharded]``, or one
``composer --world_size 2 --nproc 1 --node_rank N ...`` per node. At the end of train batch
``SIGNAL_AT`` rank 1 writes the moment to ``OUT/signalled.json`` and, with ``self``, sends
itself SIGTERM; with ``launcher`` the test sends SIGTERM to its node's launcher, which
passes it on (the handler ``import composer`` installs there raises ``SystemExit``, and the
launcher's clean-up sends SIGTERM to the ranks it started). ``RankGuard`` at its defaults
agrees the stop: every rank's fit ends after the same batch, where the ``CheckpointSaver``
(``save_folder=OUT/ckpt``, an interval far past the stop) saves as at the end of training.
At ``FIT_END`` each rank writes ``OUT/rank{N}.json`` (its batch, the time); the process
then exits with 75. Log lines carry their Unix time.

``RANKGUARD=off`` runs the same job without the ``RankGuard`` callback
(``benchmarks/preemption.py``): the same signal at the same batch, the same saver.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from composer import Callback, Trainer
from composer.models import ComposerClassifier
from composer.utils import FSDP2Config, dist
from torch.utils.data import DataLoader

from rankguard.integrations.composer import RankGuard
from tests.e2e.common import Points

SIGNAL_AT = 6
STEP_S = 0.05
BATCHES = 400  # ~20 s of batches: the stop comes long before
BATCH = 4


class Preempt(Callback):
    """Paces the batches; rank 1 signals itself at ``SIGNAL_AT``; FIT_END records the batch."""

    def __init__(self, out: Path, sender: str) -> None:
        self.out = out
        self.sender = sender

    def batch_end(self, state: Any, logger: Any) -> None:
        time.sleep(STEP_S)
        if dist.get_global_rank() == 1 and int(state.timestamp.batch) == SIGNAL_AT:
            (self.out / "signalled.json").write_text(
                json.dumps({"at": time.time(), "step": SIGNAL_AT})
            )
            if self.sender == "self":
                os.kill(os.getpid(), signal.SIGTERM)

    def fit_end(self, state: Any, logger: Any) -> None:
        record = {"step": int(state.timestamp.batch), "ended_at": time.time()}
        (self.out / f"rank{dist.get_global_rank()}.json").write_text(json.dumps(record))


def main() -> None:
    out, sender = Path(sys.argv[1]).resolve(), sys.argv[2]
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    data = Points(BATCHES * BATCH * 2)
    train = DataLoader(data, batch_size=BATCH, sampler=dist.get_sampler(data))
    guards = (
        []
        if os.environ.get("RANKGUARD") == "off"
        else [RankGuard(hang_watchdog={"report_dir": str(out / "reports")})]
    )
    sharded = sys.argv[3:] == ["sharded"]
    fsdp = {"fsdp": FSDP2Config(state_dict_type="sharded")} if sharded else None
    job = Trainer(
        model=ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2),
        train_dataloader=train,
        callbacks=[*guards, Preempt(out, sender)],
        max_duration=f"{BATCHES}ba",
        save_folder=str(out / "ckpt"),
        save_interval=f"{BATCHES * 10}ba",
        parallelism_config=fsdp,
        loggers=[],
        device="cpu",
        progress_bar=False,
        log_to_console=False,
    )
    try:
        job.fit()
    finally:
        job.close()


if __name__ == "__main__":
    main()
