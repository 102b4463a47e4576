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

from benchmarks.launch import finish, free_port, job_env, start

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
    setup_failed: bool = False  # the process group's set-up raised, before ``fn`` ran
    killed: bool = False  # still running when its outcome was no longer awaited, then killed


def _fresh_generators() -> None:
    """Seeds numpy's and torch's global generators from the OS, as a new process has them.

    A rank forked from the server would otherwise share the server's generator states with
    every other rank (python's ``random`` is reseeded at fork already).
    """
    import numpy as np
    import torch

    np.random.seed()
    torch.seed()


def gloo_setup(rank: int, world_size: int, init_file: str) -> None:
    """Joins the ranks' gloo process group through a file store (no ports)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )


def _worker(fn, rank, world_size, init_file, args, queue, setup):
    _fresh_generators()
    start = time.monotonic()
    try:
        try:
            setup(rank, world_size, init_file)
        except BaseException as exc:  # e.g. gloo's connectFullMesh: "Connection closed by peer"
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            queue.put(Outcome(rank, 1, error_type="SetupError", error=error, setup_failed=True))
            return
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


#: The pause before each try of a process group's set-up (its length is the number of tries).
SETUP_PAUSES_S = (0.0, 1.0, 3.0)
SETUP_TRIES = len(SETUP_PAUSES_S)
#: How long the other ranks have to report their own set-up errors once one rank's failed.
SETUP_REPORT_S = 5.0

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
    setup: Callable[[int, int, str], None] = gloo_setup,
) -> list[Outcome]:
    """Runs ``fn`` on ``world_size`` spawned ranks; kills them all after ``timeout_s``.

    ``until``: the ranks whose outcomes the test reads; once they all reported,
    the others (e.g. a rank made to stay stuck) are killed instead of awaited.
    A process group whose set-up fails on any rank (a passing fault of the machine's
    sockets) is set up again, every rank anew, after a pause, up to :data:`SETUP_TRIES`
    tries in all; then the test fails with every rank's set-up error and exit code (a
    rank's "Connection closed by peer" is its partner's failure: the partner's own error
    says why). ``setup(rank, world_size, init_file)``: how each rank joins its process
    group (:func:`gloo_setup`).
    """
    tries: list[list[Outcome]] = []
    for pause_s in SETUP_PAUSES_S:
        time.sleep(pause_s)
        outcomes = _run_ranks_once(fn, world_size, args, timeout_s, until, setup)
        if not any(o.setup_failed for o in outcomes):
            return outcomes
        tries.append(outcomes)
    pytest.fail(
        f"the gloo process group's set-up failed in all {len(tries)} tries:\n"
        + "\n".join(
            f"try {i + 1}, {_setup_report(o)}" for i, outcomes in enumerate(tries) for o in outcomes
        )
    )


def _setup_report(o: Outcome) -> str:
    """One rank's part in a failed set-up: its error, or how its process ended without one."""
    if o.setup_failed:
        return f"rank {o.rank}: {o.error}"
    if o.error_type is not None or o.value is not None:
        return f"rank {o.rank}: set up, then {o.error_type or 'returned'}: {o.error or o.value}"
    if o.killed:
        return f"rank {o.rank}: no report; still running {SETUP_REPORT_S:g} s later, killed"
    return f"rank {o.rank}: no report; the process ended with exit code {o.exitcode}"


def _run_ranks_once(
    fn: Callable,
    world_size: int,
    args: tuple,
    timeout_s: float,
    until: Collection[int] | None,
    setup: Callable[[int, int, str], None],
) -> list[Outcome]:
    """One try of :func:`run_ranks`; it ends early when a rank's set-up failed."""
    wanted = set(range(world_size) if until is None else until)
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, init_file, args, queue, setup))
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
                if o.setup_failed and deadline > time.monotonic() + SETUP_REPORT_S:
                    # The other ranks cannot pair up now; their own errors say why, if any.
                    deadline = time.monotonic() + SETUP_REPORT_S
                    wanted = set(range(world_size))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        killed = set()
        for rank, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()) if rank in wanted else 0)
            if p.is_alive():
                p.kill()
                p.join()
                killed.add(rank)
    return [
        outcomes.get(r, Outcome(r, procs[r].exitcode, killed=r in killed))
        for r in range(world_size)
    ]


def launcher_port() -> dict[str, str]:
    """``MASTER_PORT`` for a launcher that would pick its own with ``bind(0)``.

    Lightning's ``ddp`` and Composer's launcher take a port from the kernel's ephemeral
    range, release it, and bind it again in rank 0 later: meanwhile, with launches
    running side by side, another process's connection may take it. ``free_port`` picks
    below that range. A launcher that binds its own at once (``torchrun --standalone``)
    or is given one (``--master-port``) ignores the variable.
    """
    return {"MASTER_PORT": str(free_port())}


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
    env = job_env(PYTHONPATH=path, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **launcher_port())
    [ended] = finish([start(cmd, env=env, cwd=cwd)], timeout_s, after_exit)
    if ended.timed_out:
        name = Path(cmd[0]).name
        pytest.fail(f"{name} did not end within {timeout_s} s:\n{ended.stdout[-6000:]}")
    return Job(ended.returncode, ended.stdout, ended.ended_at)
