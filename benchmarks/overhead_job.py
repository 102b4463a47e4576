"""One framework's side of benchmarks/overhead.py: interleaved fits with and without RankGuard.

Composer: ``composer -n 2 overhead_job.py composer ROUNDS STEPS OUT``.
Lightning: ``python overhead_job.py lightning ROUNDS STEPS OUT`` (ddp re-launches rank 1).
A hand-written DDP loop and the Hugging Face Trainer:
``torchrun --standalone --nproc-per-node 2 overhead_job.py torch|transformers ROUNDS STEPS OUT``.
Rank 0 writes the wall time of every fit to OUT as JSON, with the time spent inside
rankguard: in its event dispatch, and in the adapter's entry points (which include the
dispatch and the adapter's own translation; not the guards' close at the end of a fit).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

WIDTH = 512
BATCH = 64


def data(steps: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH * 2, WIDTH, generator=gen)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, 2)
    )


def composer_fit(guarded: bool, steps: int) -> float:
    from composer import Trainer
    from composer.models import ComposerClassifier
    from composer.utils import dist

    from rankguard.integrations.composer import RankGuard

    dataset = data(steps)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=dist.get_sampler(dataset))
    trainer = Trainer(
        model=ComposerClassifier(mlp(), num_classes=2),
        train_dataloader=loader,
        max_duration=f"{steps}ba",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        loggers=[],
        callbacks=[RankGuard(**CONFIG)] if guarded else [],
    )
    start = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - start
    trainer.close()
    return elapsed


def lightning_fit(guarded: bool, steps: int) -> float:
    import lightning as L

    from rankguard.integrations.lightning import RankGuard

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RankGuard(**CONFIG)] if guarded else [],
    )
    loader = DataLoader(data(steps), batch_size=BATCH)
    start = time.perf_counter()
    trainer.fit(Module(), loader)
    return time.perf_counter() - start


def torch_fit(guarded: bool, steps: int) -> float:
    """A hand-written DDP loop; guarded: ``guard.fit`` around it, ``run.train`` on the loader."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    from rankguard.integrations.torch import RankGuard

    dataset = data(steps)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset))
    model = DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def loop(batches) -> None:
        for x, y in batches:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    start = time.perf_counter()
    if guarded:
        with RankGuard(**CONFIG).fit(model, optimizer, loader) as run:
            loop(run.train(loader))
    else:
        loop(loader)
    return time.perf_counter() - start


def transformers_fit(guarded: bool, steps: int) -> float:
    import tempfile

    from transformers import Trainer, TrainingArguments

    from rankguard.integrations.transformers import RankGuard

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    def collate(rows):
        return {"x": torch.stack([r[0] for r in rows]), "labels": torch.stack([r[1] for r in rows])}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            use_cpu=True,
            ddp_backend="gloo",
            ddp_find_unused_parameters=False,
            per_device_train_batch_size=BATCH,
            max_steps=steps,
            learning_rate=0.01,
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=Classifier(),
            args=args,
            train_dataset=data(steps),
            data_collator=collate,
            callbacks=[RankGuard(**CONFIG)] if guarded else [],
        )
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start


#: Per fit, seconds inside rankguard: its event dispatch (everything, wall time), the
#: adapter's per-step entry points (dispatch and translation, without fit start and end;
#: CPU time of the training thread), and the straggler monitor's forward hooks (CPU time
#: of the training thread; they run inside the model's forward, not in a dispatch).
RANKGUARD_S = {"dispatch": 0.0, "adapter": 0.0, "hooks": 0.0}
#: RankGuard's settings (``overhead.py --config``); all guards with defaults if unset.
CONFIG = json.loads(os.environ.get("RANKGUARD_BENCH_CONFIG") or "{}")
#: Where the framework enters each adapter during the steps: (module, class, methods
#: timed). Fit start and end (checks, the guards' close) are left out.
ENTRY_POINTS = {
    "composer": ("rankguard.integrations.composer", "_ComposerAdapter", ("run_event",)),
    "lightning": (
        "rankguard.integrations.lightning",
        "_LightningAdapter",
        ("on_train_epoch_start", "on_train_batch_start", "on_train_batch_end"),
    ),
    "torch": (
        "rankguard.integrations._driver",
        "EventDriver",
        ("epoch_start", "fetch_start", "fetch_end", "train_batch_start", "end_train_batch"),
    ),
    "transformers": (
        "rankguard.integrations.transformers",
        "_TrainerAdapter",
        ("on_epoch_begin", "on_step_begin", "on_step_end", "on_log", "on_epoch_end"),
    ),
}


def _fit_boundary(args: tuple) -> bool:
    """Composer's run_event(event, ...) at fit start or end."""
    from composer.core import Event

    return len(args) > 1 and args[1] in (Event.FIT_START, Event.FIT_END)


def _timed(method, key: str, depth: list[int], skip=None, clock=time.perf_counter):
    def timed(*args, **kwargs):
        if skip is not None and skip(args):
            return method(*args, **kwargs)
        depth[0] += 1
        start = clock()
        try:
            return method(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:  # nested entry points count once
                RANKGUARD_S[key] += clock() - start

    return timed


def time_rankguard(framework: str) -> None:
    """Accumulates the time spent inside rankguard on this rank (see RANKGUARD_S)."""
    import importlib

    from rankguard.callbacks.forward_clock import ForwardClock
    from rankguard.callbacks.guard import GuardRunner

    GuardRunner.fire = _timed(GuardRunner.fire, "dispatch", [0])
    # Bound as hooks when a fit starts, so timing the methods here times the hooks.
    ForwardClock._enter = _timed(ForwardClock._enter, "hooks", [0], clock=time.thread_time)
    ForwardClock._leave = _timed(ForwardClock._leave, "hooks", [0], clock=time.thread_time)
    module, name, methods = ENTRY_POINTS[framework]
    cls = getattr(importlib.import_module(module), name)
    depth = [0]
    skip = _fit_boundary if framework == "composer" else None
    for method in methods:
        # CPU time of the training thread: what the hooks cost it, robust to other processes
        # taking the cores in the middle of a hook (wall time is, on a shared machine, not).
        timed = _timed(getattr(cls, method), "adapter", depth, skip, time.thread_time)
        setattr(cls, method, timed)


def main() -> None:
    framework, rounds, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)  # two ranks share this machine's cores
    import torch.distributed as dist

    if framework == "torch":
        dist.init_process_group("gloo")
    fit = {
        "composer": composer_fit,
        "lightning": lightning_fit,
        "torch": torch_fit,
        "transformers": transformers_fit,
    }[framework]
    fit(False, 5)  # warm-up: imports, process group, allocator
    time_rankguard(framework)
    times: dict[str, list[float]] = {"without": [], "with": [], "inside_rankguard": []}
    times["inside_adapter"], times["inside_hooks"] = [], []
    for i in range(2 * rounds):
        guarded = i % 2 == (i // 2) % 2  # ABBA order cancels drift
        RANKGUARD_S.update(dispatch=0.0, adapter=0.0, hooks=0.0)
        times["with" if guarded else "without"].append(fit(guarded, steps))
        if guarded:
            times["inside_rankguard"].append(RANKGUARD_S["dispatch"])
            times["inside_adapter"].append(RANKGUARD_S["adapter"])
            times["inside_hooks"].append(RANKGUARD_S["hooks"])

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"framework": framework, "steps": steps, **times}, f)


if __name__ == "__main__":
    main()
