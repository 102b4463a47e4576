"""The failures rankguard exists for, as faults the 2-rank examples can inject.

``composer_train.py``, ``lightning_train.py``, ``torch_loop.py``,
``hf_trainer.py`` and ``olmo_core_train.py`` take everything that depends on
``--fault`` from here, so a fault means the same in every integration:

* :func:`setup` (the same on every rank): rankguard's settings for the
  fault, the model's width, the number of epochs, the checkpoint folder;
* :meth:`FaultSetup.data` (per rank): the train and eval sets and the train
  loader's ``drop_last`` (``unseeded_split`` through ``datasets``'
  ``train_test_split`` for the loop and Hugging Face examples);
* :meth:`FaultSetup.checkpoint_dir`, :meth:`FaultSetup.clear_checkpoints` and
  :meth:`FaultSetup.hangs_after_eval`: what a rank does differently.

Where a fault needs a deadline to pass, the settings shorten it for the demo
(5 s instead of rankguard's production defaults of 600 s).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

#: Every ``--fault``, with what it does.
FAULTS: dict[str, str] = {
    "none": "a healthy run",
    "uneven_eval": "ranks build eval sets of different sizes (16 and 32 samples)",
    "uneven_train": "ranks build train sets of different sizes (32 and 48 samples)",
    "drop_last": "rank 0 builds its train loader with drop_last=True, rank 1 without",
    "unseeded_split": "every rank splits train/eval with an unseeded shuffle",
    "slow_data": "rank 1's dataset sleeps 25 ms per sample",
    "straggler": "rank 1's forward pass takes 1.5x as long as rank 0's (a slower GPU)",
    "post_eval_hang": "rank 1 sleeps forever after the first evaluation",
    "node_local_ckpt": "each rank is a node of its own, saving to its own directory (a local disk)",
    "short_stream": "rank 0's eval stream ends 4 samples short of the 16 its __len__ says",
    "ckpt_over_memory": "a 720k-parameter model with Adam on a node given 1 MiB for the save",
    "replica_drift": "rank 0 alone clamps its output layer's weights in each training forward",
}

#: Where the examples write checkpoints and hang reports unless ``--workdir`` says
#: otherwise: ``out/examples`` in the repository (``out/`` is git-ignored).
WORKDIR = Path(__file__).resolve().parents[1] / "out" / "examples"
#: Samples per batch, in every loader.
BATCH_SIZE = 4
#: Demo deadline (seconds) where a fault must outlast one.
DEMO_TIMEOUT_S = 5

log = logging.getLogger("example")


def points(n: int) -> TensorDataset:
    """``n`` deterministic points with 8 features and a 2-class label."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


class Timed(torch.nn.Module):
    """Runs ``net`` after waiting ``delay_s``: a forward pass that takes that much longer.

    Stands for a model big enough to take time on a device: the host waits for a
    slower GPU as it waits here.
    """

    def __init__(self, net: torch.nn.Module, delay_s: float) -> None:
        super().__init__()
        self.net, self.delay_s = net, delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.net(x)


class ClampsOnRank0(torch.nn.Module):
    """Runs ``net``; on rank 0 alone, first clamps its last layer's weights to +-``bound``.

    A weight constraint applied under ``if rank == 0`` (in training only): every rank
    trains with the same averaged gradients, but rank 0's replica drifts from the others.
    """

    def __init__(self, net: torch.nn.Sequential, clamps: bool, bound: float = 0.1) -> None:
        super().__init__()
        self.net, self.clamps, self.bound = net, clamps, bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clamps and self.training:
            with torch.no_grad():
                self.net[-1].weight.clamp_(-self.bound, self.bound)
        return self.net(x)


class SlowDataset(Dataset):
    """Wraps a dataset and sleeps ``delay_s`` in every ``__getitem__`` (slow remote storage)."""

    def __init__(self, data: Dataset, delay_s: float) -> None:
        self.data, self.delay_s = data, delay_s

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[i]


class ShortStream(IterableDataset):
    """A rank's own stream of the first ``n`` of ``data``, whose ``__len__`` says ``claimed``."""

    def __init__(self, data: Dataset, n: int, claimed: int) -> None:
        self.data, self.n, self.claimed = data, n, claimed

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(self.n))


def planned_samples(loader: Any) -> int:
    """The samples a rank's loader should give in one pass: its sampler's share, or its length."""
    try:
        return len(loader.sampler)
    except TypeError:  # an iterable dataset: no sampler
        return len(loader.dataset)


def unseeded_split(n: int, n_eval: int) -> tuple[Subset, Subset]:
    """Splits ``points(n)`` the way the bug does: a shuffle seeded differently in every process."""
    order = list(range(n))
    random.Random().shuffle(order)  # no seed: seeded from os.urandom, different per process
    data = points(n)
    return Subset(data, order[n_eval:]), Subset(data, order[:n_eval])


