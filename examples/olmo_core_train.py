r"""A 2-rank CPU OLMo-core ``Trainer`` (a tiny Llama-like model) with rankguard and a fault.

Run it with ``torchrun`` (gloo on CPU; both ranks print to this terminal)::

    torchrun --standalone --nproc-per-node 2 examples/olmo_core_train.py         # healthy
    torchrun --standalone --nproc-per-node 2 examples/olmo_core_train.py --fault uneven_eval
    torchrun --standalone --nproc-per-node 2 examples/olmo_core_train.py \
        --fault uneven_eval --no-rankguard

Faults (``examples/faults.py``; where a deadline must pass, the example sets it
to 5 s for the demo):

    uneven_eval       ranks build eval sets of different sizes (16 and 32 sequences)
    slow_data         rank 1's token reads sleep 25 ms a sequence: DataStallMonitor names rank 1
    straggler         rank 1's forward takes 1.5x as long: StragglerMonitor names rank 1
    post_eval_hang    rank 1 sleeps forever after the first eval: HangWatchdog, exit code 75
    node_local_ckpt   each rank is a node of its own, saving to its own directory (a local disk)
    ckpt_over_memory  CheckpointPlanner told the node has 1 MiB for a sharded save (722k parameters)

Not offered: OLMo-core's data loader splits one seeded global order of the
token files between the ranks, so no rank builds a train set, a split or a
stream of its own (``uneven_train``, ``drop_last``, ``unseeded_split``,
``short_stream``). In ``ckpt_over_memory`` the model has ``d_model`` 240
(722,640 parameters, the fault's 720k) and OLMo-core's default sharded save,
which copies each rank's state (a DDP replica: all of it) to host memory first.

rankguard is one callback: ``TrainerConfig(..., callbacks={"rankguard":
RankGuard()})``. Train and eval data are random token ids written into the
work directory; the model is built from a config; nothing needs the network.
In ``node_local_ckpt`` the job says ``OLMO_SHARED_FS=1`` (its save folder is
shared), as a multi-node job must for OLMo-core to accept a local save folder.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from faults import BATCH_SIZE, FaultSetup, SlowDataset, log_with_rank, parse_args, setup
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDataset
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.eval import Evaluator
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, LoadStrategy, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback, EvaluatorCallback
from olmo_core.train.train_module import TransformerTrainModuleConfig
from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig
from olmo_core.utils import seed_all
from torch.utils.data import DataLoader, DistributedSampler

log = logging.getLogger("example")
#: Vocabulary and sequence length of the random token data.
VOCAB, SEQ_LEN = 64, 8
#: ``d_model`` in ``ckpt_over_memory``: 722,640 parameters, the fault's 720k-parameter model.
D_MODEL_720K = 240


class Tokens(NumpyFSLDataset):
    """OLMo-core's token dataset; ``delay_s`` slower per sequence where storage is slow."""

    delay_s = 0.0

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().__getitem__(index)


class Perplexity(Evaluator):
    """This rank's share of its eval sequences; the mean loss over every rank (an all_reduce)."""

    def __init__(self, sequences: int, rank: int) -> None:
        ids = torch.randint(
            1, VOCAB, (sequences, SEQ_LEN), generator=torch.Generator().manual_seed(1)
        )
        sampler = DistributedSampler(range(sequences), num_replicas=2, rank=rank, shuffle=False)
        rows = [{"input_ids": x} for x in ids]
        super().__init__(
            name="eval", batches=DataLoader(rows, batch_size=BATCH_SIZE, sampler=sampler)
        )
        self.rank, self.totals, self.evaluated = rank, torch.zeros(2), 0

    def update_metrics(self, batch, ce_loss, logits) -> None:
        self.totals += torch.tensor([float(ce_loss.sum()), ce_loss.numel()])
        self.evaluated += 1

    def compute_metrics(self) -> dict[str, torch.Tensor]:
        planned = len(self.batches)
        log.info("rank %d evaluated %d of its %d eval batches", self.rank, self.evaluated, planned)
        dist.all_reduce(self.totals)
        return {"CE loss": self.totals[0] / self.totals[1]}

    def reset_metrics(self) -> None:
        self.totals, self.evaluated = torch.zeros(2), 0


class Progress(Callback):
    """Logs, per rank, the train batches that actually ran, and the time."""

    def __init__(self, rank: int) -> None:
        self.rank, self.trained = rank, 0

    def pre_train(self) -> None:
        self.started = time.perf_counter()

    def pre_step(self, batch) -> None:
        self.trained += 1

    def post_epoch(self) -> None:
        planned = len(self.trainer.data_loader)
        log.info("rank %d trained %d of its %d train batches", self.rank, self.trained, planned)
        self.trained = 0

    def post_train(self) -> None:
        log.info("rank %d trained for %.1f s", self.rank, time.perf_counter() - self.started)


