"""The failures rankguard exists for, as faults the 2-rank examples can inject.

``composer_train.py`` and ``lightning_train.py`` take everything that depends
on ``--fault`` from here, so a fault means the same in both frameworks:

* :func:`setup` (the same on every rank): rankguard's settings for the
  fault, the model's width, the number of epochs, the checkpoint folder;
* :meth:`FaultSetup.data` (per rank): the train and eval sets and the train
  loader's ``drop_last``;
* :meth:`FaultSetup.checkpoint_dir`, :meth:`FaultSetup.clear_checkpoints` and
  :meth:`FaultSetup.hangs_after_eval`: what a rank does differently.

Where a fault needs a deadline to pass, the settings shorten it for the demo
(5 s instead of rankguard's production defaults of 600 s).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

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
    "node_local_ckpt": "each rank saves to its own directory, as on a node-local disk",
    "ckpt_over_memory": "a 720k-parameter model with Adam on a node given 1 MiB for the save",
}

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


def unseeded_split(n: int, n_eval: int) -> tuple[Subset, Subset]:
    """Splits ``points(n)`` the way the bug does: a shuffle seeded differently in every process."""
    order = list(range(n))
    random.Random().shuffle(order)  # no seed: seeded from os.urandom, different per process
    data = points(n)
    return Subset(data, order[n_eval:]), Subset(data, order[:n_eval])


@dataclass(frozen=True)
class RankData:
    """One rank's data."""

    train: Dataset
    eval: Dataset
    train_drop_last: bool = False

    def describe(self, rank: int) -> None:
        """Logs which samples this rank holds out, where the split is the rank's own."""
        if isinstance(self.eval, Subset):
            held_out = sorted(self.eval.indices)
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

    def data(self, rank: int) -> RankData:
        """Builds rank ``rank``'s train and eval sets (64 and 32 samples unless the fault says)."""
        if self.fault == "unseeded_split":
            train, evals = unseeded_split(96, 32)
            return RankData(train, evals)
        train_size = {"uneven_train": 32 if rank == 0 else 48, "drop_last": 66}.get(self.fault, 64)
        eval_size = (16 if rank == 0 else 32) if self.fault == "uneven_eval" else 32
        train: Dataset = points(train_size)
        if self.fault == "slow_data":  # the same dataset everywhere; rank 1's storage is slow
            train = SlowDataset(train, delay_s=0.025 if rank == 1 else 0.0)
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

    def hangs_after_eval(self, rank: int) -> bool:
        """Whether rank ``rank`` sleeps forever after its first evaluation."""
        return self.fault == "post_eval_hang" and rank == 1

    def model(self, rank: int) -> torch.nn.Module:
        """Rank ``rank``'s MLP classifier 8 -> ``hidden`` -> 2 (the same weights on every rank)."""
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(8, self.hidden), torch.nn.ReLU(), torch.nn.Linear(self.hidden, 2)
        )
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
        files = sorted(os.listdir(folder))
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
        # `node<rank>` stands for each node's local disk: the same folder name on every
        # node, a different directory on each.
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