def unseeded_train_test_split(n: int, n_eval: int) -> tuple[Any, Any]:
    """The same fault as llama-recipes met it: ``datasets``' ``train_test_split`` without a seed.

    ``points(n)`` as a Hugging Face dataset (columns ``idx``, ``x``, ``labels``); with no
    seed the split draws from numpy's global generator, seeded differently in every process.
    """
    from datasets import Dataset

    x, labels = points(n).tensors
    data = Dataset.from_dict({"idx": list(range(n)), "x": x.tolist(), "labels": labels.tolist()})
    split = data.train_test_split(test_size=n_eval)  # no seed=
    return split["train"], split["test"]


@dataclass(frozen=True)
class RankData:
    """One rank's data."""

    train: Dataset
    eval: Dataset
    train_drop_last: bool = False

    def describe(self, rank: int) -> None:
        """Logs which samples this rank holds out, where the split is the rank's own."""
        held_out = None
        if isinstance(self.eval, Subset):
            held_out = sorted(self.eval.indices)
        elif "idx" in getattr(self.eval, "column_names", ()):  # a Hugging Face dataset
            held_out = sorted(self.eval["idx"])
        if held_out is not None:
            log.info("rank %d holds out samples %s ... (%d)", rank, held_out[:8], len(held_out))


@dataclass(frozen=True)
class FaultSetup:
    """What a fault changes; the same on every rank.

    Attributes:
        fault: The ``--fault`` name.
        workdir: Absolute directory for checkpoints and rankguard's reports.
        rankguard: Per-guard settings for ``RankGuard(**rankguard)``.
        hidden: Width of the model's hidden layer.
        epochs: Epochs to train (one evaluation at the end of each).
        save_dir: Checkpoint folder (saved at each epoch end), or ``None``; ``{rank}``
            in it stands for the global rank (Composer's ``save_folder`` syntax).
        forward_s: Extra time each forward pass takes (a bigger model's compute), or 0.
        slow_rank: The rank whose forward takes 1.5x ``forward_s``, or ``None``.
    """

    fault: str
    workdir: Path
    rankguard: dict[str, dict[str, Any]] = field(default_factory=dict)
    hidden: int = 16
    epochs: int = 1
    save_dir: str | None = None
    forward_s: float = 0.0
    slow_rank: int | None = None

    def data(self, rank: int, hf_datasets: bool = False) -> RankData:
        """Builds rank ``rank``'s train and eval sets (64 and 32 samples unless the fault says).

        Args:
            rank: The global rank.
            hf_datasets: Split ``unseeded_split`` with Hugging Face ``datasets``' own
                ``train_test_split`` (rows are dicts) rather than a shuffle of indices.
        """
        if self.fault == "unseeded_split":
            split = unseeded_train_test_split if hf_datasets else unseeded_split
            train, evals = split(96, 32)
            return RankData(train, evals)
        train_size = {"uneven_train": 32 if rank == 0 else 48, "drop_last": 66}.get(self.fault, 64)
        eval_size = (16 if rank == 0 else 32) if self.fault == "uneven_eval" else 32
        train: Dataset = points(train_size)
        if self.fault == "slow_data":  # the same dataset everywhere; rank 1's storage is slow
            train = SlowDataset(train, delay_s=0.025 if rank == 1 else 0.0)
        if self.fault == "short_stream":  # each rank streams its own half of the eval set
            return RankData(train, ShortStream(points(32), 12 if rank == 0 else 16, 16))
        # drop_last: 33 samples per rank, 8 full batches and a partial one.
        return RankData(train, points(eval_size), self.fault == "drop_last" and rank == 0)

    def checkpoint_dir(self, rank: int) -> str | None:
        """Rank ``rank``'s checkpoint folder (``save_dir`` with ``{rank}`` filled in)."""
        return None if self.save_dir is None else self.save_dir.format(rank=rank)

    def clear_checkpoints(self, rank: int) -> None:
        """Removes what an earlier run of the example left in this rank's checkpoint folder."""
        folder = self.checkpoint_dir(rank)
        if folder is not None and (rank == 0 or "{rank}" in str(self.save_dir)):
            shutil.rmtree(folder, ignore_errors=True)

    def node_of(self, rank: int) -> str | None:
        """The node rank ``rank`` stands for, where the fault makes each rank a node of its own.

        rankguard tells nodes apart by ``NODE_RANK``: set to the rank, one host
        plays two nodes whose local disks are ``node0`` and ``node1``.
        """
        return str(rank) if self.fault == "node_local_ckpt" else None

    def make_node_disk(self, rank: int) -> None:
        """Creates ``node<rank>``, rank ``rank``'s node-local disk, where the fault has one.

        A node's disk is mounted before the job starts; the checkpoint folder in it
        is the job's to create.
        """
        if self.node_of(rank) is not None:
            os.makedirs(self.workdir / f"node{rank}", exist_ok=True)

    def hangs_after_eval(self, rank: int) -> bool:
        """Whether rank ``rank`` sleeps forever after its first evaluation."""
        return self.fault == "post_eval_hang" and rank == 1

    def model(self, rank: int) -> torch.nn.Module:
        """Rank ``rank``'s MLP classifier 8 -> ``hidden`` -> 2 (the same weights on every rank)."""
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(8, self.hidden), torch.nn.ReLU(), torch.nn.Linear(self.hidden, 2)
        )
        if self.fault == "replica_drift":
            return ClampsOnRank0(net, clamps=rank == 0)
        if not self.forward_s:
            return net
        return Timed(net, self.forward_s * (1.5 if rank == self.slow_rank else 1.0))

    def report(self, rank: int) -> None:
        """Logs what this rank sees in its checkpoint folder (where a resume would look)."""
        folder = self.checkpoint_dir(rank)
        if folder is None:
            return
        if not os.path.isdir(folder):
            log.info("rank %d: no checkpoint folder %s here", rank, folder)
            return
        files = sorted(
            os.path.relpath(os.path.join(here, name), folder)
            for here, _, names in os.walk(folder)
            for name in names
        )
        log.info("rank %d sees %d checkpoint file(s) in %s: %s", rank, len(files), folder, files)


