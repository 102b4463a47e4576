"""The OLMo-core ``Trainer`` (a 1-layer Llama-like transformer from a config) with rankguard.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/olmo_core_job.py OUT_DIR SCENARIO...

Each scenario is a fresh model and ``Trainer`` in the same two processes;
outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see ``tests/e2e/common.py``).
``resume`` continues ``healthy``'s run from its last checkpoint, so it comes
after it; ``post_eval_stall`` never returns (the watchdog ends every rank with
exit code 75), so it must come last; rank 1 writes the moment its stall starts
to ``OUT_DIR/stall.json``. ``data_check_raises`` (rank 1's data check raises at step
6, then its teardown waits) ends the job (exit code 70), so it runs alone; rank 1
writes the moment it raises to ``OUT_DIR/raised.json``, each rank its pid to
``OUT_DIR/pid{N}``. ``metric_on_one_rank_bare`` (no rankguard) ends in
gloo's abort of both processes, so it runs alone. Token files are random ids
written into ``OUT_DIR``; nothing needs the network. :func:`build_trainer` also
serves the one-process tests in ``tests/integrations/test_olmo_core.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
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
from olmo_core.train.common import ReduceType
from olmo_core.train.train_module import TransformerTrainModuleConfig
from olmo_core.train.train_module.transformer.config import TransformerDataParallelConfig
from olmo_core.utils import seed_all
from torch.utils.data import DataLoader, DistributedSampler

from tests.e2e.common import Mirror, join_started_since, own_node, rankguard_off, run_scenarios
from tests.e2e.hang_settings import HANG

COUNTERS: dict[str, Any] = {}
OUT = Path(".")
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


class StallAfterEval(Callback):
    """The bug: rank 1 never comes back from its first evaluation (here a sleep)."""

    priority = -1  # after the evaluator's post_step (0)

    def post_step(self) -> None:
        if self.step % 4 == 0 and dist.get_rank() == 1:
            (OUT / "stall.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
            while True:
                time.sleep(3600)


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


def healthy() -> None:
    from rankguard.integrations.olmo_core import RankGuard

    fit(build_trainer(OUT / "healthy", counting(RankGuard(**QUICK))))


def resume() -> None:
    """``healthy``'s run continued for 4 more steps from its last checkpoint (step 8)."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    trainer = build_trainer(OUT / "healthy", counting(guard), steps=12)
    state = torch.load(
        OUT / "healthy" / "ckpt" / "step8" / "train" / f"rank{dist.get_rank()}.pt",
        weights_only=False,
    )
    COUNTERS["saved_state"] = sorted(state["callbacks"]["rankguard"])
    watchdog = next(g for g in guard.runner.guards if g.name == "hang_watchdog")
    fit(trainer)
    COUNTERS["resumed_at"] = 8 if trainer.checkpoint_loaded else 0
    COUNTERS["calibrated_from_checkpoint"] = bool(watchdog.heartbeats.restored)


#: The resume scenarios' run: saved at steps 0, 4 and 8, with a per-rank data cursor.
RESUME_RUN = "resume_run"


def resume_guard_of(guard: Callback) -> Any:
    return next(g for g in guard.runner.guards if g.name == "resume_guard")


