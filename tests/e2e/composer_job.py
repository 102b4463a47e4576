"""A real 2-rank Composer job (CPU, gloo) that runs rankguard scenarios of every concern.

Run: ``composer -n 2 composer_job.py OUT SCENARIO...``; the checkpoint scenarios
one torchrun per simulated node (``benchmarks/launch.py::launch_nodes``);
``restart`` alone under ``torchrun --max-restarts=1``.

Each scenario is a fresh Trainer in the same processes; outcomes per rank go to
``OUT/rank{N}.json`` (see tests/e2e/common.py). A hang scenario, ``dead_worker``,
``data_check_raises`` and ``restart`` end the job, so each comes last.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchmetrics
from composer import Callback, Evaluator, Trainer
from composer.loggers import InMemoryLogger, LoggerDestination
from composer.models import ComposerClassifier
from composer.utils import FSDP2Config, dist, get_device, reproducibility
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    get_worker_info,
    random_split,
)

from rankguard.integrations.composer import CheckpointPlanner, HangWatchdog, RankGuard
from tests.e2e import hang_settings
from tests.e2e.common import (
    ClaimedStream,
    LyingSampler,
    Points,
    Recorder,
    own_node,
    rankguard_off,
)
from tests.e2e.straggler_common import (
    BATCHES,
    STRAGGLER,
    SlowForward,
    SlowReads,
    forward_delay,
)
from tests.e2e.straggler_common import STALL as STRAGGLER_STALL

OUT = ""  # the output folder given on the command line
SCENARIO = ""  # the scenario running
COUNTERS: dict[str, Any] = {}
BATCH = 4


def rank() -> int:
    return dist.get_global_rank()


def per_rank(n_rank0: int, n_rank1: int) -> int:
    return n_rank0 if rank() == 0 else n_rank1


def count(key: str) -> None:
    COUNTERS[key] = COUNTERS.get(key, 0) + 1


class CountBatches(Callback):
    """Counts the train and eval batches that started on this rank."""

    def batch_start(self, state: Any, logger: Any) -> None:
        count("train_batches")

    def eval_batch_start(self, state: Any, logger: Any) -> None:
        count("eval_batches")


def sharded(data: Dataset | int, batch_size: int = BATCH, sampler=None, **kwargs) -> DataLoader:
    """``data`` (``Points(data)`` for a number) sharded over the ranks (or by ``sampler``)."""
    data = Points(data) if isinstance(data, int) else data
    sampler = sampler or dist.get_sampler(data)
    return DataLoader(data, batch_size=batch_size, sampler=sampler, **kwargs)


def trainer(
    train: DataLoader,
    callbacks: list[Callback],
    eval_loader: DataLoader | None = None,
    net: Callable[[], torch.nn.Module] = lambda: torch.nn.Linear(4, 2),
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    classifier: type[ComposerClassifier] = ComposerClassifier,
    **settings: Any,
) -> Trainer:
    """A fresh Trainer of ``net()`` (seeded) on CPU; a callback with a ``trainer`` gets it."""
    COUNTERS.clear()
    torch.manual_seed(0)
    model = classifier(net(), num_classes=2)
    if eval_loader is not None:
        settings = {"eval_interval": "1ep", **settings}
        settings["eval_dataloader"] = Evaluator(label="eval", dataloader=eval_loader)
    job = Trainer(
        model=model,
        optimizers=optimizer(model.parameters()) if optimizer else None,
        train_dataloader=train,
        callbacks=callbacks,
        **{"max_duration": "1ep", "loggers": [], **settings},
        device="cpu",
        progress_bar=False,
        log_to_console=False,
    )
    for callback in callbacks:
        if hasattr(callback, "trainer"):
            callback.trainer = job
    return job


def fit(*args: Any, **kwargs: Any) -> None:
    """Fits :func:`trainer` and closes it."""
    job = trainer(*args, **kwargs)
    try:
        job.fit()
    finally:
        job.close()


# --- Batch parity and drop_last (test_batches_e2e.py) ---------------------------------------------


def parity(train: DataLoader, eval_loader: DataLoader, guard: Callback | None = None) -> None:
    fit(train, [guard or RankGuard(data_consistency_guard=False), CountBatches()], eval_loader)


GENERAL = {
    "healthy": lambda: parity(sharded(64), sharded(32), RankGuard()),
    # Checkpoints every 4 batches into a relative folder: every save goes through the barrier.
    "checkpoint_barrier": lambda: fit(
        sharded(64),
        [RankGuard(), CountBatches()],
        sharded(32),
        save_folder="ckpt/{run_name}",
        save_interval="4ba",
        run_name="e2e",
    ),
    # Ranks built eval sets of different sizes: 2 vs 4 eval batches.
    "uneven_eval": lambda: parity(sharded(64), sharded(per_rank(16, 32))),
    # The same with every guard: the root cause (different datasets) is named first.
    "uneven_eval_all_guards": lambda: parity(sharded(64), sharded(per_rank(16, 32)), RankGuard()),
    # Ranks built train sets of different sizes: 2 vs 3 train batches.
    "uneven_train": lambda: parity(sharded(per_rank(16, 24)), sharded(32)),
    # drop_last differs: 18 samples per rank, 4 full batches + a partial one on rank 1.
    "drop_last_mismatch": lambda: parity(sharded(36, drop_last=rank() == 0), sharded(32)),
    # Ranks hold 32 and 34 train samples (8 vs 9 batches, the last partial); enforced
    # drop_last gives both 8 full batches.
    "drop_last_enforce": lambda: parity(
        sharded(per_rank(64, 68)),
        sharded(32),
        RankGuard(data_consistency_guard=False, drop_last_guard={"mode": "enforce"}),
    ),
    # Both ranks claim 4 eval batches; rank 0 yields 2, rank 1 yields 4. Composer stops
    # every rank when rank 0 runs out: rank 1's last 2 batches are silently skipped. With
    # the count before the first batch off, the after-eval check catches it.
    "lying_len": lambda: parity(
        sharded(64),
        sharded(64, sampler=LyingSampler(Points(64), 16, per_rank(8, 16))),
        RankGuard(
            data_consistency_guard=False,
            batch_parity_guard={"eval_end_timeout_s": 5, "max_count_samples": 0},
        ),
    ),
    # Both ranks claim 4 eval batches; rank 1 yields 8. Composer runs the 4 its __len__
    # says on every rank: rank 1's other 4 are silently skipped. Counted at fit start.
    "data_left_counted": lambda: parity(
        sharded(64),
        sharded(64, sampler=LyingSampler(Points(64), 16, per_rank(16, 32))),
        RankGuard(data_consistency_guard=False),
    ),
    # Each rank streams its own eval data; both streams say 4 batches, rank 0's holds 3.
    # Composer stops both when rank 0 runs out: rank 1's last batch is silently skipped.
    "data_left_eval_stream": lambda: parity(
        sharded(64),
        DataLoader(ClaimedStream(per_rank(12, 16), claimed=16, seed=rank()), batch_size=4),
        RankGuard(data_consistency_guard=False),
    ),
    # The same in training: both streams say 4 batches, rank 0's holds 3.
    "data_left_train_stream": lambda: parity(
        DataLoader(ClaimedStream(per_rank(12, 16), claimed=16, seed=rank()), batch_size=4),
        sharded(32),
        RankGuard(data_consistency_guard=False),
    ),
    # Streams that hold what they say on every rank: every check silent.
    "stream_healthy": lambda: parity(
        DataLoader(ClaimedStream(16, claimed=16, seed=rank()), batch_size=4),
        DataLoader(ClaimedStream(12, claimed=12, seed=rank()), batch_size=4),
        RankGuard(),
    ),
}


# --- Data consistency and stalls (test_data_e2e.py) -----------------------------------------------

#: The stall scenarios' DataStallMonitor; rank 1's reads in them (a step takes ~60 ms on 2
#: busy cores).
STALL = {"threshold": 0.5, "window": 3, "interval": 5}
SLOW_ITEM_S = 0.15


class LogAtBatch(logging.Handler):
    """Appends each rankguard record (warning and above) to ``path`` as it is logged.

    One JSON line per record: the scenario, the train batches run so far, the
    level and the message; written at once, so records logged while the
    process exits (Composer closes callbacks at exit) are kept.
    """

    def __init__(self, path: str) -> None:
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        line = {
            "scenario": SCENARIO,
            "batch": COUNTERS.get("train_batches", 0),
            "level": record.levelname,
            "message": record.getMessage(),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def fit_data(train, eval_loader, guard, *, rankguard_metrics: bool = False) -> None:
    """Trains 1 epoch with ``guard``; records batch counts and, if told, rankguard metrics."""
    memory = InMemoryLogger()
    try:
        fit(train, [guard, CountBatches()], eval_loader, loggers=[memory])
    finally:
        if rankguard_metrics:
            COUNTERS["metrics"] = {
                key: [[int(ts.batch), float(value)] for ts, value in series]
                for key, series in memory.data.items()
                if key.startswith("rankguard/")
            }


def fit_split(train_idx, eval_idx) -> None:
    data = Points(64)
    fit_data(sharded(Subset(data, train_idx)), sharded(Subset(data, eval_idx)), RankGuard())


def numpy_split(seed_numpy: bool) -> None:
    """The llama-recipes split: torch is seeded, the numpy shuffle may not be."""
    torch.manual_seed(0)
    if seed_numpy:
        random.seed(0)
        np.random.seed(0)
    order = np.random.permutation(64).tolist()
    fit_split(order[:48], order[48:])


def torch_random_split(generator: torch.Generator | None) -> None:
    """``random_split`` after torch was seeded per rank (as Composer seeds: seed + rank)."""
    reproducibility.seed_all(17 + rank())
    train, evaluation = random_split(Points(64), [48, 16], generator=generator)
    fit_data(sharded(train), sharded(evaluation), RankGuard())


def streaming(shuffle_seed: int, scenario: str) -> None:
    """A StreamingDataset written locally with MDSWriter, shuffled with ``shuffle_seed``."""
    from streaming import StreamingDataset

    class PointsStream(StreamingDataset):
        def __getitem__(self, i: int):
            sample = super().__getitem__(i)
            return torch.tensor(sample["x"]), torch.tensor(sample["y"])

    root = os.path.join(os.environ["MDS_ROOT"], scenario)

    def dataset(name: str, **kwargs) -> StreamingDataset:
        local = os.path.join(root, name)
        return PointsStream(local=local, batch_size=BATCH, num_canonical_nodes=1, **kwargs)

    train = dataset("train", shuffle=True, shuffle_seed=shuffle_seed)
    evaluation = dataset("eval", shuffle=False)
    loaders = DataLoader(train, batch_size=BATCH), DataLoader(evaluation, batch_size=BATCH)
    fit_data(*loaders, RankGuard())


def write_mds(root: str, scenarios: list[str]) -> None:
    """Rank 0 writes a tiny local MDS dataset per streaming scenario (own dir each)."""
    if rank() == 0:
        from streaming import MDSWriter

        for scenario in scenarios:
            for name, n in (("train", 64), ("eval", 32)):
                out = os.path.join(root, scenario, name)
                with MDSWriter(out=out, columns={"x": "ndarray:float32:4", "y": "int"}) as w:
                    for x, y in Points(n, seed=len(name)):
                        w.write({"x": x.numpy(), "y": int(y)})
    dist.barrier()


class SlowOnRank(Dataset):
    """``Points(n)`` whose items take ``delay_s`` to read on ``slow_rank`` only."""

    def __init__(self, n: int, slow_rank: int | None, delay_s: float = SLOW_ITEM_S) -> None:
        self.points = Points(n)
        self.delay_s = delay_s if slow_rank == rank() else 0.0

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.points[i]


def stall(slow_rank: int | None) -> None:
    """10 batches of 1 per rank; ``slow_rank`` reads each in 150 ms."""
    train = sharded(SlowOnRank(20, slow_rank), batch_size=1)
    guard = RankGuard(data_stall_monitor=STALL)
    fit_data(train, sharded(8), guard, rankguard_metrics=True)


class WorkerDiesOnRank(Dataset):
    """``Points(n)`` whose loader worker is killed (SIGKILL) reading ``at`` on ``rank``."""

    def __init__(self, n: int, at: int, dying_rank: int) -> None:
        self.points = Points(n)
        self.at = at if dying_rank == rank() else None

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.points[i]


def dead_worker() -> None:
    """Rank 1's only loader worker dies reading item 49, its 25th (train batch 7 of 8).

    As in a real job, nothing catches the error and ``trainer.close()`` is never
    called (it would wait in a barrier for rank 0, itself waiting in a collective
    for rank 1). Rank 1's process then stays, as NCCL's communicator teardown waits
    for a peer (on gloo its closed socket would break rank 0's collective at once):
    rank 0 waits in its collective until rankguard ends it, naming rank 1's error.
    """
    data = WorkerDiesOnRank(64, at=49, dying_rank=1)
    try:
        trainer(sharded(data, num_workers=1), [RankGuard(), CountBatches()]).fit()
    finally:
        if rank() == 1:
            destroy_process_group_waits()


STREAMING = ["streaming_healthy", "streaming_shuffle_seed_differs"]
DATA = {
    "unseeded_numpy_split": lambda: numpy_split(seed_numpy=False),
    "seeded_numpy_split": lambda: numpy_split(seed_numpy=True),
    "unseeded_random_split": lambda: torch_random_split(None),
    "seeded_random_split": lambda: torch_random_split(torch.Generator().manual_seed(0)),
    "streaming_healthy": lambda: streaming(7, "streaming_healthy"),
    "streaming_shuffle_seed_differs": lambda: streaming(
        7 + rank(), "streaming_shuffle_seed_differs"
    ),
    "stall_healthy": lambda: stall(None),
    "stall_rank1": lambda: stall(1),
    # A stream that ignores the rank (Composer checks map-style loaders only): every rank
    # reads the same 8 batches.
    "iterable_ignores_rank": lambda: fit_data(
        DataLoader(ClaimedStream(32, claimed=32), batch_size=4), sharded(16), RankGuard()
    ),
}


def setup_data(names: list[str]) -> None:
    dist.initialize_dist(get_device("cpu"))
    os.environ["MDS_ROOT"] = os.path.join(OUT, "mds")
    write_mds(os.environ["MDS_ROOT"], [n for n in names if n in STREAMING])
    log = LogAtBatch(os.path.join(OUT, f"rank{rank()}.log.jsonl"))
    logging.getLogger("rankguard").addHandler(log)


# --- Checkpoints on two simulated nodes (test_checkpoint_e2e.py) ----------------------------------

KiB = 1024
#: Host memory per node: below a full save of the FSDP2 model with Adam, above a sharded
#: one; and below both for the DDP model, whose full save to a file only copies its
#: largest tensor (8 KiB) to the host. The model: ``Linear(4, 512), Linear(512, 2)`` with
#: Adam (hand count in tests/frameworks/test_checkpoint_e2e.py).
FSDP_BUDGET, DDP_BUDGET = 32 * KiB, 4 * KiB
#: A save folder on each node's own disk: the test mounts node 1's own directory at
#: ``OUT/local`` for node 1's processes (``benchmarks/launch.py::node_disk``).
NODE_LOCAL = "local/ckpt"


class MetricCounter(LoggerDestination):
    """Counts rankguard's metrics as Composer's logger destinations receive them."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            if key.startswith("rankguard/"):
                count(f"{key} count")
                COUNTERS[key] = value


def save(
    name: str,
    guard: Callback,
    fsdp: bool = False,
    save_interval: str = "2ba",
    folder: str | None = None,
    load_path: str | None = None,
) -> None:
    """Trains 8 batches per rank; FSDP is Composer's FSDP2, the FSDP that runs on CPU."""
    fit(
        sharded(64),
        [guard, CountBatches()],
        net=lambda: torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 2)),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        parallelism_config={"fsdp": FSDP2Config(state_dict_type="full")} if fsdp else None,
        save_folder=folder or f"ckpt/{name}",  # relative: resolved against each rank's cwd
        save_interval=save_interval,
        load_path=load_path,
        loggers=[MetricCounter()],
    )