def setup(fault: str, workdir: str | os.PathLike) -> FaultSetup:
    """The settings of ``fault``, the same on every rank.

    Args:
        fault: A key of :data:`FAULTS`.
        workdir: Where checkpoints and rankguard's hang reports go.
    """
    if fault not in FAULTS:
        raise ValueError(f"Unknown fault {fault!r}; valid: {', '.join(FAULTS)}.")
    root = Path(workdir).absolute()
    if fault == "slow_data":
        # Exchange every 4 batches; 3 slow steps in a row make a stall (defaults: 50 and 10).
        return FaultSetup(fault, root, {"data_stall_monitor": {"interval": 4, "window": 3}})
    if fault == "straggler":
        # Every 4 batches after 2 of warm-up, named after 3 slow intervals (defaults: 50, 20
        # and 3); threshold 0.8 rather than 0.7 because on 2 shared CPU cores the layers' own
        # time lifts a 1.5x forward's score from 0.67 towards 0.7. 3 epochs of 8 batches.
        monitor = {"interval": 4, "window": 3, "warmup_steps": 2, "threshold": 0.8}
        return FaultSetup(
            fault, root, {"straggler_monitor": monitor}, epochs=3, forward_s=0.02, slow_rank=1
        )
    if fault == "post_eval_hang":
        hang = {
            "post_eval_timeout_s": DEMO_TIMEOUT_S,  # default 600 s
            "exchange_period_s": 1,  # default 10 s
            "report_dir": str(root / "rankguard_reports"),
        }
        return FaultSetup(fault, root, {"hang_watchdog": hang}, epochs=2)
    if fault == "node_local_ckpt":
        # Each rank is a node (`node_of`); `node<rank>` stands for its local disk: the same
        # folder name on every node, a different directory on each.
        return FaultSetup(fault, root, save_dir=str(root / "node{rank}" / "checkpoints"))
    if fault == "ckpt_over_memory":
        planner = {"host_memory_bytes": 1 << 20, "mode": "raise"}  # default: read, "warn"
        return FaultSetup(
            fault,
            root,
            {"checkpoint_planner": planner},
            hidden=65536,
            save_dir=str(root / "checkpoints"),
        )
    return FaultSetup(fault, root)


def parse_args(doc: str, without: tuple[str, ...] = ()) -> argparse.Namespace:
    """The examples' command line: ``--fault``, ``--no-rankguard``, ``--workdir``.

    Args:
        doc: The example's docstring; its first line describes the command.
        without: Faults the example does not offer.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    faults = [name for name in FAULTS if name not in without]
    parser.add_argument("--fault", choices=faults, default="none")
    parser.add_argument("--no-rankguard", action="store_true", help="show the symptom")
    parser.add_argument(
        "--workdir",
        default=str(WORKDIR),
        help="where checkpoints and hang reports go (default: out/examples in the repository, "
        "git-ignored; cleared of the example's own files)",
    )
    return parser.parse_args()


def log_with_rank() -> None:
    """Configures the example's logging: INFO, every line prefixed with its global rank."""
    logging.basicConfig(
        level=logging.INFO, format="[rank %(rank)s] %(levelname)s %(name)s: %(message)s"
    )
    old_factory = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old_factory(*args, **kwargs)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            record.rank = dist.get_rank()
        else:
            record.rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        return record

    logging.setLogRecordFactory(factory)
