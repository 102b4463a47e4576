"""A 2-rank CPU Hugging Face ``Trainer`` with rankguard, and an optional fault.

Run it with ``torchrun`` (gloo on CPU; both ranks print to this terminal)::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py         # healthy
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --fault drop_last
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --fault drop_last --no-rankguard

Faults (``examples/faults.py``; where a deadline must pass, the example sets it
to 5 s for the demo):

    uneven_eval       ranks build eval sets of different sizes (16 and 32 samples)
    uneven_train      ranks build train sets of different sizes
    drop_last         rank 0 sets dataloader_drop_last=True, rank 1 does not
    unseeded_split    every rank splits with `datasets`' train_test_split and no seed
    slow_data         rank 1's dataset sleeps in __getitem__: DataStallMonitor names rank 1
    straggler         rank 1's forward takes 1.5x as long: StragglerMonitor names rank 1
    post_eval_hang    rank 1 sleeps forever after the first eval: HangWatchdog, exit code 75
    node_local_ckpt   each rank is a node of its own, saving to its own directory (a local disk)
    ckpt_over_memory  CheckpointPlanner told the node has 1 MiB for a full save
    replica_drift     rank 0 alone clamps its output layer: ReplicaGuard names the ranks

Not offered: ``short_stream``. The Trainer (through Accelerate) reads an
``IterableDataset`` on rank 0 only and hands its batches out to every rank
(``dispatch_batches``), so there is no stream of a rank's own to run short.

rankguard is one callback: ``Trainer(..., callbacks=[RankGuard()])``. The
model is the examples' MLP as a plain ``torch.nn.Module`` that returns its
loss; nothing needs the network.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from faults import BATCH_SIZE, FaultSetup, log_with_rank, parse_args, setup
from torch.utils.data import default_collate
from transformers import Trainer, TrainerCallback, TrainingArguments

log = logging.getLogger("example")


class Classifier(torch.nn.Module):
    """``net`` with the loss the Trainer reads (``{"loss", "logits"}``)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.net(x)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def collate(rows: list[Any]) -> dict[str, torch.Tensor]:
    """Batches ``(x, label)`` pairs or ``datasets`` rows into ``{"x", "labels"}``."""
    if isinstance(rows[0], dict):
        rows = [(torch.tensor(r["x"]), torch.tensor(r["labels"])) for r in rows]
    x, labels = default_collate(rows)
    return {"x": x, "labels": labels}


class Progress(TrainerCallback):
    """Logs, per rank, the train and eval batches that actually ran, and the time."""

    def __init__(self, rank: int) -> None:
        self.rank, self.trained, self.evaluated = rank, 0, 0

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.started, self.planned = time.perf_counter(), len(train_dataloader)

    def on_step_end(self, args, state, control, **kwargs):
        self.trained += 1

    def on_epoch_end(self, args, state, control, **kwargs):
        trained, planned = self.trained, self.planned
        log.info("rank %d trained %d of its %d train batches", self.rank, trained, planned)
        self.trained = 0

    def on_prediction_step(self, args, state, control, **kwargs):
        self.evaluated += 1

    def on_evaluate(self, args, state, control, eval_dataloader=None, **kwargs):
        planned = len(eval_dataloader)
        log.info("rank %d evaluated %d of its %d eval batches", self.rank, self.evaluated, planned)
        self.evaluated = 0

    def on_train_end(self, args, state, control, **kwargs):
        log.info("rank %d trained for %.1f s", self.rank, time.perf_counter() - self.started)


class HangAfterEval(TrainerCallback):
    """The ``post_eval_hang`` fault: this rank never comes back from its first eval."""

    def on_evaluate(self, args, state, control, **kwargs):
        log.info("rank %d: sleeping forever after eval (injected fault)", args.process_index)
        while True:
            time.sleep(3600)


def main() -> None:
    args = parse_args(__doc__, without=("short_stream",))
    log_with_rank()
    for noisy in ("transformers", "rankguard.callbacks.drop_last"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    rank = int(os.environ.get("RANK", "0"))
    fault: FaultSetup = setup(args.fault, args.workdir)
    if fault.node_of(rank) is not None:  # this rank plays a node of its own
        os.environ["NODE_RANK"] = fault.node_of(rank)
    fault.clear_checkpoints(rank)
    fault.make_node_disk(rank)
    data = fault.data(rank, hf_datasets=True)  # before the Trainer seeds anything
    data.describe(rank)
    callbacks: list[TrainerCallback] = [Progress(rank)]
    if fault.hangs_after_eval(rank):
        callbacks.append(HangAfterEval())
    if not args.no_rankguard:
        from rankguard.integrations.transformers import RankGuard

        callbacks.insert(0, RankGuard(**fault.rankguard))
    training = TrainingArguments(
        output_dir=fault.checkpoint_dir(rank) or str(fault.workdir / "hf_output"),
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        per_device_train_batch_size=BATCH_SIZE,
        per_device_eval_batch_size=BATCH_SIZE,
        num_train_epochs=fault.epochs,
        learning_rate=0.01,
        eval_strategy="epoch",
        save_strategy="epoch" if fault.save_dir else "no",  # as the other examples
        logging_strategy="no",
        dataloader_drop_last=data.train_drop_last,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=Classifier(fault.model(rank)),
        args=training,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=collate,
        callbacks=callbacks,
    )
    trainer.train()
    fault.report(rank)
    log.info("training finished")


if __name__ == "__main__":
    main()
