"""A rank on another node raises or is killed: a hand-written loop on two simulated nodes.

Run by one torchrun per node (``benchmarks/launch.py::launch_nodes``)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=N ... nodes_fault_job.py OUT SCENARIO

Rank 1 (node 1) fails at train step 6; rank 0 (node 0) goes on into its next step.
No launcher stops the other node's ranks: node 0's torchrun watches node 0 only.

- ``raise``: rank 1's data check raises ``ValueError``; its ``finally`` then waits, as
  NCCL's communicator teardown waits for a peer (its process stays); rank 0 waits
  in its next all-reduce.
- ``kill``: rank 1 is SIGKILLed (the OOM killer); rank 0 waits at its next host
  sync, as under NCCL, where the all-reduce returns at once and the thread waits at
  the next ``.item()`` (on gloo the dead peer's closed socket would raise at once).
- ``freeze_first_step`` / ``kill_first_step``: rank 1 is stopped (SIGSTOP: a frozen
  process, a lost node's open sockets) or SIGKILLed inside its first ``optimizer.step()``
  (where Adam allocates its state and the OOM killer strikes), still in start-up,
  whose deadline is 30 min; rank 0 waits in its next all-reduce (SIGSTOP: gloo blocks
  as NCCL does) or at its next host sync (SIGKILL, as above).
- ``freeze``: rank 1 is stopped (SIGSTOP) at step 6, mid-training.
- ``freeze_eval`` / ``freeze_save``: after train step ``PHASE_AT`` the loop evaluates
  (``run.eval``: a forward and an all-reduce of the eval loss per batch) or saves
  (``run.checkpoint``: this rank's shard, written in chunks as to a slow filesystem);
  rank 1 is stopped (SIGSTOP) before its last eval batch or chunk, ``PHASE_LEN`` in,
  and rank 0 then waits in that batch's all-reduce or the next step's.
- ``slow_first_step``: rank 1's first ``optimizer.step()`` takes 10 s of Python (its
  watchdog thread answers): nothing is named, the job ends with 0.

Rank 1 writes ``OUT/rank1.json`` the moment it fails; log lines carry their Unix time
(``benchmarks/faults.py`` reads both). ``RANKGUARD=off``: the same loop without rankguard;
``RANKGUARD=defaults``: ``RankGuard()`` with only a report folder (``benchmarks/silent_rank.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rankguard.integrations.torch import RankGuard, Run
from tests.e2e.common import destroy_process_group_waits, wait_at_host_sync

FAIL_AT = 6
#: A step's time. Each rank tells the others at once that it left start-up (its exchange
#: after its first batch); rank 1 dies four steps later, as a rank that fails in training
#: does, once the others know it trains. At 50 ms a step a loaded machine could run that
#: exchange after rank 1 died: rank 1 then stays in start-up, whose deadline is 30 min.
STEP_S = 0.25
#: Short deadlines: a rank gone on another node is named at its deadline (no pid to read).
WATCHDOG = {"timeout_s": 6.0, "exchange_period_s": 1.0, "teardown_timeout_s": 3.0}
#: ``freeze_eval`` / ``freeze_save``: the train step after which the loop evaluates or saves,
#: and the eval batches (save chunks) of a step's time each: 13 s at least, so that a status
#: exchange (10 s apart at the defaults) saw rank 1 in that phase before it froze.
PHASE_AT, PHASE_LEN = 4, 52


def check_batch(batch: torch.Tensor, step: int) -> None:
    """The user's data check: rank 1's sample at step 6 has no tokens."""
    if dist.get_rank() == 1 and step == FAIL_AT:
        raise ValueError("sample 4711 has no tokens after filtering")


class Bare:
    """The loop's ``guard.fit(...)`` / ``run`` without rankguard (``RANKGUARD=off``)."""

    step = 0

    @contextlib.contextmanager
    def fit(self, model: torch.nn.Module) -> Iterator[Bare]:
        yield self

    def train(self, data: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        for self.step, batch in enumerate(data, start=1):
            yield batch

    def eval(self, data: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
        return data

    @contextlib.contextmanager
    def checkpoint(self, folder: Path) -> Iterator[None]:
        folder.mkdir(parents=True, exist_ok=True)
        yield


def optimizer_step(optimizer: torch.optim.Optimizer, scenario: str, step: int, out: Path) -> None:
    """``optimizer.step()``; rank 1's first is where the ``*_first_step`` scenarios strike."""
    if dist.get_rank() == 1 and step == 1 and scenario.endswith("_first_step"):
        mark(out, "failed")
        if scenario == "freeze_first_step":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif scenario == "kill_first_step":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            time.sleep(10.0)  # slow Python: the watchdog thread still answers
    optimizer.step()
    optimizer.zero_grad()


def mark(out: Path, what: str) -> None:
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({what: time.time()}))


def freeze_at_last(index: int, scenario: str, phase: str, out: Path) -> None:
    """Rank 1, before its last eval batch or save chunk of the ``freeze_{phase}`` scenario."""
    if scenario == f"freeze_{phase}" and dist.get_rank() == 1 and index == PHASE_LEN - 1:
        mark(out, "failed")
        os.kill(os.getpid(), signal.SIGSTOP)


def evaluate(run: Run | Bare, model: torch.nn.Module, scenario: str, out: Path) -> None:
    """The loop's eval: a forward per batch and the eval loss all-reduced across ranks."""
    data = [torch.randn(2, 4) for _ in range(PHASE_LEN)]
    with torch.no_grad():
        for index, batch in enumerate(run.eval(data)):
            freeze_at_last(index, scenario, "eval", out)
            loss = model(batch).sum()
            dist.all_reduce(loss)
            time.sleep(STEP_S)


def save(run: Run | Bare, model: torch.nn.Module, scenario: str, out: Path) -> None:
    """The loop's save: this rank's shard, written in chunks (a slow filesystem)."""
    folder = out / "ckpt"
    with run.checkpoint(folder), open(folder / f"rank{dist.get_rank()}.pt", "wb") as file:
        for index in range(PHASE_LEN):
            freeze_at_last(index, scenario, "save", out)
            torch.save(model.state_dict(), file)
            file.flush()
            time.sleep(STEP_S)


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    logging.basicConfig(format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters())
    data = [torch.randn(2, 4) for _ in range(40)]
    settings = {} if os.environ.get("RANKGUARD") == "defaults" else WATCHDOG
    guard: RankGuard | Bare = RankGuard(
        hang_watchdog={**settings, "report_dir": str(out / "reports")}
    )
    if os.environ.get("RANKGUARD") == "off":
        guard = Bare()
    try:
        with guard.fit(model) as run:
            for batch in run.train(data):
                step = run.step  # the batch in the body counts: 6 is the sixth
                if scenario in ("kill", "freeze") and rank == 1 and step == FAIL_AT:
                    mark(out, "failed")
                    os.kill(os.getpid(), signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
                if scenario == "kill" and rank == 0 and step == FAIL_AT:
                    wait_at_host_sync()  # its all-reduce was enqueued: NCCL returned
                if scenario == "kill_first_step" and rank == 0 and step == 2:
                    wait_at_host_sync()
                if scenario == "raise" and rank == 1 and step == FAIL_AT:
                    mark(out, "failed")
                if scenario == "raise":
                    check_batch(batch, step)
                loss = model(batch).sum()
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                optimizer_step(optimizer, scenario, step, out)
                time.sleep(STEP_S)
                if scenario == "freeze_eval" and step == PHASE_AT:
                    evaluate(run, model, scenario, out)
                if scenario == "freeze_save" and step == PHASE_AT:
                    save(run, model, scenario, out)
    finally:
        if scenario == "raise" and rank == 1:
            destroy_process_group_waits()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
