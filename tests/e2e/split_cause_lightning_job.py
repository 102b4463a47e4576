"""Lightning ``ddp`` on 2 CPU ranks, manual optimization: rank 1 skips ``manual_backward``.

Usage: ``python tests/e2e/split_cause_lightning_job.py OUT_DIR`` (Lightning's launcher starts
rank 1 with the same arguments). ``training_step`` returns early when the loss is not finite,
as a user guards against a bad batch: on rank 1 the sixth batch's loss is not, so rank 1
leaves it without ``self.manual_backward(loss)`` and ``opt.step()``. The moment goes to
``OUT_DIR/split.json``, reports to ``OUT_DIR/reports``. ``E2E_RANKGUARD=off``: no rankguard.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.e2e.common import rankguard_off

OUT = Path(".")


class SkipsBadBatches(L.LightningModule):
    """Linear(4, 1) with a buffer (DDP broadcasts it before each forward); manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(4, 1)
        self.register_buffer("scale", torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x) * self.scale, y)
        if self.global_rank == 1 and batch_idx == 5:
            loss = loss * float("nan")  # a bad batch
            (OUT / "split.json").write_text(json.dumps({"t": time.time(), "rank": 1}))
        if not torch.isfinite(loss):
            return None
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        time.sleep(0.05)
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    rank = os.environ.get("LOCAL_RANK", "0")
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(80, 4), torch.randn(80, 1))
    callbacks: list[Any] = []
    if not rankguard_off():
        from rankguard.integrations.lightning import RankGuard

        callbacks.append(RankGuard(hang_watchdog={"report_dir": str(OUT / "reports")}))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SkipsBadBatches(), DataLoader(data, batch_size=4))
    (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps({"returned": time.time()}))


if __name__ == "__main__":
    main()
