"""Multi-process harnesses that cannot hang the suite.

``run_ranks(fn, world_size)`` starts one process per rank, joins a gloo
process group through a file store (no ports), runs ``fn(rank, world_size,
*args)`` and returns each rank's outcome. ``run_job(cmd, ...)`` runs a
launcher command (``composer -n 2``, a Lightning ``ddp`` script) in its own
session (through ``benchmarks/launch.py``). Every run has a hard timeout after
which the remaining processes are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.launch import finish, job_env, start

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    error_attrs: dict | None = None
    elapsed_s: float | None = None


def _fresh_generators() -> None:
    """Seeds numpy's and torch's global generators from the OS, as a new process has them.

    A rank forked from the server would otherwise share the server's generator states with
    every other rank (python's ``random`` is reseeded at fork already).
    """
    import numpy as np
    import torch

    np.random.seed()
    torch.seed()


def _worker(fn, rank, world_size, init_file, args, queue):
    import torch.distributed as dist

    _fresh_generators()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    start = time.monotonic()
    try:
        value = fn(rank, world_size, *args)
        queue.put(Outcome(rank, 0, value=value, elapsed_s=time.monotonic() - start))
    except BaseException as exc:
        attrs = {k: v for k, v in vars(exc).items() if isinstance(v, int | float | str | list)}
        queue.put(
            Outcome(
                rank,
                1,
                error_type=type(exc).__name__,
                error=f"{exc}\n{traceback.format_exc()}",
                error_attrs=attrs,
                elapsed_s=time.monotonic() - start,
            )
        )
    finally:
        queue.close()
        queue.join_thread()  # flush the outcome before the hard exit
        os._exit(0)  # skip process-group teardown, which can block on a missing peer


#: Imported once by the fork server that starts every rank of :func:`run_ranks`, instead of
#: once per rank: a rank then starts in a fraction of a second, with nothing else inherited
#: (the server starts no thread and no process group).
PRELOAD = ["torch", "torch.distributed", "rankguard.callbacks.core.guard"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout_s: float = 60.0,
    until: Collection[int] | None = None,
) -> list[Outcome]:
    """Runs ``fn`` on ``world_size`` spawned ranks; kills them all after ``timeout_s``.

    ``until``: the ranks whose outcomes the test reads; once they all reported,
    the others (e.g. a rank made to stay stuck) are killed instead of awaited.
    """
    wanted = set(range(world_size) if until is None else until)
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, init_file, args, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout_s
        while not wanted <= outcomes.keys() and time.monotonic() < deadline:
            try:
                o = queue.get(timeout=0.2)
                outcomes[o.rank] = o
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        for rank, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()) if rank in wanted else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [outcomes.get(r, Outcome(r, procs[r].exitcode)) for r in range(world_size)]


@dataclass
class Job:
    returncode: int
    output: str  # stdout and stderr together
    ended_at: float  # Unix time the launched process ended


def run_job(
    cmd: list[str],
    *,
    timeout_s: float,
    cwd: Path | None = None,
    after_exit: Callable[[], None] | None = None,
) -> Job:
    """Runs a launcher command in a session of its own; fails the test on timeout.

    Args:
        cmd: The command.
        timeout_s: Hard limit for the command; then it and every process below
            it are killed (``benchmarks/launch.py::finish``).
        cwd: Working directory (default: this process's).
        after_exit: Called once the command ended, before what is left of the
            session is killed (e.g. to wait for a rank that outlives rank 0).
    """
    # HF_HUB_OFFLINE: no hub. src: rankguard where the environment does not install it.
    path = os.pathsep.join([str(ROOT), str(ROOT / "src")])
    env = job_env(PYTHONPATH=path, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    [ended] = finish([start(cmd, env=env, cwd=cwd)], timeout_s, after_exit)
    if ended.timed_out:
        name = Path(cmd[0]).name
        pytest.fail(f"{name} did not end within {timeout_s} s:\n{ended.stdout[-6000:]}")
    return Job(ended.returncode, ended.stdout, ended.ended_at)
