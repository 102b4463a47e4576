"""Predicted vs measured host memory of a real FSDP2 full save, 2 ranks on CPU (gloo).

A ~100M-parameter fp32 model is sharded with ``fully_shard`` over 2 ranks,
trained one Adam step, then a full (consolidated) state dict is gathered
with ``get_state_dict(..., full_state_dict=True, cpu_offload=True)`` and
rank 0 writes it with ``torch.save``. Per rank, the peak RSS increase of the
save (``VmHWM`` after a reset) is compared with what
:class:`~rankguard.callbacks.checkpoint.checkpoint_planner.CheckpointPlanner` predicts
from :func:`~rankguard.callbacks.checkpoint.state_size.estimate_state_size` of the
sharded model (``materialize="rank0"``, ``writer="file"``): the whole state
on rank 0, nothing on rank 1.

Run: ``.venv/bin/python benchmarks/checkpoint_memory_fsdp.py`` (about 40 s, ~4 GiB RAM).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTH, LAYERS = 2048, 24  # 24 x 4.2M = 101M parameters


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _save(rank, world_size, folder):
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from rankguard.callbacks.checkpoint.plan import RankMemory, plan_save
    from rankguard.callbacks.checkpoint.state_size import estimate_state_size

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    size = estimate_state_size(model, opt)
    mine = RankMemory("node", rank, size.total, size.sharded, None, "-", size.largest)
    plan = plan_save({r: mine for r in range(world_size)})
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _kib("VmRSS") * 1024
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, opt, options=options)
    if rank == 0:
        torch.save({"model": model_state, "optim": optim_state}, os.path.join(folder, "c.pt"))
    return {
        "state": size.total,
        "sharded": size.sharded,
        "predicted": plan.nodes[0].full_bytes if rank == 0 else 0,
        "measured": _kib("VmHWM") * 1024 - before,
    }


def main() -> None:
    from tests.mp import run_ranks

    with tempfile.TemporaryDirectory() as folder:
        outcomes = run_ranks(_save, 2, folder, timeout_s=240)
    gib = 1024**3
    print(f"{'rank':>4} {'state':>8} {'sharded':>7} {'predicted':>10} {'measured':>9}")
    for o in outcomes:
        if o.error:
            raise SystemExit(o.error)
        r = o.value
        print(
            f"{o.rank:>4} {r['state'] / gib:6.2f}Gi {r['sharded']!s:>7} "
            f"{r['predicted'] / gib:8.2f}Gi {r['measured'] / gib:7.2f}Gi"
        )


if __name__ == "__main__":
    main()
