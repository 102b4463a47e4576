"""A 2-rank CPU Lightning training (``strategy="ddp"``) with rankguard, and an optional fault.

Run it as a plain script; Lightning's launcher starts the second rank and both
ranks print to this terminal::

    python examples/lightning_train.py                      # healthy
    python examples/lightning_train.py --fault uneven_eval
    python examples/lightning_train.py --fault uneven_eval --no-rankguard

Faults (``examples/faults.py``; where a deadline must pass, the example sets it
to 5 s for the demo):

    uneven_eval       ranks build val sets of different sizes (16 and 32 samples)
    uneven_train      ranks build train sets of different sizes
    drop_last         rank 0 builds its train loader with drop_last=True, rank 1 without
    unseeded_split    every rank splits train/val with an unseeded shuffle
    slow_data         rank 1's dataset sleeps in __getitem__: DataStallMonitor names rank 1
    straggler         rank 1's forward takes 1.5x as long: StragglerMonitor names rank 1
    post_eval_hang    rank 1 sleeps forever after the first validation: HangWatchdog, exit 75
    node_local_ckpt   each rank saves to its own directory (Lightning then uses rank 0's)
    short_stream      rank 0's val stream ends 4 samples short of the 16 its __len__ says
    ckpt_over_memory  CheckpointPlanner told the node has 1 MiB for a full save
    replica_drift     rank 0 alone clamps its output layer: ReplicaGuard names the ranks
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import lightning as L
import torch
from faults import (
    BATCH_SIZE,
    FaultSetup,
    RankData,
    log_with_rank,
    parse_args,
    planned_samples,
    setup,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

log = logging.getLogger("example")


class Classifier(L.LightningModule):
    """Trains ``net`` with cross-entropy; the validation loss is averaged over ranks."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class FaultData(L.LightningDataModule):
    """This rank's train and val data, as the fault builds them."""

    def __init__(self, fault: FaultSetup) -> None:
        super().__init__()
        self.fault = fault
        self.data: RankData | None = None

    def setup(self, stage: str) -> None:
        self.data = self.fault.data(self.trainer.global_rank)
        self.data.describe(self.trainer.global_rank)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.data.train, batch_size=BATCH_SIZE, drop_last=self.data.train_drop_last
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data.eval, batch_size=BATCH_SIZE)


class Progress(L.Callback):
    """Logs, per rank, the train batches and val samples that actually ran, and the time."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        took = time.perf_counter() - self.started
        log.info("rank %d trained for %.1f s", trainer.global_rank, took)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.batches += 1

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank, planned = trainer.global_rank, len(trainer.train_dataloader)
        log.info("rank %d trained %d of its %d train batches", rank, self.batches, planned)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.seen = 0

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        self.seen += len(batch[0])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        rank, planned = trainer.global_rank, planned_samples(trainer.val_dataloaders)
        log.info("rank %d evaluated %d of its %d eval samples", rank, self.seen, planned)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:  # synced over ranks, so the same on every rank
            loss = float(trainer.callback_metrics["val_loss"])
            log.info("rank %d: val_loss averaged over ranks: %.4f", trainer.global_rank, loss)


class InjectFault(L.Callback):
    """What a rank does differently: its checkpoint folder is cleared, it hangs after validation."""

    def __init__(self, fault: FaultSetup) -> None:
        self.fault = fault

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.fault.clear_checkpoints(trainer.global_rank)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank = trainer.global_rank
        if self.fault.hangs_after_eval(rank) and not trainer.sanity_checking:
            log.info("rank %d: sleeping forever after validation (injected fault)", rank)
            while True:
                time.sleep(3600)


def main() -> None:
    args = parse_args(__doc__)
    log_with_rank()
    for noisy in ("lightning.pytorch", "lightning.fabric", "rankguard.callbacks.drop_last"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    L.seed_everything(0, verbose=False)  # python random, numpy and torch, the same on every rank

    fault = setup(args.fault, args.workdir)
    # Lightning's launcher starts rank 1 with LOCAL_RANK=1 (one node: local = global rank).
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    callbacks: list[L.Callback] = [Progress(), InjectFault(fault)]
    if not args.no_rankguard:
        from rankguard.integrations.lightning import RankGuard

        callbacks.insert(0, RankGuard(**fault.rankguard))
    if fault.save_dir is not None:
        # Each rank names its own folder (Lightning then uses rank 0's path on every rank).
        callbacks.append(ModelCheckpoint(dirpath=fault.checkpoint_dir(rank), save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=fault.epochs,
        logger=False,
        enable_checkpointing=fault.save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Classifier(fault.model(rank)), datamodule=FaultData(fault))
    fault.report(trainer.global_rank)
    log.info("training finished")


if __name__ == "__main__":
    main()
