"""A multi-process harness that cannot hang the suite.

``run_ranks(fn, world_size)`` starts one process per rank, joins a gloo
process group through a file store (no ports), runs ``fn(rank, world_size,
*args)`` and returns each rank's outcome. Every run has a hard timeout after
which the remaining processes are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    error_attrs: dict | None = None
    elapsed_s: float | None = None


def _worker(fn, rank, world_size, init_file, args, queue):
    import torch.distributed as dist

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


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 60.0) -> list[Outcome]:
    """Runs ``fn`` on ``world_size`` spawned ranks; kills them all after ``timeout_s``."""
    ctx = mp.get_context("spawn")
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
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                o = queue.get(timeout=0.2)
                outcomes[o.rank] = o
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return [outcomes.get(r, Outcome(r, procs[r].exitcode)) for r in range(world_size)]
