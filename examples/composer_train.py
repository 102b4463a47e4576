"""A 2-rank CPU Composer training with rankguard, and an optional injected fault.

Run with Composer's launcher (it shows local rank 0's output; add
``--stdout 'rank{rank}.out' --stderr 'rank{rank}.err'`` before the script to keep
the other rank's)::

    composer -n 2 examples/composer_train.py                      # healthy
    composer -n 2 examples/composer_train.py --fault uneven_eval
    composer -n 2 examples/composer_train.py --fault uneven_eval --no-rankguard

Faults (``examples/faults.py``; where a deadline must pass, the example sets it
to 5 s for the demo):

    uneven_eval       ranks build eval sets of different sizes (16 and 32 samples)
    uneven_train      ranks build train sets of different sizes
    drop_last         rank 0 builds its train loader with drop_last=True, rank 1 without
    unseeded_split    every rank splits train/eval with an unseeded shuffle
    slow_data         rank 1's dataset sleeps in __getitem__: DataStallMonitor names rank 1
    straggler         rank 1's forward takes 1.5x as long: StragglerMonitor names rank 1
    post_eval_hang    rank 1 sleeps forever after the first eval: HangWatchdog, exit code 75
    node_local_ckpt   each rank is a node of its own, saving to its own directory (a local disk)
    short_stream      rank 0's eval stream ends 4 samples short of the 16 its __len__ says
    ckpt_over_memory  CheckpointPlanner told the node has 1 MiB for a full save
    replica_drift     rank 0 alone clamps its output layer: ReplicaGuard names the ranks
"""

from __future__ import annotations

import logging
import os
import time

import torch
from composer import Callback, Evaluator, State, Trainer
from composer.loggers import Logger
from composer.models import ComposerClassifier
from composer.utils import dist
from faults import BATCH_SIZE, log_with_rank, parse_args, planned_samples, setup
from torch.utils.data import DataLoader, Dataset, IterableDataset

log = logging.getLogger("example")


def loader(data: Dataset, drop_last: bool = False) -> DataLoader:
    if isinstance(data, IterableDataset):  # the rank's own stream
        return DataLoader(data, batch_size=BATCH_SIZE)
    return DataLoader(
        data, batch_size=BATCH_SIZE, sampler=dist.get_sampler(data), drop_last=drop_last
    )


class Progress(Callback):
    """Logs, per rank, the train batches and eval samples that actually ran, and the time."""

    def fit_start(self, state: State, logger: Logger) -> None:
        self.started = time.perf_counter()

    def fit_end(self, state: State, logger: Logger) -> None:
        took = time.perf_counter() - self.started
        log.info("rank %d trained for %.1f s", dist.get_global_rank(), took)

    def epoch_start(self, state: State, logger: Logger) -> None:
        self.batches = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        self.batches += 1

    def epoch_end(self, state: State, logger: Logger) -> None:
        rank, planned = dist.get_global_rank(), len(state.dataloader)
        log.info("rank %d trained %d of its %d train batches", rank, self.batches, planned)

    def eval_start(self, state: State, logger: Logger) -> None:
        self.seen = 0

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        self.seen += len(state.batch[0])

    def eval_end(self, state: State, logger: Logger) -> None:
        rank, planned = dist.get_global_rank(), planned_samples(state.dataloader)
        log.info("rank %d evaluated %d of its %d eval samples", rank, self.seen, planned)


class HangAfterEval(Callback):
    """The ``post_eval_hang`` fault: this rank never comes back from its first eval."""

    def eval_end(self, state: State, logger: Logger) -> None:
        log.info("rank %d: sleeping forever after eval (injected fault)", dist.get_global_rank())
        while True:
            time.sleep(3600)


def main() -> None:
    args = parse_args(__doc__)
    log_with_rank()
    for noisy in ("composer", "rankguard.callbacks.drop_last"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    rank = dist.get_global_rank()
    fault = setup(args.fault, args.workdir)
    if fault.node_of(rank) is not None:  # this rank plays a node of its own
        os.environ["NODE_RANK"] = fault.node_of(rank)
    fault.clear_checkpoints(rank)
    data = fault.data(rank)
    data.describe(rank)
    callbacks: list[Callback] = [Progress()]
    if fault.hangs_after_eval(rank):
        callbacks.append(HangAfterEval())
    if not args.no_rankguard:
        from rankguard.integrations.composer import RankGuard

        callbacks.insert(0, RankGuard(**fault.rankguard))
    model = fault.model(rank)
    trainer = Trainer(
        model=ComposerClassifier(model, num_classes=2),
        optimizers=torch.optim.Adam(model.parameters(), lr=0.01),
        train_dataloader=loader(data.train, drop_last=data.train_drop_last),
        eval_dataloader=Evaluator(label="eval", dataloader=loader(data.eval)),
        max_duration=f"{fault.epochs}ep",
        eval_interval="1ep",
        save_folder=fault.save_dir,
        save_interval="1ep",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=callbacks,
    )
    trainer.fit()
    fault.report(rank)
    log.info("training finished")
    trainer.close()


if __name__ == "__main__":
    main()