def node_local(name: str, guard: Callback) -> None:
    """Saves into ``local/ckpt``, made on every node first (as a job script's ``mkdir -p``)."""
    os.makedirs(NODE_LOCAL, exist_ok=True)
    save(name, guard, save_interval="4ba", folder=NODE_LOCAL)


CHECKPOINT = {
    # Every guard, the planner raising: a small model fits, nothing is said.
    "checkpointing": lambda: save("checkpointing", RankGuard(checkpoint_planner={"mode": "raise"})),
    # FSDP2 saving full checkpoints, gathered on rank 0: too large for the budget.
    "planner_warn": lambda: save(
        "planner_warn",
        CheckpointPlanner(mode="warn", host_memory_bytes=FSDP_BUDGET),
        fsdp=True,
        save_interval="4ba",
    ),
    "planner_raise": lambda: save(
        "planner_raise", CheckpointPlanner(mode="raise", host_memory_bytes=FSDP_BUDGET), fsdp=True
    ),
    # DDP: a sharded save would not fit either, so auto does not choose it.
    "planner_auto_ddp": lambda: save(
        "planner_auto_ddp", CheckpointPlanner(mode="auto", host_memory_bytes=DDP_BUDGET)
    ),
    # FSDP2 saving full checkpoints on rank 0: switched to sharded.
    "planner_auto_fsdp": lambda: save(
        "planner_auto_fsdp",
        RankGuard(checkpoint_planner={"mode": "auto", "host_memory_bytes": FSDP_BUDGET}),
        fsdp=True,
        save_interval="4ba",
    ),
    # A node-local save folder: every rank warns, training goes on (rank 0 saves on node 0).
    "node_local_warn": lambda: node_local("node_local_warn", RankGuard()),
    "node_local_raise": lambda: node_local(
        "node_local_raise", RankGuard(shared_dir_barrier={"on_node_local": "raise"})
    ),
    # Resuming from the checkpoint node_local_warn saved on node 0's disk only.
    "resume_node_local": lambda: save(
        "resume_node_local", RankGuard(), load_path=f"{NODE_LOCAL}/ep0-ba8-rank0.pt"
    ),
}


