"""Overhead of the shared-directory barrier at 2 ranks on a local filesystem.

Measures, per rank (gloo, CPU), the median and worst wall time of:

* ``channel.barrier``: one side-channel exchange, the floor;
* ``ensure_shared_dirs`` when every rank already sees the directories (the
  every-checkpoint case: one exchange);
* ``ensure_shared_dirs`` on fresh directories: look, marker probe, create,
  wait and release (five exchanges, a marker write and removal, a mkdir);
* the same with each rank on its own simulated node (``NODE_RANK``), where
  the directories are node-local and every rank waits ``probe_wait_s``
  (0.2 s here) for a marker it will never see.

Twice: with the ranks launched by torchrun, whose rendezvous store (a
``TCPStore``, as under every launcher) carries the side channel, and with
``tests/mp.py``'s file store, which polls every 10 ms and so shows each
exchange's cost as a multiple of 10 ms.

Run: ``.venv/bin/python benchmarks/shared_dirs.py`` (about 20 s).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPEATS = 30


def _timed(fn, repeats):
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - started)
    return statistics.median(times), max(times)


def _bench(rank, world_size, base):
    from rankguard.callbacks.checkpoint.shared_dir_barrier import ensure_shared_dirs
    from rankguard.callbacks.core.side_channel import SideChannel

    channel = SideChannel.from_environment(timeout_s=30)
    existing = [os.path.join(base, "shared", "existing", d) for d in ("model", "optim", "train")]
    os.makedirs(existing[0], exist_ok=True)  # the others are created by the first call
    results = {"channel.barrier": _timed(lambda i: channel.barrier("b"), REPEATS)}
    ensure_shared_dirs(existing, channel)
    results["existing dirs (3)"] = _timed(lambda i: ensure_shared_dirs(existing, channel), REPEATS)

    def fresh(i):
        paths = [os.path.join(base, "shared", f"fresh{i}", d) for d in ("model", "optim", "train")]
        ensure_shared_dirs(paths, channel)

    results["fresh shared dirs (3)"] = _timed(fresh, REPEATS)
    os.environ["NODE_RANK"] = str(rank)
    node_root = os.path.join(base, f"node{rank}")
    os.makedirs(node_root, exist_ok=True)

    def local(i):
        paths = [os.path.join(node_root, f"fresh{i}", d) for d in ("model", "optim", "train")]
        ensure_shared_dirs(paths, channel, probe_wait_s=0.2)

    results["fresh node-local dirs (3)"] = _timed(local, 10)
    return results


def _torchrun_worker(base: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = _bench(rank, dist.get_world_size(), base)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _measure(store: str) -> list[dict]:
    from benchmarks.launch import launch_nodes
    from tests.mp import run_ranks

    with tempfile.TemporaryDirectory() as base, tempfile.TemporaryDirectory() as out:
        if store == "file":
            outcomes = run_ranks(_bench, 2, base, timeout_s=120)
            for o in outcomes:
                if o.error:
                    raise SystemExit(o.error)
            return [o.value for o in outcomes]
        args = ["--worker", base, out]
        results = launch_nodes(Path(__file__), args, nodes=1, per_node=2, timeout=120)
        if any(r.returncode for r in results):
            raise SystemExit(results[0].stderr[-3000:])
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    header = ("case (2 ranks, local ext4)", "store", "rank", "median ms", "max ms")
    print("{:<28} {:>5} {:>4} {:>10} {:>8}".format(*header))
    for store in ("tcp", "file"):
        per_rank = _measure(store)
        for case in per_rank[0]:
            for rank, values in enumerate(per_rank):
                median, worst = values[case]
                print(f"{case:<28} {store:>5} {rank:>4} {median * 1e3:10.2f} {worst * 1e3:8.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _torchrun_worker(sys.argv[2], sys.argv[3])
    else:
        main()
