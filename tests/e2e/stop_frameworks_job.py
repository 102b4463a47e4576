"""A preemption signal on rank 1 only, under Lightning ``ddp`` or the HF Trainer (CPU, gloo).

Run one process per rank, by a launcher or as one starts them (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; Lightning's
``devices`` and ``num_nodes`` follow them)::

    python stop_frameworks_job.py lightning|lightning_epoch|hf|hf_jit OUT self|launcher

The variants differ in who saves at the agreed step: ``lightning``'s ``ModelCheckpoint``
saves every 1000 steps (nothing of its own there: rankguard saves under its name),
``lightning_epoch``'s at each epoch's end (Lightning's own save, which ``should_stop``
reaches); ``hf`` saves every 1000 steps (``save_strategy="steps"``: the agreed step's
save), ``hf_jit`` never (``save_strategy="no"``) but has transformers 5's JIT checkpoint
on SIGTERM on, whose save rankguard's stop makes at the agreed step.

At the end of train step ``SIGNAL_AT`` rank 1 writes the time to ``OUT/signalled.json``
and, with ``self``, sends itself SIGTERM; with ``launcher`` the test sends SIGTERM to its
node's launcher once the file is there (one torchrun per node: node 0's is never
signalled). With ``RankGuard()`` at its defaults every rank's fit ends after
the same agreed step and the framework's own checkpoint is written there; after the fit
each rank writes ``OUT/rank{N}.json`` (the step it stopped after, the Unix time its
training loop ended, the checkpoint files); the process then exits with 75. Log lines
carry their Unix time, level and rank.

``RANKGUARD=off`` runs the same job without the ``RankGuard`` callback
(``benchmarks/preemption.py``): the same signal at the same step, the same
``ModelCheckpoint`` or saving arguments.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

SIGNAL_AT = 6
STEP_S = 0.05
STEPS = 600  # ~30 s of steps: the stop comes long before
RECORD: dict[str, Any] = {}


def _guard(module: str) -> list[Any]:
    """``[RankGuard()]`` from ``rankguard.integrations.<module>``; none with ``RANKGUARD=off``."""
    if os.environ.get("RANKGUARD") == "off":
        return []
    from importlib import import_module

    return [import_module(f"rankguard.integrations.{module}").RankGuard()]


def _signal(rank: int, step: int, out: Path, sender: str) -> None:
    """Rank 1, at ``SIGNAL_AT``: the scheduler's SIGTERM, on this rank only (or its node's).

    ``sender`` ``self``: this process sends it; ``launcher``: the test, to this node's launcher.
    """
    if rank == 1 and step == SIGNAL_AT and "signal_at" not in RECORD:
        RECORD["signal_at"] = time.time()
        (out / "signalled.json").write_text(json.dumps({"at": RECORD["signal_at"], "step": step}))
        if sender == "self":
            os.kill(os.getpid(), signal.SIGTERM)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)}
        for _ in range(STEPS * 4)
    ]


def lightning(rank: int, out: Path, variant: str, sender: str) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            time.sleep(STEP_S)
            return ((self.lin(batch["x"]).squeeze(-1) - batch["labels"]) ** 2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            _signal(rank, trainer.global_step, out, sender)

        def on_train_end(self, trainer, pl_module) -> None:
            RECORD["ended_at"] = time.time()

    if variant == "lightning_epoch":  # the defaults: a save at each epoch's end
        checkpoint = ModelCheckpoint(dirpath=str(out / "ckpt"))
    else:  # nothing of Lightning's own at the agreed step: rankguard saves under its name
        checkpoint = ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=1000)
    devices = int(os.environ["LOCAL_WORLD_SIZE"])  # the ranks of this node
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
        strategy="ddp",
        max_steps=STEPS,
        callbacks=[*_guard("lightning"), Record(), checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(_data(), batch_size=2))
    return {"step": trainer.global_step}


def hf(rank: int, out: Path, variant: str, sender: str) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback

    from tests.e2e.common import gloo_training_args

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            time.sleep(STEP_S)
            return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs) -> None:
            _signal(rank, state.global_step, out, sender)

        def on_train_end(self, args, state, control, **kwargs) -> None:
            RECORD["ended_at"] = time.time()

    saving: dict[str, Any] = {"save_strategy": "steps", "save_steps": 1000}  # none before
    if variant == "hf_jit":
        saving = {"save_strategy": "no", "enable_jit_checkpoint": True}
    args = gloo_training_args(
        out / "ckpt",
        max_steps=STEPS,
        per_device_train_batch_size=2,
        **saving,
        logging_steps=1000,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=Model(),
        args=args,
        train_dataset=_data(),
        callbacks=[*_guard("transformers"), Record()],
    )
    trainer.train()
    return {"step": trainer.state.global_step}


def main() -> None:
    framework, out, sender = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        format=f"%(created).3f [rank {rank}] %(levelname)s %(name)s: %(message)s", force=True
    )
    logging.getLogger("rankguard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    run = lightning if framework.startswith("lightning") else hf
    result = run(rank, out, framework, sender)
    result.update(RECORD, done_at=time.time())
    result["files"] = sorted(
        str(p.relative_to(out / "ckpt")) for p in (out / "ckpt").rglob("*") if p.is_file()
    )
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