class HangAfterEval(Callback):
    """The ``post_eval_hang`` fault: this rank never comes back from its first eval."""

    priority = -1  # after the evaluator's post_step

    def __init__(self, eval_interval: int) -> None:
        self.eval_interval = eval_interval

    def post_step(self) -> None:
        if self.step % self.eval_interval == 0:
            log.info("rank %d: sleeping forever after eval (injected fault)", dist.get_rank())
            while True:
                time.sleep(3600)


def token_file(fault: FaultSetup, rank: int, sequences: int) -> str:
    """``sequences`` random sequences, written by rank 0 into the work directory."""
    path = fault.workdir / "olmo_tokens.npy"
    if rank == 0:
        fault.workdir.mkdir(parents=True, exist_ok=True)
        np.random.default_rng(0).integers(1, VOCAB, sequences * SEQ_LEN, dtype=np.uint16).tofile(
            path
        )
    dist.barrier()
    return str(path)


def main() -> None:
    args = parse_args(
        __doc__,
        without=("uneven_train", "drop_last", "unseeded_split", "short_stream", "replica_drift"),
    )
    log_with_rank()
    logging.getLogger("olmo_core").setLevel(logging.WARNING)

    rank = int(os.environ.get("RANK", "0"))
    fault: FaultSetup = setup(args.fault, args.workdir)
    if fault.node_of(rank) is not None:  # this rank plays a node of its own
        os.environ["NODE_RANK"] = fault.node_of(rank)
        os.environ["OLMO_SHARED_FS"] = "1"  # what the job believes of its save folder
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    fault.clear_checkpoints(rank)
    fault.make_node_disk(rank)
    data = fault.data(rank)  # the fault's sizes and slowness, as token sequences here
    seed_all(0)

    train = Tokens(
        token_file(fault, rank, len(data.train)),
        sequence_length=SEQ_LEN,
        pad_token_id=0,
        eos_token_id=0,
        vocab_size=VOCAB,
    )
    train.delay_s = data.train.delay_s if isinstance(data.train, SlowDataset) else 0.0
    train.work_dir = fault.workdir / "olmo_work"
    loader = NumpyDataLoaderConfig(
        global_batch_size=BATCH_SIZE * SEQ_LEN * 2,
        seed=0,
        num_workers=0,
        num_threads=1,  # one sequence read at a time, as in the other examples
        work_dir=str(train.work_dir),
    ).build(train)
    steps_per_epoch = len(data.train) // (BATCH_SIZE * 2)

    d_model = D_MODEL_720K if fault.fault == "ckpt_over_memory" else fault.hidden
    model = TransformerConfig.llama_like(
        d_model=d_model, vocab_size=VOCAB, n_layers=1, n_heads=2, hidden_size_multiple_of=16
    ).build(init_device="cpu")
    if fault.forward_s:  # inside the forward: its embeddings take a bigger model's time
        delay = fault.forward_s * (1.5 if rank == fault.slow_rank else 1.0)
        model.embeddings.register_forward_pre_hook(lambda module, inputs: time.sleep(delay))
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=BATCH_SIZE * SEQ_LEN,
        max_sequence_length=SEQ_LEN,
        optim=AdamWConfig(lr=1e-3),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp),
    ).build(model, device=torch.device("cpu"))

    callbacks: dict[str, Callback] = {
        # Saved at each epoch end where the fault has a checkpoint folder, as the other examples.
        "checkpointer": CheckpointerCallback(
            save_interval=steps_per_epoch, save_async=False, enabled=fault.save_dir is not None
        ),
        "evaluator": EvaluatorCallback(
            evaluators=[Perplexity(len(data.eval), rank)], eval_interval=steps_per_epoch
        ),
        "progress": Progress(rank),
    }
    if fault.hangs_after_eval(rank):
        callbacks["hang_after_eval"] = HangAfterEval(steps_per_epoch)
    if not args.no_rankguard:
        from rankguard.integrations.olmo_core import RankGuard

        callbacks["rankguard"] = RankGuard(**fault.rankguard)
    trainer = TrainerConfig(
        save_folder=fault.checkpoint_dir(rank) or str(fault.workdir / "olmo_output"),
        work_dir=str(train.work_dir),
        load_strategy=LoadStrategy.never,  # a fresh run each time
        max_duration=Duration.epochs(fault.epochs),
        metrics_collect_interval=steps_per_epoch,
        callbacks=callbacks,
    ).build(module, loader)
    trainer.fit()
    fault.report(rank)
    log.info("training finished")


if __name__ == "__main__":
    main()
