"""What one ReplicaGuard check costs a rank, measured here and computed for a 1B model on a GPU.

Run: ``python benchmarks/replica_check.py [--device cuda] [--params 1e9] [--width 2048]
[--dtype bf16]``.

A check reduces each parameter to the sum of its bits (``replica/prints.py::launch``):
one reduction kernel per tensor, reading every byte once, so its device time is the
model's bytes over the device's memory bandwidth. The script builds a model-shaped
set of tensors (a Llama-style layer's 9 tensors per layer, plus the embeddings) of
``--params`` parameters on ``--device`` and measures, over several checks:

* **launch**: what the training thread spends in ``launch()`` (on a GPU the kernel
  launches alone; on the CPU, where the CPU is the device, the whole reduction);
* **device**: the reductions' own time (CUDA events on a GPU; on the CPU the same as
  launch), and the bandwidth they reach (bytes read / device time);
* **reference**: a plain ``torch.sum`` over the same tensors, the bandwidth any
  reduction reaches on this device, to show the check is bandwidth-bound;
* **read back**: the exchange thread's wait and read of the sums (``Launched.sums``).

Then it computes a check's device time for 1B parameters (bf16: 2 GB) at the
bandwidth measured here, and at the bandwidth GPUs reach (about 90% of their data
sheet's: A100 80GB 2.04 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s). Without a GPU
those figures are computed, not measured: run it with ``--device cuda`` on one.

``--fit STEPS`` measures the guard in a fit instead: 2 gloo ranks train
``benchmarks/overhead_job.py``'s model (DDP, SGD) for ``STEPS`` steps with
``ReplicaGuard()`` at its defaults, and rank 0 prints the CPU time the guard's
handlers took from its training thread (``time.thread_time``), per step and per
check, and how many checks ran: what the default interval makes a check cost a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rankguard.callbacks.replica.layout import ReplicaSet, set_key
from rankguard.callbacks.replica.prints import launch

#: Data-sheet HBM bandwidth (TB/s) of GPUs a 1B model trains on, and the share of it a
#: streaming reduction reaches.
GPUS = {"A100 80GB": 2.04, "H100 SXM": 3.35, "H200": 4.8}
ACHIEVED = 0.9
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model_tensors(
    params: float, dtype: torch.dtype, device: str, width: int = 2048
) -> list[torch.Tensor]:
    """Tensors shaped like a Llama-style model of about ``params`` parameters."""
    vocab = 32000
    per_layer = 4 * width * width + 3 * width * int(2.6875 * width) + 2 * width
    layers = max(1, round((params - 2 * vocab * width) / per_layer))
    shapes = [(vocab, width), (vocab, width), (width,)]
    for _ in range(layers):
        shapes += [(width, width)] * 4 + [(int(2.6875 * width), width)] * 3 + [(width,)] * 2
    return [torch.randn(shape, device=device).to(dtype) for shape in shapes]


def timed(fn, device: str, repeats: int) -> tuple[float, float]:
    """Median host seconds of ``fn()``, and its median device seconds (CUDA events)."""
    host, dev = [], []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        host.append(time.perf_counter() - t0)
        if device == "cuda":
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
        del out
    return statistics.median(host), statistics.median(dev) if dev else statistics.median(host)


def _fit_rank(rank: int, init: str, steps: int, out: dict) -> None:
    """One rank of ``--fit``: the overhead benchmark's loop, the guard's handlers timed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.overhead_job import BATCH, WIDTH, mlp
    from rankguard.integrations.torch import ReplicaGuard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    model = DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 2, (BATCH,)))] * steps
    guard = ReplicaGuard()
    (core,) = guard.runner.guards
    spent = {"s": 0.0, "checks": 0}
    on_due, post = core.on_due, core._post

    def timed_on_due(batches: int) -> None:
        start = time.thread_time()
        try:
            on_due(batches)
        finally:
            spent["s"] += time.thread_time() - start

    def counted_post(*args: object, **kwargs: object) -> None:
        spent["checks"] += 1
        post(*args, **kwargs)

    core.on_due, core._post = timed_on_due, counted_post
    with guard.fit(model, optimizer, data) as run:
        for x, y in run.train(data):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    if rank == 0:
        out.update(spent)
    dist.destroy_process_group()


def _mlp() -> torch.nn.Module:
    from benchmarks.overhead_job import mlp

    return mlp()


def fit_cost(steps: int) -> None:
    """``--fit``: the guard's training-thread CPU time in a 2-rank fit at its defaults."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_fit_rank, args=(f"{tmp}/init", steps, out), nprocs=2)
        spent, checks = out["s"], out["checks"]
    print(
        f"ReplicaGuard() in a {steps}-step 2-rank DDP fit (overhead_job's model, "
        f"{sum(p.numel() for p in _mlp().parameters()) / 1e6:.2f}M parameters): {checks} checks, "
        f"{1e3 * spent:.1f} ms of the training thread's CPU in its handlers: "
        f"{1e6 * spent / steps:.2f} us a step, {1e3 * spent / max(checks, 1):.2f} ms a check"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--width", type=int, default=2048, help="the model's hidden size")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fit", type=int, metavar="STEPS", help="measure the guard in a fit")
    args = parser.parse_args()
    if args.fit:
        fit_cost(args.fit)
        return
    dtype = DTYPES[args.dtype]
    tensors = model_tensors(args.params, dtype, args.device, args.width)
    count = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sets = [ReplicaSet((0, 1), set_key((0, 1)), "ddp", "DDP", [""] * len(tensors), tensors)]
    launch(sets).sums()  # warm up: allocators, pinned memory, kernels
    launch_s, device_s = timed(lambda: launch(sets), args.device, args.repeats)
    launched = [launch(sets) for _ in range(args.repeats)]
    start = time.perf_counter()
    for one in launched:
        one.sums()
    read_s = (time.perf_counter() - start) / args.repeats

    def plain() -> list[torch.Tensor]:
        with torch.no_grad():
            return [t.sum() for t in tensors]

    _, reference_s = timed(plain, args.device, args.repeats)
    bandwidth = nbytes / device_s
    print(
        f"{count / 1e6:.0f}M parameters ({args.dtype}, {nbytes / 2**30:.2f} GiB) in "
        f"{len(tensors)} tensors on {args.device}"
    )
    print(f"  launch (training thread): {1e3 * launch_s:8.2f} ms")
    print(f"  device:                   {1e3 * device_s:8.2f} ms  ({bandwidth / 1e9:.1f} GB/s)")
    print(
        f"  reference torch.sum:      {1e3 * reference_s:8.2f} ms  "
        f"({nbytes / reference_s / 1e9:.1f} GB/s)"
    )
    print(f"  read back (exchange thread, after the device): {1e3 * read_s:.3f} ms")
    one_b = 1e9 * 2  # bytes of 1B bf16 parameters
    print("1B parameters (bf16, 2 GB), device time per check, computed as bytes / bandwidth:")
    here = f"({bandwidth / 1e9:.1f} GB/s)"
    print(f"  at the bandwidth measured here {here}: {1e3 * one_b / bandwidth:.1f} ms")
    for name, tbs in GPUS.items():
        achieved = tbs * 1e12 * ACHIEVED
        print(
            f"  {name:<10} ({tbs} TB/s data sheet, {ACHIEVED:.0%} reached): "
            f"{1e3 * one_b / achieved:.2f} ms"
        )


if __name__ == "__main__":
    main()