def resume_first() -> None:
    """A first fit of 8 steps saving at 0, 4 and 8; the resume guard's state at the last save."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    fit(build_trainer(OUT / RESUME_RUN, counting(guard), eval_sequences=None, rank_cursor=True))
    COUNTERS["guard_saved"] = resume_guard_of(guard).state_dict()


def resumed_fit(guard: Callback, trainer: Trainer) -> None:
    """``trainer.fit()``, recording what the resume guard holds as RESUMED starts."""
    resume = resume_guard_of(guard)
    resumed = guard.driver.resumed

    def recorded(facts):
        COUNTERS["loaded_state"] = dict(resume._loaded)
        COUNTERS["resumed"] = {"checkpoint": facts.checkpoint, "asked": facts.asked}
        resumed(facts)

    guard.driver.resumed = recorded
    try:
        fit(trainer)
    finally:
        COUNTERS["verdict"] = resume.verdict and [resume.verdict.error, resume.verdict.warnings]


def resume_healthy() -> None:
    """The same config with 4 more steps, fit again: OLMo-core loads the latest (step8)."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    trainer = build_trainer(
        OUT / RESUME_RUN, counting(guard), eval_sequences=None, steps=12, rank_cursor=True
    )
    state = torch.load(
        OUT / RESUME_RUN / "ckpt" / "step8" / "train" / f"rank{dist.get_rank()}.pt",
        weights_only=False,
    )
    COUNTERS["file_state"] = state["callbacks"]["rankguard"].get("resume_guard")
    resumed_fit(guard, trainer)


def resume_callbacks(rank_guard: type) -> dict[str, Callback]:
    """``Count`` and ``RankGuard``, or ``Count`` alone with ``E2E_RANKGUARD=off``."""
    return {"count": Count()} if rankguard_off() else counting(rank_guard(**QUICK))


def run_resumed(trainer: Trainer) -> None:
    guard = trainer.callbacks.get("rankguard")
    if guard is None:
        fit(trainer)
    else:
        resumed_fit(guard, trainer)


def copy_checkpoints(target: Path, names: list[str], train_files: str = "rank*.pt") -> None:
    """Copies ``names`` of the first fit's save folder to ``target`` (``train/`` as matched)."""
    for name in names:
        source = OUT / RESUME_RUN / "ckpt" / name
        shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("train"))
        (target / name / "train").mkdir()
        for file in (source / "train").glob(train_files):
            shutil.copy2(file, target / name / "train" / file.name)


def resume_lagging_copy() -> None:
    """Each rank plays a node resuming from its own disk's ``ckpt`` (the same path on every
    node, as ``/local/ckpt``); node 1's copy lost the newest, ``step8``."""
    from rankguard.integrations.olmo_core import RankGuard

    rank = dist.get_rank()
    os.environ["OLMO_SHARED_FS"] = "1"
    here = os.getcwd()
    try:
        with own_node(rank, OUT / f"lagging_node{rank}") as disk:
            copy_checkpoints(disk / "ckpt", ["step0", "step4", "step8"][: 3 - rank])
            dist.barrier()  # both copies are in place before the restart
            os.chdir(disk)
            trainer = build_trainer(
                OUT / RESUME_RUN,
                resume_callbacks(RankGuard),
                eval_sequences=None,
                save_folder=Path("ckpt"),
                steps=12,
                rank_cursor=True,
            )
            run_resumed(trainer)
    finally:
        os.chdir(here)
        del os.environ["OLMO_SHARED_FS"]


def resume_rank0_state() -> None:
    """``load_path=`` a copy of step8 that kept ``train/rank0.pt`` alone (the trainer state as
    one file): OLMo-core's load falls back to it on rank 1 (data cursor and random states)."""
    from rankguard.integrations.olmo_core import RankGuard

    copy = OUT / "promoted"
    if dist.get_rank() == 0:
        copy_checkpoints(copy, ["step8"], train_files="rank0.pt")
    dist.barrier()
    trainer = build_trainer(
        OUT / RESUME_RUN,
        resume_callbacks(RankGuard),
        eval_sequences=None,
        save_folder=OUT / "rank0_state" / "ckpt",
        steps=12,
        load_path=str(copy / "step8"),
        rank_cursor=True,
    )
    run_resumed(trainer)


def uneven_eval() -> None:
    # Each rank built its own eval set (32 and 64 sequences): 4 and 8 eval batches per rank.
    from rankguard.integrations.olmo_core import RankGuard

    # DataConsistencyGuard would name the sets' lengths at fit start: BatchParityGuard is tested.
    sequences = 32 if dist.get_rank() == 0 else 64
    guard = RankGuard(data_consistency_guard=False, **QUICK)
    fit(build_trainer(OUT / "uneven_eval", counting(guard), eval_sequences=sequences))


