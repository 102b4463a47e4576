"""Predicted vs measured peak host memory of a full checkpoint save.

For models of ~50M, ~200M and ~500M parameters (fp32) with Adam after one
optimizer step, each measurement runs in a fresh subprocess:

1. build the model, run one step, drop the gradients;
2. reset the kernel's peak-RSS counter (``/proc/self/clear_refs``) and read
   the resident set size;
3. do what a full save of a GPU job does on the host: gather a consolidated
   copy of the model and optimizer state into fresh host tensors (as FSDP's
   ``offload_to_cpu`` full state dict does) and serialise it with
   ``torch.save`` to a temp file ("file", Composer) or through Lightning's
   ``_atomic_save`` (an ``io.BytesIO`` first, "buffer");
4. peak increase = ``VmHWM`` after the save minus the RSS before it.

The prediction is the planner's per-rank number, state bytes x
(1 consolidated copy + ``WRITER_OVERHEAD[writer]``). The "overhead" column is
the measured serialisation overhead as a multiple of the state bytes (what
``WRITER_OVERHEAD`` is set from).

Run: ``.venv/bin/python benchmarks/checkpoint_memory.py`` (about 2.5 minutes, ~13 GiB RAM).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

WIDTH = 2048  # a Linear(2048, 2048) layer holds 4.2M parameters
CASES = [(12, "file"), (12, "buffer"), (48, "file"), (119, "file")]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def child(layers: int, writer: str) -> dict:
    import torch

    from rankguard.callbacks.checkpoint.plan import WRITER_OVERHEAD
    from rankguard.callbacks.checkpoint.state_size import estimate_state_size

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    size = estimate_state_size(model, opt)
    predicted = size.total * (1 + WRITER_OVERHEAD[writer])
    if writer == "buffer":
        from lightning.fabric.utilities.cloud_io import _atomic_save
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed gradients to the OS first
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = _status_kib("VmRSS") * 1024
        started = time.perf_counter()
        state = {
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": {
                "state": {
                    i: {k: v.clone() for k, v in s.items()}
                    for i, s in opt.state_dict()["state"].items()
                },
                "param_groups": opt.state_dict()["param_groups"],
            },
        }
        copied = _status_kib("VmHWM") * 1024 - before
        if writer == "file":
            torch.save(state, path)
        else:
            _atomic_save(state, path)
        seconds = time.perf_counter() - started
        peak = _status_kib("VmHWM") * 1024 - before
        file_bytes = os.path.getsize(path)
    params = sum(p.numel() for p in model.parameters())
    return {
        "params": params,
        "writer": writer,
        "state": size.total,
        "file": file_bytes,
        "predicted": predicted,
        "measured": peak,
        "overhead": (peak - copied) / size.total,
        "seconds": seconds,
    }


def main() -> None:
    print(f"{'params':>8} {'writer':>6} {'state':>9} {'predicted':>10} {'measured':>10} "
          f"{'ratio':>6} {'overhead':>8} {'save s':>6}")  # fmt: skip
    started = time.perf_counter()
    for layers, writer in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(layers), writer],
            check=True,
            capture_output=True,
            text=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        gib = 1024**3
        print(
            f"{r['params'] / 1e6:7.0f}M {r['writer']:>6} {r['state'] / gib:7.2f}Gi "
            f"{r['predicted'] / gib:8.2f}Gi {r['measured'] / gib:8.2f}Gi "
            f"{r['measured'] / r['predicted']:6.2f} {r['overhead']:8.3f} {r['seconds']:6.1f}",
            flush=True,
        )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), sys.argv[3])))
    else:
        main()
