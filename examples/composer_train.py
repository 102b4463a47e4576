"""A 2-rank CPU Composer training with rankguard, and an optional injected fault.

Run with Composer's launcher::

    composer -n 2 examples/composer_train.py --fault uneven_eval
    composer -n 2 examples/composer_train.py --fault uneven_eval --no-rankguard
    composer -n 2 examples/composer_train.py            # healthy

Faults:
    uneven_eval: ranks build eval sets of different sizes (remote/streaming data
        that split unevenly): 2 eval batches on rank 0, 4 on rank 1.
    uneven_train: ranks build train sets of different sizes.
    drop_last: rank 0 builds its train loader with drop_last=True, rank 1 without.
"""

from __future__ import annotations

import argparse
import logging

import torch
from composer import Callback, Evaluator, Trainer
from composer.models import ComposerClassifier
from composer.utils import dist
from torch.utils.data import DataLoader, TensorDataset

log = logging.getLogger("example")


def points(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def loader(n: int, drop_last: bool = False) -> DataLoader:
    data = points(n)
    return DataLoader(data, batch_size=4, sampler=dist.get_sampler(data), drop_last=drop_last)


class EvalSamples(Callback):
    """Logs how many eval samples each rank actually evaluated."""

    def eval_start(self, state, logger):
        self.seen = 0

    def eval_batch_end(self, state, logger):
        self.seen += len(state.batch[0])

    def eval_end(self, state, logger):
        planned = len(state.dataloader.sampler)
        log.info(
            "rank %d evaluated %d of its %d eval samples",
            dist.get_global_rank(),
            self.seen,
            planned,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["none", "uneven_eval", "uneven_train", "drop_last"])
    parser.add_argument("--no-rankguard", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="[rank %(rank)s] %(levelname)s %(name)s: %(message)s"
    )
    rank = dist.get_global_rank()
    old_factory = logging.getLogRecordFactory()

    def factory(*a, **kw):
        record = old_factory(*a, **kw)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    for noisy in ("composer", "rankguard.callbacks.drop_last"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    fault = args.fault or "none"
    # drop_last: 33 samples per rank, 8 full batches and a partial one.
    sizes = {"uneven_train": 32 if rank == 0 else 48, "drop_last": 66}
    train = loader(sizes.get(fault, 64), drop_last=fault == "drop_last" and rank == 0)
    eval_size = (16 if rank == 0 else 32) if fault == "uneven_eval" else 32
    callbacks: list[Callback] = [EvalSamples()]
    if not args.no_rankguard:
        from rankguard.integrations.composer import RankGuard

        callbacks.insert(0, RankGuard())
    torch.manual_seed(0)
    trainer = Trainer(
        model=ComposerClassifier(torch.nn.Linear(8, 2), num_classes=2),
        train_dataloader=train,
        eval_dataloader=Evaluator(label="eval", dataloader=loader(eval_size)),
        max_duration="1ep",
        eval_interval="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=callbacks,
    )
    trainer.fit()
    log.info("training finished")
    trainer.close()


if __name__ == "__main__":
    main()