def setup_checkpoint(names: list[str]) -> None:
    # Composer reads the node rank from NODE_RANK; torchrun names it GROUP_RANK.
    os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    os.chdir(OUT)  # checkpoints go to OUT/ckpt/<scenario>


# --- Hangs and deadlocks (test_hang_e2e.py, test_deadlock_e2e.py) ---------------------------------


class Pace(Callback):
    """Makes train and eval batches take a known time; records the longest train-to-train gap."""

    def __init__(self, train_s: float, eval_s: float) -> None:
        self.train_s, self.eval_s = train_s, eval_s
        self.last_end: float | None = None

    def before_forward(self, state, logger):
        time.sleep(self.train_s)

    def eval_before_forward(self, state, logger):
        time.sleep(self.eval_s)

    def batch_end(self, state, logger):
        now = time.monotonic()
        if self.last_end is not None:
            gap = now - self.last_end
            COUNTERS["longest_train_gap_s"] = max(COUNTERS.get("longest_train_gap_s", 0.0), gap)
        self.last_end = now
        count("train_batches")

    def eval_batch_end(self, state, logger):
        count("eval_batches")


def mark_stall(name: str) -> None:
    """Records when this rank starts to stall (Unix time) in ``OUT/<name>``, for the latency."""
    with open(os.path.join(OUT, name), "w") as file:
        json.dump({"rank": rank(), "t": time.time()}, file)


