"""What every OLMo-core scenario shares: the launch's state, a tiny Trainer, its counters.

``OUT`` is set by ``tests/e2e/olmo_core_job.py`` (read it as ``harness.OUT``); ``COUNTERS``
is what a scenario records beside its outcome. :func:`build_trainer` also serves the
one-process tests in ``tests/integrations/test_olmo_core.py`` and the other OLMo-core jobs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import olmo_core.distributed.parallel as olmo_parallel
import torch
import torch.distributed as dist
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDataLoader, NumpyFSLDataset
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.eval import Evaluator
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, Trainer, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback, EvaluatorCallback
from olmo_core.train.train_module import TransformerTrainModuleConfig
from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig
from olmo_core.utils import seed_all
from torch.utils.data import DataLoader, DistributedSampler

from tests.e2e.common import join_started_since

COUNTERS: dict[str, Any] = {}
OUT = Path(".")  # the output folder given on the command line
#: Token ids from 1 to VOCAB - 1; sequences of SEQ_LEN; 4 sequences per rank per batch.
VOCAB, SEQ_LEN, PER_RANK = 64, 8, 4
#: Calibrates from the third step; exchanges often (defaults: 20 steps, 10 s).
QUICK = {"hang_watchdog": {"warmup_steps": 2, "exchange_period_s": 0.5}}


def world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class SlowTokens(NumpyFSLDataset):
    """OLMo-core's token dataset, ``delay_s`` slower per sequence (slow remote storage)."""

    delay_s = 0.0

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().__getitem__(index)


class Perplexity(Evaluator):
    """Mean cross-entropy over every rank's eval sequences (an ``all_reduce``, as OLMo's own)."""

    def __init__(self, name: str, sequences: int, seed: int = 1) -> None:
        ids = torch.randint(
            1, VOCAB, (sequences, SEQ_LEN), generator=torch.Generator().manual_seed(seed)
        )
        rank, size = world()
        sampler = DistributedSampler(range(sequences), num_replicas=size, rank=rank, shuffle=False)
        rows = [{"input_ids": x} for x in ids]
        super().__init__(name=name, batches=DataLoader(rows, batch_size=PER_RANK, sampler=sampler))
        self.totals = torch.zeros(2)

    def update_metrics(self, batch, ce_loss, logits) -> None:
        self.totals += torch.tensor([float(ce_loss.sum()), ce_loss.numel()])

    def compute_metrics(self) -> dict[str, torch.Tensor]:
        if dist.is_initialized():
            dist.all_reduce(self.totals)
        return {"CE loss": self.totals[0] / self.totals[1]}

    def reset_metrics(self) -> None:
        self.totals = torch.zeros(2)


def token_file(work: Path, sequences: int, node_local: bool = False) -> Path:
    """A file of ``sequences`` random sequences, written once by rank 0 (the same on every rank).

    ``node_local``: each rank writes its own ``node<r>/tokens<n>.npy``, as each node's run
    of a prep script that shuffles without a seed: same name and size, different contents.
    """
    rank = world()[0]
    if node_local:
        path = work / f"node{rank}" / f"tokens{sequences}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = np.random.default_rng(0).integers(1, VOCAB, sequences * SEQ_LEN, dtype=np.uint16)
        np.random.default_rng().shuffle(ids)  # the prep script's unseeded shuffle
        ids.tofile(path)
        return path
    path = work / f"tokens{sequences}.npy"
    if rank == 0 and not path.exists():
        ids = np.random.default_rng(0).integers(1, VOCAB, sequences * SEQ_LEN, dtype=np.uint16)
        tmp = path.with_suffix(".tmp")
        ids.tofile(tmp)
        tmp.rename(path)
    while not path.exists():
        time.sleep(0.05)
    return path


