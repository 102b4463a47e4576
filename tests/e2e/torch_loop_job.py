"""A hand-written DDP loop (llama-recipes style) with rankguard's loop API, on 2 ranks.

Usage::

    torchrun --standalone --nproc-per-node 2 tests/e2e/torch_loop_job.py OUT_DIR SCENARIO...

Each scenario is a fresh model (DDP; ``fsdp2``: FSDP2 with sharded saves through
``torch.distributed.checkpoint``; ``short_*_stream``: DDP with ``join`` over
per-rank streams), loaders and ``guard.fit`` in the same two processes;
outcomes per rank go to ``OUT_DIR/rank{N}.json`` (see ``tests/e2e/common.py``).
``post_eval_stall`` never returns (the watchdog ends every rank with exit code
75), so it must come last; rank 1 writes the moment its stall starts to
``OUT_DIR/stall.json``. ``rank0_collective`` (a collective on rank 0 only
after the first eval) never returns either: the deadlock ends every rank with
exit code 70; rank 0 writes the moment of the split to ``OUT_DIR/split.json``.
``data_check_raises`` (rank 1's data check raises at step 6, then its teardown
waits) never returns: it ends the job (exit code 70), so it runs alone; rank 1
writes the moment it raises to ``OUT_DIR/raised.json``, each rank its pid to
``OUT_DIR/pid{N}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from rankguard.integrations.torch import RankGuard
from tests.e2e.common import (
    VOCAB,
    ClaimedStream,
    own_node,
    run_scenarios,
    seed_everything,
    seeded_split,
    token_dataset,
    unseeded_split,
)
from tests.e2e.hang_settings import HANG

COUNTERS: dict[str, int] = {}
OUT = Path(".")
#: Fast watchdog exchanges, so that a fit's end is quick; deadlines stay at their defaults.
QUICK = {"hang_watchdog": {"exchange_period_s": 0.5}}


class BagOfTokens(torch.nn.Module):
    """Mean token embedding -> 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(VOCAB, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def loader(dataset) -> DataLoader:
    data = dataset.with_format("torch")
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))


def count(name: str) -> None:
    COUNTERS[name] = COUNTERS.get(name, 0) + 1


def fit(
    guard: RankGuard,
    train_set,
    eval_set,
    *,
    eval_at_fit: bool = True,
    epochs: int = 1,
    after_eval: Callable[[], None] | None = None,
    check: Callable[[dict, int], None] | None = None,
) -> None:
    """The loop: train, eval every 4 steps (loss summed over ranks), save every 4 steps.

    ``check(batch, step)``: the user's data check, first thing in each step; ``step`` as a
    loop's own counter has it (the steps done before this one: 0 in the first, where
    ``run.step`` is 1) and as rankguard's reports name it.
    """
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(BagOfTokens())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader, eval_loader = loader(train_set), loader(eval_set)
    ckpt = OUT / "ckpt"
    evals = {"eval": eval_loader} if eval_at_fit else None
    with guard.fit(model, optimizer, train_loader, eval_loaders=evals, save_dirs=[ckpt]) as run:
        for epoch in range(epochs):
            train_loader.sampler.set_epoch(epoch)
            for batch in run.train(train_loader):
                count("train_batches")
                if check is not None:
                    check(batch, run.step - 1)
                loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if run.step % 4 == 0:
                    model.eval()
                    with torch.no_grad():
                        for batch in run.eval(eval_loader):
                            count("eval_batches")
                            out = model(batch["input_ids"])
                            eval_loss = torch.nn.functional.cross_entropy(out, batch["labels"])
                            dist.all_reduce(eval_loss)
                    model.train()
                    if after_eval is not None:
                        after_eval()
                    with run.checkpoint(ckpt):
                        if dist.get_rank() == 0:
                            torch.save(model.module.state_dict(), ckpt / f"step{run.step}.pt")
                        count("saves")
    COUNTERS["steps"] = run.step
    COUNTERS["epochs"] = run.epoch + 1


def check_batch(batch: dict, step: int, bad_step: int) -> None:
    """The user's data check: on rank 1, train step ``bad_step`` has a sample with no tokens."""
    if dist.get_rank() == 1 and step == bad_step:
        raise ValueError("sample 4711 has no tokens after filtering")


def lenient_check(batch: dict, step: int) -> None:
    """The data check at step 2, whose error the loop catches: the batch trains as it is."""
    try:
        check_batch(batch, step, bad_step=2)
    except ValueError:
        count("bad_samples_caught")


def healthy() -> None:
    """2 epochs; rank 1's data check raises at step 2 and the loop catches it (no fault)."""
    train_set, eval_set = seeded_split()
    fit(RankGuard(**QUICK), train_set, eval_set, epochs=2, check=lenient_check)
    COUNTERS["checkpoint_files"] = len(list((OUT / "ckpt").glob("step*.pt")))