def mark_split(splitter: int) -> None:
    """Records the moment (Unix time) rank ``splitter`` takes the path the others do not."""
    with open(os.path.join(OUT, "split.json"), "w") as file:
        json.dump({"rank": splitter, "t": time.time()}, file)


def stall_after_eval(marker: str = "stall_post_eval_stall.json") -> None:
    """The bug: rank 1 never comes back from eval (a hook that blocks, here a sleep)."""
    mark_stall(marker)
    time.sleep(3600)


class StallAfterEval(Callback):
    """On rank 1 only, blocks at the first EVAL_END (after rankguard saw it)."""

    def eval_end(self, state, logger):
        if rank() == 1:
            stall_after_eval()


def reduce_on_side_group(group) -> None:
    """The bug: a collective only rank 1 calls (on a group rank 0 never uses after eval)."""
    mark_stall("stall_unmatched_collective.json")
    torch.distributed.all_reduce(torch.ones(1), group=group)


class UnmatchedCollective(Callback):
    """Both ranks make an extra gloo group at fit start; after eval only rank 1 reduces on it."""

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")

    def eval_end(self, state, logger):
        if rank() == 1:
            reduce_on_side_group(self.group)


def reduce_on_rank0_only(group) -> None:
    """The bug: a collective under ``if rank == 0`` (a metric summed "on the main process")."""
    mark_split(0)
    torch.distributed.all_reduce(torch.ones(3), group=group)