def slow_data() -> None:
    """Rank 1's token reads take 25 ms per sequence (100 ms per batch), 16 steps."""
    from rankguard.integrations.olmo_core import RankGuard

    monitor = {"interval": 4, "window": 3}
    guard = RankGuard(data_stall_monitor=monitor, **QUICK)
    delay = 0.025 if dist.get_rank() == 1 else 0.0
    trainer = build_trainer(
        OUT / "slow_data",
        counting(guard),
        eval_sequences=None,
        steps=16,
        save_interval=100,
        data_delay_s=delay,
    )
    fit(trainer)


def slow_rank_data() -> None:
    """Rank 1's token reads 0.1 s slower per batch (a slow disk on one node), 40 steps."""
    from rankguard.integrations.olmo_core import RankGuard

    delay = 0.1 / PER_RANK if dist.get_rank() == 1 else 0.0
    trainer = build_trainer(
        OUT / "slow_rank_data",
        counting(RankGuard(**QUICK)),
        eval_sequences=None,
        steps=40,
        save_interval=100,
        data_delay_s=delay,
        sequences=8 * 40,
    )
    fit(trainer)


def node_local_tokens() -> None:
    """Each node's token file: same name and size, contents shuffled without a seed."""
    from rankguard.integrations.olmo_core import RankGuard

    guard = RankGuard(**QUICK)
    fit(build_trainer(OUT / "node_local_tokens", counting(guard), node_local_tokens=True))


def node_local() -> None:
    """Each rank plays a node whose local disk is ``node<r>/``; ``OLMO_SHARED_FS=1`` says shared."""
    from rankguard.integrations.olmo_core import RankGuard

    rank = dist.get_rank()
    os.environ["OLMO_SHARED_FS"] = "1"
    try:
        with own_node(rank, OUT / f"node{rank}") as disk:
            trainer = build_trainer(
                OUT / "node_local", counting(RankGuard(**QUICK)), save_folder=disk / "ckpt"
            )
            fit(trainer)
    finally:
        del os.environ["OLMO_SHARED_FS"]


#: How late rank 1's view of the shared folder shows ``step0-tmp``: past OLMo-core's 10 s.
LATE_S = 12.0
#: The barrier's ``timeout_s`` where rank 1 never sees ``step0-tmp``.
NEVER_TIMEOUT_S = 2.0


def lagging_view(name: str, late_s: float, guard: Callback) -> None:
    """Rank 0 saves into ``view0/ckpt``, rank 1 into ``view1/ckpt``: its view of one folder.

    A mirror thread in rank 1 shows rank 0's ``step0-tmp`` there ``late_s`` after rank 0
    makes it (``math.inf``: never), every other folder at once. 2 steps, saved at steps 0
    and 2 (OLMo-core's pre-train and final saves); the time each folder poll took, by path
    below the save folder, goes to the ``folder_waits`` counter.
    """
    rank = dist.get_rank()
    base = OUT / name
    view = base / f"view{rank}"
    view.mkdir(parents=True)  # each node's mount point
    barrier = next(g for g in guard.runner.guards if g.name == "shared_dir_barrier")
    run = barrier.run
    waits: dict[str, float] = {}

    def timed(directories, where, *args, **kwargs):
        report = run(directories, where, *args, **kwargs)
        if where == "checkpoint_folder" and report is not None:
            below = os.path.relpath(report.paths[0], view / "ckpt")
            waits[below] = round(report.max_waited_s, 1)
            COUNTERS["folder_waits"] = dict(waits)
        return report

    barrier.run = timed
    late = {"ckpt/step0-tmp": late_s}
    mirror = Mirror([(str(base / "view0"), str(view), lambda rel: late.get(rel, 0.0))])
    if rank == 1:
        mirror.start()
    try:
        trainer = build_trainer(
            base,
            counting(guard),
            eval_sequences=None,
            save_folder=view / "ckpt",
            steps=2,
            save_interval=100,
        )
        fit(trainer)
    finally:
        mirror.stop.set()
        if rank == 1:
            mirror.join()