def build_trainer(
    work: Path,
    callbacks: dict[str, Callback],
    *,
    eval_sequences: int | None = 32,
    save_folder: Path | None = None,
    steps: int = 8,
    eval_interval: int = 4,
    save_interval: int = 4,
    data_delay_s: float = 0.0,
    state_dict_save_opts: dict[str, Any] | None = None,
    node_local_tokens: bool = False,
    sequences: int = 64,
    save_async: bool = False,
    load_path: str | None = None,
    rank_cursor: bool = False,
) -> Trainer:
    """A tiny OLMo-core Trainer: 64 train sequences (8 steps of 8 on 2 ranks), evals, saves.

    Args:
        work: Its working directory (token files, data loader indices).
        callbacks: Callbacks to add, by name.
        eval_sequences: Sequences of this rank's eval set (split over the ranks), or ``None``.
        save_folder: Where checkpoints go (default: ``work/ckpt``).
        steps: Train steps (``max_duration``).
        eval_interval: Steps between evals.
        save_interval: Steps between saves.
        data_delay_s: Extra time per train sequence on this rank.
        state_dict_save_opts: The train module's save options (OLMo-core's default if ``None``).
        node_local_tokens: Each rank reads its own token file (see :func:`token_file`).
        sequences: Train sequences in the token file.
        save_async: Save asynchronously (OLMo-core's default; see the comment below).
        load_path: ``TrainerConfig(load_path=...)``.
        rank_cursor: The data loader also keeps each rank's own cursor (:class:`RankCursorLoader`).
    """
    work.mkdir(parents=True, exist_ok=True)
    seed_all(0)  # as OLMo-core's scripts do
    # OLMo-core builds its device mesh once per process; each scenario is a fresh Trainer.
    olmo_parallel._WORLD_MESH = None
    dataset = SlowTokens(
        token_file(work, sequences, node_local_tokens),
        sequence_length=SEQ_LEN,
        pad_token_id=0,
        eos_token_id=0,
        vocab_size=VOCAB,
    )
    dataset.delay_s = data_delay_s
    dataset.work_dir = work
    _, size = world()
    loader = NumpyDataLoaderConfig(
        global_batch_size=PER_RANK * SEQ_LEN * size,
        seed=0,
        num_workers=0,
        num_threads=1,
        work_dir=str(work),
    ).build(dataset)
    if rank_cursor:
        loader.__class__, loader.rank_last_index = RankCursorLoader, -1
    model = TransformerConfig.llama_like(
        d_model=16, vocab_size=VOCAB, n_layers=1, n_heads=2, hidden_size_multiple_of=16
    ).build(init_device="cpu")
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=PER_RANK * SEQ_LEN,
        max_sequence_length=SEQ_LEN,
        optim=AdamWConfig(lr=1e-3),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp) if size > 1 else None,
        state_dict_save_opts=state_dict_save_opts,
    ).build(model, device=torch.device("cpu"))
    olmo_callbacks: dict[str, Callback] = {
        # Synchronous saves: OLMo-core 3.0's asynchronous save records a reduced metric
        # (`checkpoint/save_async_duration_s`) on each rank when its own save ends, so ranks'
        # metric flushes can differ and the flush's collective aborts or hangs
        # (docs/integrations.md).
        "checkpointer": CheckpointerCallback(save_interval=save_interval, save_async=save_async),
        **callbacks,
    }
    if eval_sequences is not None:
        olmo_callbacks["evaluator"] = EvaluatorCallback(
            evaluators=[Perplexity("eval", eval_sequences)], eval_interval=eval_interval
        )
    config = TrainerConfig(
        save_folder=str(save_folder or work / "ckpt"),
        work_dir=str(work),
        load_path=load_path,
        max_duration=Duration.steps(steps),
        metrics_collect_interval=2,
        callbacks=olmo_callbacks,
    )
    return config.build(module, loader)


class RankCursorLoader(NumpyFSLDataLoader):
    """OLMo-core's loader that also keeps this rank's own cursor (its last instance index).

    As a loader over per-rank shards does; OLMo-core saves it per rank (``train/rank{N}.pt``).
    """

    rank_last_index = -1

    def __iter__(self):
        for batch in super().__iter__():
            self.rank_last_index = int(batch["index"].max())
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rank_last_index": self.rank_last_index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.rank_last_index = state_dict["rank_last_index"]


class Count(Callback):
    """Counts what actually ran on this rank, and the ``rankguard/...`` metrics logged."""

    def __init__(self) -> None:
        COUNTERS.clear()
        COUNTERS.update(steps=0, eval_batches=0, saves=0, rankguard_keys_logged=[])

    def pre_step(self, batch) -> None:
        COUNTERS["steps"] += 1

    def post_checkpoint_saved(self, path) -> None:
        COUNTERS["saves"] += 1

    def post_checkpoint_loaded(self, path) -> None:
        COUNTERS["loaded"] = str(path)
        COUNTERS["cursor_after_load"] = getattr(self.trainer.data_loader, "rank_last_index", None)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        keys = {k for k in metrics if k.startswith("rankguard/")}
        COUNTERS["rankguard_keys_logged"] = sorted(keys | set(COUNTERS["rankguard_keys_logged"]))


class CountEvalBatches(Callback):
    """Counts eval batches through the Trainer's train module (wrapped before rankguard's)."""

    def post_attach(self) -> None:
        module = self.trainer.train_module
        eval_batch = module.eval_batch

        def counted(*args, **kwargs):
            COUNTERS["eval_batches"] += 1
            return eval_batch(*args, **kwargs)

        module.eval_batch = counted


def fit(trainer: Trainer) -> None:
    """``trainer.fit()``, ended as a job's process ends: with every thread the fit started.

    The next scenario runs in this process. A fit that raised leaves OLMo-core's bookkeeping
    pools running (``_shutdown(gracefully=False)``), and an asynchronous save's executor
    (torch's ``AsyncCheckpointExecutor``) runs the save's done-callbacks after its future is
    set: OLMo-core's ``post_train`` returns from ``future.result()`` while they may still
    record ``checkpoint/save_async_duration_s`` and call ``post_checkpoint_saved``. A job's
    exit shuts the pools down and joins both; so does this.
    """
    before = set(threading.enumerate())
    try:
        trainer.fit()
    finally:
        for pool in (trainer._multi_thread_pool, trainer._single_thread_pool):
            if pool is not None:  # OLMo-core's own graceful end shut them down already
                pool.shutdown(wait=False)
        join_started_since(before)
        COUNTERS["files"] = sorted(
            p.name for p in Path(trainer.save_folder).glob("step*") if p.is_dir()
        )


def counting(guard: Callback) -> dict[str, Callback]:
    return {"rankguard": guard, "count": Count(), "count_eval": CountEvalBatches()}