class Rank0Collective(Callback):
    """At the first epoch's end, rank 0 alone reduces a tensor.

    On its own gloo group: on the training group gloo would pair it with
    Composer's next collective on rank 1 and crash on the size mismatch.
    """

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")

    def epoch_end(self, state, logger):
        if rank() == 0:
            reduce_on_rank0_only(self.group)


class MetricOnRank0(Callback):
    """Composer's nearest to a key logged with ``sync_dist=True`` on one rank (Composer
    logs no per-key sync): a torchmetrics metric updated on every rank, computed (which
    gathers its state from every rank) on rank 0 only, to log it "on the main process".

    Its sync on a gloo group of its own, as :class:`Rank0Collective` does.
    """

    def fit_start(self, state, logger):
        group = torch.distributed.new_group(backend="gloo")
        self.metric = torchmetrics.MeanMetric(process_group=group)

    def batch_end(self, state, logger):
        self.metric.update(state.loss.detach())

    def epoch_end(self, state, logger):
        if rank() == 0:
            mark_split(0)
            logger.log_metrics({"train/mean_loss": self.metric.compute()})


class GatherKept(Callback):
    """The bug (Lightning #19680, here in Composer): an ``all_gather`` at the epoch's end on
    a path one rank skips: only ranks that kept outputs gather them (rank 1 kept none).

    On a gloo group of its own, as :class:`Rank0Collective` does.
    """

    def fit_start(self, state, logger):
        self.group = torch.distributed.new_group(backend="gloo")
        self.kept: list[torch.Tensor] = []

    def batch_end(self, state, logger):
        if rank() == 0:  # e.g. the outputs above a threshold: none on rank 1
            self.kept.append(state.loss.detach())

    def epoch_end(self, state, logger):
        if self.kept:
            mark_split(0)
            dist.all_gather(torch.stack(self.kept), group=self.group)
        self.kept.clear()


class StopOnRank0(Callback):
    """The bug (transformers #17478, here in Composer): rank 0 alone stops training at batch 5,
    as an early stopper does when it decides from one rank's un-gathered metric."""

    def batch_end(self, state, logger):
        if rank() == 0 and int(state.timestamp.batch) == 5:
            mark_split(0)
            state.stop_training()