def unseeded() -> None:
    train_set, eval_set = unseeded_split(64, test_size=0.25)  # before the loop seeds anything
    fit(RankGuard(**QUICK), train_set, eval_set)


def uneven_eval() -> None:
    # Each rank built its own eval set (16 and 32 samples); the loop names it only at eval.
    eval_set = token_dataset(16 if dist.get_rank() == 0 else 32)
    guard = RankGuard(data_consistency_guard=False, **QUICK)
    fit(guard, seeded_split()[0], eval_set, eval_at_fit=False)


def fsdp2() -> None:
    """FSDP2 (``fully_shard``) with sharded saves through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    COUNTERS.clear()
    seed_everything(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = BagOfTokens()
    for module in (model.embed, model.head, model):
        fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_set, _ = seeded_split()
    train_loader, ckpt = loader(train_set), OUT / "dcp"
    guard = RankGuard(checkpoint_planner={"mode": "auto"}, **QUICK)
    saves = {"save_dirs": ckpt, "state_dict_type": "sharded"}
    with guard.fit(model, optimizer, train_loader, **saves) as run:
        for batch in run.train(train_loader):
            loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with run.checkpoint(ckpt):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt / "last")
    planner = next(g for g in guard.runner.guards if g.name == "checkpoint_planner")
    COUNTERS.update(steps=run.step, plan=planner.plan.action, reason=planner.plan.reason)
    COUNTERS["files"] = sorted(p.name for p in (ckpt / "last").iterdir())


def streams(train_n: int, eval_n: int) -> None:
    """Each rank streams its own samples (``__len__``: 16 on every rank); DDP with ``join``.

    The loop runs the planned number of train steps (``len(train_loader)``) and at
    most ``len(eval_loader)`` eval batches, as llama-recipes' ``max_train_step`` and
    ``max_eval_step`` do; DDP's ``join`` lets a rank whose stream ran out first
    finish the epoch, so nothing hangs and, without rankguard, nothing is said.
    """
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    train_loader = DataLoader(ClaimedStream(train_n, claimed=16, seed=rank), batch_size=4)
    eval_loader = DataLoader(ClaimedStream(eval_n, claimed=16, seed=rank), batch_size=4)
    with RankGuard(**QUICK).fit(model, optimizer, train_loader, eval_loaders=eval_loader) as run:
        with model.join():
            for x, y in run.train(train_loader):
                count("train_batches")
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if run.step == len(train_loader):
                    break
        eval_loss = torch.zeros(())
        with torch.no_grad():
            for x, y in run.eval(eval_loader, max_batches=len(eval_loader)):
                count("eval_batches")
                # The module itself: after a join block DDP's forward still all-reduces.
                eval_loss += torch.nn.functional.cross_entropy(model.module(x), y)
        dist.all_reduce(eval_loss)  # after the eval: no collective per batch
        count("evals")


def short_eval_stream() -> None:
    """Rank 0's eval stream ends a batch short (3 of 4), rank 1's holds 5."""
    streams(16, 12 if dist.get_rank() == 0 else 20)


def short_train_stream() -> None:
    """Rank 0's train stream ends a batch short (3 of 4), rank 1's holds 6."""
    streams(12 if dist.get_rank() == 0 else 24, 16)


def per_rank_ckpt() -> None:
    """Each rank saves into a folder of its own that does not exist yet (``ckpt_rank<r>/``)."""
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    ckpt = OUT / "per_rank" / f"ckpt_rank{dist.get_rank()}"
    with RankGuard(**QUICK).fit(model, save_dirs=ckpt) as run, run.checkpoint():
        torch.save(model.module.state_dict(), ckpt / "model.pt")
    COUNTERS["files"] = sorted(str(p.relative_to(OUT)) for p in OUT.glob("per_rank/*/*"))


def resume_node_local() -> None:
    """Each rank plays a node whose local disk is ``node<r>/``; the loop saves, then resumes."""
    rank = dist.get_rank()
    with own_node(rank, OUT / f"node{rank}") as disk:
        COUNTERS.clear()
        seed_everything(0)
        ckpt = disk / "ckpt"  # the same folder name on every node, each node's own
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        guard = RankGuard(**QUICK)
        with guard.fit(model, save_dirs=ckpt) as run, run.checkpoint():
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt / "last.pt")
        COUNTERS["saved"] = len(list(ckpt.iterdir()))
        with guard.load(ckpt / "last.pt"):  # the resume, as the next run would do it
            model.module.load_state_dict(torch.load(ckpt / "last.pt"))
            count("loaded")


def straggler() -> None:
    """Rank 1's forward takes 1.5x as long (tests/e2e/straggler_common.py), 20 batches."""
    from tests.e2e.common import Points
    from tests.e2e.straggler_common import BATCH, BATCHES, STRAGGLER, SlowForward, forward_delay

    COUNTERS.clear()
    seed_everything(0)
    torch.set_num_threads(1)  # two ranks on two shared cores
    model = DistributedDataParallel(SlowForward(forward_delay(dist.get_rank(), slow=True)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Points(2 * BATCHES * BATCH)
    train_loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data))
    guard = RankGuard(straggler_monitor=STRAGGLER, **QUICK)
    with guard.fit(model, optimizer, train_loader) as run:
        for x, y in run.train(train_loader):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    COUNTERS["straggler_rank"] = run.metrics["rankguard/straggler_rank"]