def late_checkpoint_folder() -> None:
    """Rank 1 sees ``step0-tmp`` 12 s late: OLMo-core would give up after 10 s."""
    from rankguard.integrations.olmo_core import RankGuard

    lagging_view("late_folder", LATE_S, RankGuard(**QUICK))


def checkpoint_folder_never_seen() -> None:
    """Rank 1 never sees ``step0-tmp``: named after the barrier's 2 s ``timeout_s``."""
    from rankguard.integrations.olmo_core import RankGuard

    barrier = {"timeout_s": NEVER_TIMEOUT_S}
    lagging_view("never_seen", math.inf, RankGuard(shared_dir_barrier=barrier, **QUICK))


#: How long rank 1's negative lookup cache hides each ``step<N>`` after rank 0 made it, and
#: the barrier's ``warn_late_s`` (the suite's short lag; ``benchmarks/nfs_lag.py`` sets 15 s).
NEG_CACHE_LAG_S = float(os.environ.get("NEG_CACHE_LAG_S", "2.0"))
NEG_CACHE_WARN_S = float(os.environ.get("NEG_CACHE_WARN_S", "1.0"))


def negative_cache_folder() -> None:
    """One save folder; rank 1's NFS client hides each renamed ``step<N>`` ``NEG_CACHE_LAG_S``.

    Under negative-cache semantics (:class:`tests.e2e.nfs_view.NegativeLookupCache`):
    ``stat`` says ``ENOENT``, ``mkdir`` says ``EEXIST``, the listing leaves it out. 2
    steps, saved at steps 0 and 2, synchronously (OLMo-core 3.0's async save records its
    duration at whatever step each rank has reached when it ends: ranks a lag has put apart
    then reduce different metric steps and hang); the cache's longest hide per folder goes to
    ``hidden``.
    """
    from rankguard.integrations.olmo_core import RankGuard
    from tests.e2e.nfs_view import NegativeLookupCache

    base = OUT / "negative_cache"
    barrier = {"warn_late_s": NEG_CACHE_WARN_S}
    guard = RankGuard(shared_dir_barrier=barrier, **QUICK)
    cache = NegativeLookupCache(
        str(base / "ckpt"), NEG_CACHE_LAG_S, lambda p: re.fullmatch(r"step\d+", Path(p).name)
    )
    trainer = build_trainer(base, counting(guard), eval_sequences=None, steps=2, save_interval=100)
    if dist.get_rank() == 1:
        cache.__enter__()
    try:
        fit(trainer)
    finally:
        if dist.get_rank() == 1:
            cache.__exit__()
        COUNTERS["hidden"] = {Path(p).name: round(s, 1) for p, s in cache.hidden.items()}


#: Host memory the planner is told each node has: less than the 1-layer model's state.
TINY_HOST_BYTES = 16 * 1024


def ckpt_over_memory() -> None:
    """OLMo-core's default sharded save, on a node given 16 KiB: stopped at fit start."""
    from rankguard.integrations.olmo_core import RankGuard

    planner = {"host_memory_bytes": TINY_HOST_BYTES, "mode": "raise"}
    guard = RankGuard(checkpoint_planner=planner, **QUICK)
    fit(build_trainer(OUT / "ckpt_over_memory", counting(guard)))


def full_export_over_memory() -> None:
    """``state_dict_save_opts={'full_state_dict': True}``: a full export, planned as one."""
    from rankguard.integrations.olmo_core import RankGuard

    planner = {"host_memory_bytes": TINY_HOST_BYTES, "mode": "raise"}
    guard = RankGuard(checkpoint_planner=planner, **QUICK)
    options = {"full_state_dict": True, "cpu_offload": True}
    trainer = build_trainer(OUT / "full_export", counting(guard), state_dict_save_opts=options)
    fit(trainer)


