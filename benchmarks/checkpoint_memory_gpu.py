"""Predicted vs measured host memory of real GPU checkpoint saves (needs one CUDA GPU).

Two saves of a ~500M-parameter fp32 model with Adam, after one step, each in
a fresh subprocess, peak host RSS increase measured with ``VmHWM``:

* ``ddp``: an unsharded CUDA model, ``torch.save`` of model + optimizer
  state dicts to a file. torch copies one storage at a time to the host, so
  the planner predicts (almost) nothing.
* ``fsdp``: the same model wrapped in FSDP (world size 1, NCCL), a full
  state dict with ``offload_to_cpu=True, rank0_only=True`` (what Composer and
  Lightning do for a full save), then ``torch.save`` to a file. The planner
  predicts one consolidated host copy of the whole state.

Measured on one H100 (torch 2.11, the child's code run inline)::

     save    state  predicted  measured
      ddp   5.63Gi     0.06Gi    0.06Gi   (one 64 MiB storage at a time)
     fsdp   5.63Gi     5.63Gi    3.81Gi   (at world size 1 FSDP leaves the
                                            model state on the GPU and
                                            offloads only optimizer state)

Rerun on one H200 (torch 2.11, 2026-11-24): the same four figures.

At world size > 1 FSDP offloads the gathered model state too; that case
needs two GPUs and is not measured here.

Run: ``python benchmarks/checkpoint_memory_gpu.py`` (about 1 minute).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WIDTH, LAYERS = 4096, 30  # 30 x 16.8M = 503M parameters


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(kind: str) -> dict:
    import torch
    import torch.distributed as dist

    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).cuda()
    if kind == "fsdp":
        from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullStateDictConfig as FullConfig
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        init = tempfile.mkdtemp()
        dist.init_process_group("nccl", init_method=f"file://{init}/init", rank=0, world_size=1)
        model = FSDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    tensors = list(model.parameters()) + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with tempfile.TemporaryDirectory() as tmp:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = _kib("VmRSS") * 1024
        if kind == "fsdp":
            model_cfg = FullConfig(offload_to_cpu=True, rank0_only=True)
            optim_cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, model_cfg, optim_cfg):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        else:
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
        torch.save(state, os.path.join(tmp, "ckpt.pt"))
        peak = _kib("VmHWM") * 1024 - before
    return {
        "kind": kind,
        "state": sum(t.numel() * t.element_size() for t in tensors),
        "largest": max(t.numel() * t.element_size() for t in tensors),
        "measured": peak,
    }


def main() -> None:
    from rankguard.callbacks.checkpoint.plan import RankMemory, plan_save

    gib = 1024**3
    print(f"{'save':>5} {'state':>8} {'predicted':>10} {'measured':>9}")
    for kind in ("ddp", "fsdp"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", kind], check=True, capture_output=True, text=True
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        mine = RankMemory("gpu", 0, r["state"], r["kind"] == "fsdp", None, "-", r["largest"])
        r["predicted"] = plan_save({0: mine}).nodes[0].full_bytes
        print(
            f"{r['kind']:>5} {r['state'] / gib:6.2f}Gi {r['predicted'] / gib:8.2f}Gi "
            f"{r['measured'] / gib:7.2f}Gi",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main()