class SaveOnRank0(Callback):
    """The bug: ``trainer.save_checkpoint`` on rank 0 only (at batch 5); Composer's save
    gathers from every rank."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def batch_end(self, state, logger):
        if rank() == 0 and int(state.timestamp.batch) == 5:
            mark_split(0)
            self.trainer.save_checkpoint(os.path.join(OUT, "rank0_only.pt"))


class AuxLossOnRank1(ComposerClassifier):
    """The bug: a loss term returned only when a rank's batch has something for it (an
    auxiliary or load-balancing loss): from train batch 5, rank 1's loss dict has ``aux``,
    rank 0's does not. Composer all-reduces each key of the loss dict after every batch."""

    batches = 0

    def loss(self, outputs, batch):
        total = super().loss(outputs, batch)
        self.batches += 1  # one microbatch per batch
        if rank() == 1 and self.batches >= 5:
            if self.batches == 5:
                mark_split(1)
            return {"total": total, "aux": total.detach() * 0.0}
        return {"total": total}


def loss_key_on_rank1() -> None:
    """Every watchdog setting at its default, as in :func:`hang`; the loss keys differ."""
    watchdog = HangWatchdog(report_dir=reports("loss_key_on_rank1"))
    fit(sharded(64), [watchdog], max_duration="2ep", classifier=AuxLossOnRank1)
    raise AssertionError("loss_key_on_rank1: the fit ended; the watchdog should have ended it")


