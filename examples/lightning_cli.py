"""A LightningCLI job whose callbacks, rankguard included, come from YAML.

Run (2 CPU ranks, gloo)::

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit -c examples/lightning_cli.yaml --data.uneven_eval true
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset


def points(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


class Classifier(L.LightningModule):
    """A linear classifier whose validation loss is synced across ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    """Train and val data; ``uneven_eval`` gives rank 1 twice rank 0's val set.

    Args:
        uneven_eval: Inject the fault: ranks build val sets of different sizes
            (16 and 32 samples), so Lightning's distributed sampler gives them
            2 and 4 batches.
    """

    def __init__(self, uneven_eval: bool = False) -> None:
        super().__init__()
        self.uneven_eval = uneven_eval

    def train_dataloader(self):
        return DataLoader(points(64), batch_size=4)

    def val_dataloader(self):
        if not self.uneven_eval:
            return DataLoader(points(32), batch_size=4)
        size = 16 if self.trainer.global_rank == 0 else 32
        return DataLoader(points(size), batch_size=4)


def main() -> None:
    LightningCLI(Classifier, Data, save_config_callback=None)


if __name__ == "__main__":
    main()