class RecordOnRank1(Callback):
    """Rank 1 records a metric with a reduce type at step 5, after OLMo-core's first flush.

    As a callback counting a quantity only some ranks have (tokens skipped by a
    filter, a debug metric): OLMo-core flushes it with the steps 5-6 at step 6.
    The moment it records goes to ``OUT/split.json`` (``benchmarks/detection.py``).
    """

    def post_step(self) -> None:
        if dist.get_rank() == 1 and self.trainer.global_step == 5:
            (OUT / "split.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
            self.trainer.record_metric("debug/skipped_tokens", 3.0, reduce_type=ReduceType.sum)


def metric_on_one_rank() -> None:
    from rankguard.integrations.olmo_core import RankGuard

    callbacks = {**counting(RankGuard(**QUICK)), "debug": RecordOnRank1()}
    fit(build_trainer(OUT / "metric_on_one_rank", callbacks))


def metric_on_one_rank_bare() -> None:
    """The same fault without rankguard: OLMo-core's flush at step 6 meets gloo."""
    fit(build_trainer(OUT / "metric_on_one_rank_bare", {"debug": RecordOnRank1()}))


def post_eval_stall() -> None:
    from rankguard.integrations.olmo_core import RankGuard

    settings = {**HANG, "report_dir": str(OUT / "reports")}
    callbacks = {**counting(RankGuard(hang_watchdog=settings)), "stall": StallAfterEval()}
    fit(build_trainer(OUT / "post_eval_stall", callbacks))


def check_batch(batch: dict[str, Any], step: int) -> None:
    """The user's data check: on rank 1, train step 6 has a sample with no tokens left."""
    if dist.get_rank() == 1 and step == 6:
        (OUT / "raised.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
        raise ValueError("sample 4711 has no tokens after filtering")


class CheckBatches(Callback):
    """The user's callback that checks each train batch before its step.

    OLMo-core's ``global_step`` counts the step in progress (1 in the first); ``step`` is the
    steps done before it, as a loop's own counter and rankguard's reports count them.
    """

    def pre_step(self, batch: dict[str, Any]) -> None:
        check_batch(batch, self.trainer.global_step - 1)


def destroy_process_group_waits() -> None:
    """NCCL's communicator teardown waiting for a peer (here a long sleep): the process stays."""
    time.sleep(600)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6; rank 0 goes on into its next
    collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default. It ends the job (exit code 70).
    """
    from rankguard.integrations.olmo_core import RankGuard

    (OUT / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    watchdog = {"report_dir": str(OUT / "reports_data_check_raises"), "teardown_timeout_s": 3}
    callbacks = {"check": CheckBatches()}
    if not rankguard_off():
        callbacks["rankguard"] = RankGuard(hang_watchdog=watchdog)
    trainer = build_trainer(OUT / "data_check_raises", callbacks)
    try:
        trainer.fit()
    finally:
        destroy_process_group_waits()


SCENARIOS = {
    "resume_first": resume_first,
    "resume_healthy": resume_healthy,
    "resume_lagging_copy": resume_lagging_copy,
    "resume_rank0_state": resume_rank0_state,
    "healthy": healthy,
    "resume": resume,
    "uneven_eval": uneven_eval,
    "slow_data": slow_data,
    "slow_rank_data": slow_rank_data,
    "node_local_tokens": node_local_tokens,
    "node_local": node_local,
    "late_checkpoint_folder": late_checkpoint_folder,
    "checkpoint_folder_never_seen": checkpoint_folder_never_seen,
    "negative_cache_folder": negative_cache_folder,
    "ckpt_over_memory": ckpt_over_memory,
    "full_export_over_memory": full_export_over_memory,
    "metric_on_one_rank": metric_on_one_rank,
    "metric_on_one_rank_bare": metric_on_one_rank_bare,
    "post_eval_stall": post_eval_stall,
    "data_check_raises": data_check_raises,
}


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two shared cores
    run_scenarios(SCENARIOS, COUNTERS)


if __name__ == "__main__":
    main()