#: A replica check every 2 train batches (and at batch 1).
REPLICA = {"replica_guard": {"interval": 2}, **QUICK}


def accumulate(inverted: bool) -> None:
    """DDP, 2 micro-batches a step; ``inverted``: the ``no_sync`` condition the wrong way round.

    The right way, the first micro-batch's forward and backward run under ``no_sync()``
    and the last's synchronize before ``optimizer.step()``; inverted, the last one's
    gradients stay rank-local and every step moves each replica its own way.
    """
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(BagOfTokens())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_loader = loader(seeded_split()[0])
    with RankGuard(**REPLICA).fit(model, optimizer, train_loader) as run:
        for i, batch in enumerate(run.train(train_loader)):
            count("train_batches")
            last = (i + 1) % 2 == 0
            skip_sync = last if inverted else not last
            with model.no_sync() if skip_sync else contextlib.nullcontext():
                out = model(batch["input_ids"])
                torch.nn.functional.cross_entropy(out, batch["labels"]).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
                count("steps")


def hsdp(seeded: bool) -> None:
    """HSDP: ``fully_shard`` on a 2-D mesh, one replica per rank of a 1-rank shard group.

    Not ``seeded``: each rank builds the model from its own random state (``torch.seed()``),
    and ``fully_shard`` copies no rank's weights to the others (DDP would, when built).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    COUNTERS.clear()
    seed_everything(0)
    if not seeded:
        torch.seed()
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")
    )
    model = BagOfTokens()
    for module in (model.embed, model.head, model):
        fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_loader = loader(seeded_split()[0])
    with RankGuard(**REPLICA).fit(model, optimizer, train_loader) as run:
        for batch in run.train(train_loader):
            count("train_batches")
            loss = torch.nn.functional.cross_entropy(model(batch["input_ids"]), batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


class _WarnedAt(logging.Handler):
    """Records the train batch at which rankguard warns about data (``COUNTERS``)."""

    def emit(self, record: logging.LogRecord) -> None:
        if "cannot keep up" in record.getMessage():
            COUNTERS.setdefault("data_warned_at_batch", COUNTERS.get("train_batches", 0))


def slow_loop(slow_s: float, steps: int, raise_at: int | None = None) -> None:
    """Rank 1's loader ``slow_s`` slower per batch from its first (a slow disk on one node).

    ``raise_at``: its loader raises at that batch, as OLMo's data thread does when reads
    cannot keep up (``generator thread data thread 3 failed``).
    """
    from tests.e2e.common import Points, record_at_raise

    COUNTERS.clear()
    seed_everything(0)
    rank = dist.get_rank()

    def collate(samples):
        if rank == 1:
            time.sleep(slow_s)
            if COUNTERS.get("train_batches", 0) + 1 == raise_at:
                raise RuntimeError("generator thread data thread 3 failed")
        return torch.utils.data.default_collate(samples)

    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Points(2 * 4 * steps)
    sampler = DistributedSampler(data)
    train_loader = DataLoader(data, batch_size=4, sampler=sampler, collate_fn=collate)
    handler = _WarnedAt(logging.WARNING)
    logging.getLogger("rankguard").addHandler(handler)
    try:
        with RankGuard(**QUICK).fit(model, optimizer, train_loader) as run:
            try:
                for x, y in run.train(train_loader):
                    count("train_batches")
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except RuntimeError as exc:  # the loader's: recorded before rankguard tells rank 0
                record_at_raise(exc)
                raise
    finally:
        logging.getLogger("rankguard").removeHandler(handler)


def slow_rank_data() -> None:
    """Rank 1's loader 0.1 s slower per batch over 40 steps: named on every rank."""
    slow_loop(0.1, 40)


def starved_loader() -> None:
    """Rank 1's loader waits from its first batch and raises at its 8th (it ends the job).

    Rank 0 waits in its next collective; rank 1 goes on to ``teardown_waits``.
    """
    slow_loop(0.25, 20, raise_at=8)