def check_batch(batch: Any, step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if rank() == 1 and step == 6:
        mark_stall("raised.json")
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckBatches(Callback):
    """The user's callback that checks each train batch once it is loaded."""

    def after_dataloader(self, state, logger):
        check_batch(state.batch, int(state.timestamp.batch))


def destroy_process_group_waits() -> None:
    """NCCL's communicator teardown waiting for a peer (here a long sleep): the process stays."""
    time.sleep(600)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6; rank 0 goes on into its next
    collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default; an eval every 4 batches. It ends the job (exit code 70).
    """
    with open(os.path.join(OUT, f"pid{rank()}"), "w") as file:
        file.write(str(os.getpid()))
    watchdog = {"report_dir": reports("data_check_raises"), "teardown_timeout_s": 3}
    callbacks = [] if rankguard_off() else [RankGuard(hang_watchdog=watchdog)]
    job = trainer(sharded(64), [*callbacks, CheckBatches()], sharded(32), eval_interval="4ba")
    try:
        job.fit()
    finally:
        destroy_process_group_waits()
    raise AssertionError("the fit ended; rank 1's data check should have raised")


def reports(scenario: str) -> str:
    return os.path.join(OUT, f"reports_{scenario}")


def healthy_slow_eval() -> None:
    settings = hang_settings.HEALTHY
    watchdog = HangWatchdog(report_dir=reports("healthy_slow_eval"), **settings)
    pace = Pace(hang_settings.TRAIN_STEP_S, hang_settings.EVAL_BATCH_S)
    fit(sharded(64), [watchdog, pace], sharded(32), eval_interval="4ba")
    # The longest interval seen per phase kind and the deadlines: the watchdog calibrated.
    core = watchdog.runner.guards[0]
    COUNTERS["peaks"] = dict(core.history.peaks)
    COUNTERS["deadlines"] = core.deadlines


def hang(scenario: str, culprit: Callback, settings: dict, eval_interval: str) -> None:
    """2 epochs of 8 train batches per rank, an eval of 4 batches every ``eval_interval``."""
    # rankguard first: it sees EVAL_END before the culprit blocks in it.
    watchdog = HangWatchdog(report_dir=reports(scenario), **settings)
    callbacks = [watchdog, culprit]
    fit(sharded(64), callbacks, sharded(32), max_duration="2ep", eval_interval=eval_interval)
    raise AssertionError(f"{scenario}: the fit ended; the watchdog should have ended the process")


HANG = {
    "healthy_slow_eval": healthy_slow_eval,
    # 4 train steps before the first eval calibrate the deadlines: two stages.
    "post_eval_stall": lambda: hang(
        "post_eval_stall", StallAfterEval(), hang_settings.TWO_STAGE, "4ba"
    ),
    # Every watchdog setting at its default: the proven deadlock ends the job (exit 70).
    "rank0_collective": lambda: hang("rank0_collective", Rank0Collective(), {}, "4ba"),
    "metric_on_rank0": lambda: hang("metric_on_rank0", MetricOnRank0(), {}, "4ba"),
    "epoch_end_all_gather": lambda: hang("epoch_end_all_gather", GatherKept(), {}, "4ba"),
    "stop_one_rank": lambda: hang("stop_one_rank", StopOnRank0(), {}, "4ba"),
    "save_on_rank0": lambda: hang("save_on_rank0", SaveOnRank0(), {}, "4ba"),
    "loss_key_on_rank1": loss_key_on_rank1,
    "data_check_raises": data_check_raises,
    "unmatched_collective": lambda: hang(
        "unmatched_collective", UnmatchedCollective(), hang_settings.HANG, "2ba"
    ),
}


def setup_hang(names: list[str]) -> None:
    # The verdict in the output, with the Unix time of each line (the stages' latency).
    logging.basicConfig(format="%(created).3f %(name)s %(levelname)s: %(message)s")


# --- A hang ended and restarted by torchrun (test_restart_e2e.py) ---------------------------------


def attempt() -> int:
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


class Record(Callback):
    """Writes what this rank starts from and ends at (``OUT/attempt{N}_rank{R}.json``).

    On the first attempt rank 1 never returns from its second eval (batch 8).
    """

    def __init__(self, guard: RankGuard) -> None:
        self.guard = guard
        self.record: dict = {"pid": os.getpid()}

    def _write(self) -> None:
        path = os.path.join(OUT, f"attempt{attempt()}_rank{rank()}.json")
        with open(path, "w") as file:
            json.dump(self.record, file, indent=1)

    def fit_start(self, state, logger):
        watchdog = next(g for g in self.guard.runner.guards if g.name == "hang_watchdog")
        self.record.update(
            start_batch=int(state.timestamp.batch),
            restored=watchdog.heartbeats.restored,
            deadlines=watchdog.deadlines,
        )
        self._write()

    def eval_end(self, state, logger):
        if attempt() == 0 and rank() == 1 and int(state.timestamp.batch) == 8:
            stall_after_eval("stall.json")  # the bug, on the first attempt only

    def fit_end(self, state, logger):
        self.record["end_batch"] = int(state.timestamp.batch)
        self._write()


def restart() -> None:
    """Each attempt: 12 train batches, an eval every 4 and a checkpoint every 2, ``autoresume``.

    The watchdog aborts at its calibrated deadline (4 s floor); the second
    attempt resumes from the last checkpoint and finishes.
    """
    os.environ.setdefault("NODE_RANK", os.environ["GROUP_RANK"])  # Composer's name, torchrun's
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("rankguard.callbacks.hang_watchdog").setLevel(logging.INFO)
    watchdog = {
        "abort_at": "calibrated",
        "floor_s": 4.0,
        "warmup_steps": 0,
        "exchange_period_s": 0.5,
        "report_dir": os.path.join(OUT, "reports"),
    }
    guard = RankGuard(hang_watchdog=watchdog)  # first: it sees EVAL_END before the stall
    fit(
        sharded(64),
        [guard, Record(guard)],
        sharded(32),
        eval_interval="4ba",
        max_duration="12ba",
        save_folder=os.path.join(OUT, "checkpoints"),
        save_interval="2ba",
        run_name="restart",
        autoresume=True,
    )


# --- Stragglers (test_straggler_e2e.py) -----------------------------------------------------------


class CountDone(Callback):
    """Counts the train batches done on this rank (the clock of the straggler records)."""

    def batch_end(self, state: Any, logger: Any) -> None:
        count("train_batches")


class Metrics(LoggerDestination):
    """Keeps rankguard's straggler metrics with the train batch they were logged at."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        kept = {k: v for k, v in metrics.items() if k.startswith("rankguard/straggler")}
        if kept:
            COUNTERS.setdefault("metrics", []).append([COUNTERS.get("train_batches", 0), kept])


class AtBatch(logging.Handler):
    """Keeps each rankguard record (warning and above) with the train batch it came at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        line = [COUNTERS.get("train_batches", 0), record.getMessage()]
        COUNTERS.setdefault("logged", []).append(line)


def race(guard: RankGuard, *, slow_compute: bool = False, slow_data: bool = False, **kw) -> None:
    """``BATCHES`` train batches per rank; rank 1 computes or reads slowly if told."""
    delay = forward_delay(rank(), slow_compute)
    fit(
        sharded(SlowReads(2 * BATCHES * BATCH, rank(), slow_data)),
        [guard, CountDone()],
        net=lambda: SlowForward(delay),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loggers=[Metrics()],
        **kw,
    )


STRAGGLERS = {
    # Equal ranks, evaluated and saved every 6 batches: no warning, scores every interval.
    "straggler_healthy": lambda: race(
        RankGuard(straggler_monitor=STRAGGLER),
        eval_loader=sharded(16),
        eval_interval="6ba",
        save_folder=OUT + "/ckpt/{run_name}",
        save_interval="6ba",
        run_name="straggler",
    ),
    "slow_compute": lambda: race(RankGuard(straggler_monitor=STRAGGLER), slow_compute=True),
    "slow_data": lambda: race(
        RankGuard(straggler_monitor=STRAGGLER, data_stall_monitor=STRAGGLER_STALL), slow_data=True
    ),
    "slow_compute_raise": lambda: race(
        RankGuard(straggler_monitor={**STRAGGLER, "on_violation": "raise"}), slow_compute=True
    ),
}


def setup_straggler(names: list[str]) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores
    logging.getLogger("rankguard").addHandler(AtBatch())


# --- Resuming from a checkpoint (test_resume_e2e.py) ---------------------------------------------

#: The run the resume scenarios save and resume; each fit trains 4 batches more.
RESUME_RUN = "resume"


def resume_fit(batches: int, folder: str = "ckpt", train: DataLoader | None = None) -> None:
    """Trains up to ``batches`` with ``autoresume``, saving every 4 batches into ``folder``.

    Every guard (none with ``E2E_RANKGUARD=off``); ``COUNTERS["resume_checked"]``: whether
    the resume check ran (a verdict), with the checkpoint it found on this rank.
    """
    guard = None if rankguard_off() else RankGuard()
    fit(
        train if train is not None else sharded(64),
        [*([guard] if guard else []), CountBatches()],
        max_duration=f"{batches}ba",
        save_folder=folder,
        save_interval="4ba",
        run_name=RESUME_RUN,
        autoresume=True,
    )
    check = (
        next((g for g in guard.runner.guards if g.name == "resume_guard"), None) if guard else None
    )
    COUNTERS["resume_checked"] = check is not None and check.verdict is not None


def lagging_copies() -> None:
    """Each rank a node with its own copy of ``ckpt``: node 1's lacks the newest (ba8).

    Composer knows a node by ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (its local rank 0 copies
    the checkpoint for the node); ``/proc/self/cwd`` is one path that each process sees
    on its own disk, as a node-local path is on every node.
    """
    disk = os.path.join(OUT, f"node{rank()}")
    names = ["ep0-ba4-rank0.pt", "ep0-ba8-rank0.pt"][: 2 - rank()]
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    before = {k: os.environ[k] for k in env}
    with own_node(rank(), Path(disk)):
        os.makedirs(os.path.join(disk, "ckpt"))
        for name in names:
            shutil.copy(os.path.join(OUT, "ckpt", name), os.path.join(disk, "ckpt", name))
        os.symlink(names[-1], os.path.join(disk, "ckpt", "latest-rank0.pt"))
        os.environ.update(env)
        os.chdir(disk)
        try:
            resume_fit(12, folder="/proc/self/cwd/ckpt")
        finally:
            os.chdir(OUT)
            os.environ.update(before)


class RankShard(IterableDataset):
    """Each rank's own shard of JSON lines; its position is a byte offset in that shard.

    ``state_dict(num_samples, from_beginning)`` is Composer's dataset resumption
    interface: Composer saves it with the checkpoint and loads it into the dataset.
    """

    def __init__(self, n: int) -> None:
        self.lines = [json.dumps(x.tolist()) + "\n" for x in Points(n, seed=rank()).x]
        self.offset = 0

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.offset = state["offset"]

    def __iter__(self):
        COUNTERS.setdefault("start_offset", self.offset)
        at = 0
        for line in self.lines:
            at += len(line)
            if at > self.offset:  # the first line that ends after the offset
                self.offset = at
                x = torch.tensor(json.loads(line))
                yield x, int(x.sum() > 0)


def data_position() -> None:
    """Saves at batch 4, resumes with ``autoresume`` (rank 0's dataset state on both ranks)."""
    for batches in (4, 8):
        resume_fit(batches, "ckpt_data", DataLoader(RankShard(64), batch_size=BATCH))


RESUME = {
    "resume_first_fit": lambda: resume_fit(8),  # saves ep0-ba4 and ep0-ba8
    "resume_healthy": lambda: resume_fit(12),  # from ep0-ba8 in the shared folder
    "resume_node_lagging": lagging_copies,
    "resume_data_position": data_position,
}


def setup_resume(names: list[str]) -> None:
    os.environ.setdefault("NODE_RANK", "0")
    os.chdir(OUT)  # checkpoints go to OUT/ckpt


# --- The command line ----------------------------------------------------------------------------

#: Each concern's scenarios and what a launch sets up once before the first of them.
CONCERNS: list[tuple[dict[str, Callable[[], None]], Callable[[list[str]], None] | None]] = [
    (GENERAL, None),
    ({**DATA, "dead_worker": dead_worker}, setup_data),
    (CHECKPOINT, setup_checkpoint),
    (HANG, setup_hang),
    ({"restart": restart}, None),
    (STRAGGLERS, setup_straggler),
    (RESUME, setup_resume),
]
#: Scenarios that end the job: run bare (not recorded), so the process exits as it would.
ENDS_JOB = {"dead_worker", "restart", "data_check_raises"}


def main() -> None:
    global OUT, SCENARIO
    OUT, *names = sys.argv[1:]
    done: set[Callable] = set()
    recorder = Recorder(OUT)
    for name in names:
        scenarios, setup = next((s, setup) for s, setup in CONCERNS if name in s)
        if setup is not None and setup not in done:
            done.add(setup)
            setup(names)
        SCENARIO = name
        if name in ENDS_JOB:
            scenarios[name]()
        else:
            recorder.run(name, scenarios[name], COUNTERS)


if __name__ == "__main__":
    main()