def teardown_waits() -> None:
    """After its error, rank 1's process stays, as NCCL's communicator teardown waits for a
    peer: no closed socket tells rank 0 (on gloo it would, at once)."""
    if dist.get_rank() == 1:
        time.sleep(120)


def unsharded(make_loader: Callable[[Any], DataLoader]) -> None:
    """A loop whose train loader every rank reads whole: 2 epochs planned."""
    train_set, _ = seeded_split()
    COUNTERS.clear()
    seed_everything(0)
    model = DistributedDataParallel(BagOfTokens())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = make_loader(train_set.with_format("torch"))
    with RankGuard(**QUICK).fit(model, optimizer, train_loader) as run:
        for _ in range(2):
            for batch in run.train(train_loader):
                count("train_batches")
                out = model(batch["input_ids"])
                torch.nn.functional.cross_entropy(out, batch["labels"]).backward()
                optimizer.step()
                optimizer.zero_grad()


def no_sampler() -> None:
    """As a new user writes it: shuffled with a seeded generator, no DistributedSampler."""
    seeded = torch.Generator().manual_seed(0)
    unsharded(lambda data: DataLoader(data, batch_size=8, shuffle=True, generator=seeded))


def sampler_wrong_replicas() -> None:
    """A DistributedSampler told a world of one (``num_replicas=1, rank=0``) on every rank."""
    unsharded(
        lambda data: DataLoader(
            data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0)
        )
    )


def stall_after_eval() -> None:
    """The bug: rank 1 never comes back from its first eval (here a sleep)."""
    if dist.get_rank() == 1:
        (OUT / "stall.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
        while True:
            time.sleep(3600)


def post_eval_stall() -> None:
    settings = {**HANG, "report_dir": str(OUT / "reports")}
    fit(RankGuard(hang_watchdog=settings), *seeded_split(), after_eval=stall_after_eval)


def reduce_on_rank0_only() -> None:
    """The bug: a collective under ``if rank == 0`` (a metric summed "on the main process")."""
    if dist.get_rank() == 0:
        (OUT / "split.json").write_text(json.dumps({"rank": 0, "t": time.time()}))
        dist.all_reduce(torch.ones(3))


def rank0_collective() -> None:
    """Every setting at its default: the deadlock is proven and ends the job (exit code 70)."""
    guard = RankGuard(hang_watchdog={"report_dir": str(OUT / "reports_rank0_collective")})
    fit(guard, *seeded_split(), after_eval=reduce_on_rank0_only)


def strict_check(batch: dict, step: int) -> None:
    """The data check at step 6, whose error leaves the loop; rank 1 marks the moment."""
    if dist.get_rank() == 1 and step == 6:
        (OUT / "raised.json").write_text(json.dumps({"rank": 1, "t": time.time()}))
    check_batch(batch, step, bad_step=6)


def destroy_process_group_waits() -> None:
    """NCCL's communicator teardown waiting for a peer (here a long sleep): the process stays."""
    time.sleep(600)


def data_check_raises() -> None:
    """The field report: rank 1's data check raises at step 6 (epoch 1); rank 0 goes on into
    its next collective; rank 1's teardown (the script's ``finally``) then waits.

    ``RankGuard`` with a report folder and a 3 s teardown bound, every other setting at its
    default.
    """
    (OUT / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    watchdog = {"report_dir": str(OUT / "reports_data_check_raises"), "teardown_timeout_s": 3}
    try:
        fit(RankGuard(hang_watchdog=watchdog), *seeded_split(), epochs=2, check=strict_check)
    finally:
        destroy_process_group_waits()


SCENARIOS = {
    "healthy": healthy,
    "unseeded_split": unseeded,
    "uneven_eval": uneven_eval,
    "fsdp2": fsdp2,
    "short_eval_stream": short_eval_stream,
    "short_train_stream": short_train_stream,
    "per_rank_ckpt": per_rank_ckpt,
    "resume_node_local": resume_node_local,
    "replica_accumulation": lambda: accumulate(inverted=False),
    "replica_inverted_no_sync": lambda: accumulate(inverted=True),
    "replica_hsdp": lambda: hsdp(seeded=True),
    "replica_hsdp_unseeded": lambda: hsdp(seeded=False),
    "straggler": straggler,
    "slow_rank_data": slow_rank_data,
    "starved_loader": starved_loader,
    "teardown_waits": teardown_waits,
    "no_sampler": no_sampler,
    "sampler_wrong_replicas": sampler_wrong_replicas,
    "post_eval_stall": post_eval_stall,
    "rank0_collective": rank0_collective,
    "data_check_raises": data_check_raises,
}


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1])
    dist.init_process_group("gloo")
    run_scenarios(SCENARIOS, COUNTERS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
