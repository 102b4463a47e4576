"""One framework's side of benchmarks/overhead.py: interleaved fits with and without RankGuard.

Composer: ``composer -n 2 overhead_job.py composer ROUNDS STEPS OUT``.
Lightning: ``python overhead_job.py lightning ROUNDS STEPS OUT`` (ddp re-launches rank 1).
A hand-written DDP loop and the Hugging Face Trainer:
``torchrun --standalone --nproc-per-node 2 overhead_job.py torch|transformers ROUNDS STEPS OUT``.
Rank 0 writes the wall time of every fit to OUT as JSON and, per guarded fit, the CPU time
rankguard took from it (see ``INSIDE``), and that of the floor: a fit of the same steps
with an empty callback of the framework (a loop: two calls a batch to methods that do
nothing) in rankguard's place, timed at the same entry points. With
``RANKGUARD_BENCH_PROFILE=DIR``, rank 0's training thread is profiled instead (cProfile;
``DIR/<framework>-with.prof``, ``-without``).
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


def composer_fit(mode: str, steps: int) -> float:
    from composer import Trainer
    from composer.core import Callback
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
        callbacks=_callbacks(mode, RankGuard, Callback),
    )
    start = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - start
    trainer.close()
    return elapsed


def lightning_fit(mode: str, steps: int) -> float:
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
        callbacks=_callbacks(mode, RankGuard, L.Callback),
    )
    loader = DataLoader(data(steps), batch_size=BATCH)
    start = time.perf_counter()
    trainer.fit(Module(), loader)
    return time.perf_counter() - start


def torch_fit(mode: str, steps: int) -> float:
    """A hand-written DDP loop; with: ``guard.fit`` around it, ``run.train`` on the loader.

    Floor: the loader wrapped by a generator that makes the two calls per batch
    ``run.train`` makes (before the loader's ``next``: the last batch's end and the
    fetch's start; after it: the fetch's end and the batch's start), to methods that
    do nothing.
    """
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
    if mode == "with":
        with RankGuard(**CONFIG).fit(model, optimizer, loader) as run:
            loop(run.train(loader))
    elif mode == "floor":
        loop(_floor_batches(loader))
    else:
        loop(loader)
    return time.perf_counter() - start


def transformers_fit(mode: str, steps: int) -> float:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

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
            callbacks=_callbacks(mode, RankGuard, TrainerCallback),
        )
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start


class FloorLoop:
    """The floor of a hand-written loop: the wrapped loader's two calls per batch, doing nothing.

    ``run.train`` calls the adapter before the loader's ``next`` (the last batch ends,
    a fetch starts) and after it (the fetch ends, the batch starts).
    """

    def fetch_start(self) -> None:
        """Does nothing."""

    def fetch_end_batch_start(self) -> None:
        """Does nothing."""


def _floor_batches(loader):
    floor = FloorLoop()
    iterator = iter(loader)
    while True:
        floor.fetch_start()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        floor.fetch_end_batch_start()
        yield batch


def _callbacks(mode: str, rank_guard, base: type) -> list:
    """The fit's callbacks: ``RankGuard()``, none, or the floor (an empty callback of ``base``)."""
    if mode == "with":
        return [rank_guard(**CONFIG)]
    if mode == "floor":
        return [FLOOR_CLASSES.setdefault(base, type("Floor", (base,), {}))()]
    return []


#: The floor's callback class per framework base class (one, so its methods are timed once).
FLOOR_CLASSES: dict[type, type] = {}

#: Per fit on this rank, CPU seconds inside rankguard (``adapter``: the adapter's per-step
#: entry points, dispatch and guards included, fit start and end left out; ``hooks``: the
#: straggler monitor's forward hooks, which run inside the model's forward), each with
#: the timer's own cost in them (``*_timer``, subtracted), on the training thread;
#: ``background``: CPU seconds of rankguard's own threads (``steady``: per batch, from a
#: third of the fit to its end, read by :class:`SteadySampler`).
INSIDE = {
    "adapter": 0.0,
    "adapter_timer": 0.0,
    "hooks": 0.0,
    "hooks_timer": 0.0,
    "background": 0.0,
    "floor": 0.0,
    "floor_timer": 0.0,
}
#: RankGuard's settings (``overhead.py --config``); all guards with defaults if unset.
CONFIG = json.loads(os.environ.get("RANKGUARD_BENCH_CONFIG") or "{}")
#: Where the framework enters each adapter during the steps: (module, class, methods
#: timed). Fit start and end (checks, the guards' close) are left out.
ENTRY_POINTS = {
    "composer": ("rankguard.integrations.composer.adapter", "_ComposerAdapter", ("run_event",)),
    "lightning": (
        "rankguard.integrations.lightning.adapter",
        "_LightningAdapter",
        ("on_train_epoch_start", "on_train_batch_start", "on_train_batch_end"),
    ),
    "torch": (
        "rankguard.integrations._driver",
        "EventDriver",
        (
            "epoch_start",
            "fetch_start",
            "fetch_end",
            "fetch_end_batch_start",
            "train_batch_start",
            "end_train_batch",
        ),
    ),
    "transformers": (
        "rankguard.integrations.transformers.adapter",
        "_TrainerAdapter",
        ("on_epoch_begin", "on_step_begin", "on_step_end", "on_log", "on_epoch_end"),
    ),
}
#: Calls of hooked modules in the fit (each takes PyTorch's slower path for hooked modules).
HOOK_CALLS = [0]
#: rankguard's guard runners, as they are made (the last is the fit's).
RUNNERS: list = []
#: rankguard's threads are named ``rankguard-<guard>``.
THREAD_PREFIX = "rankguard-"


def _fit_boundary(args: tuple) -> bool:
    """Composer's run_event(event, ...) at fit start or end."""
    from composer.core import Event

    return len(args) > 1 and args[1] in (Event.FIT_START, Event.FIT_END)


def _timed(method, key: str, depth: list[int], skip=None):
    """``method`` with the training thread's CPU time inside it added to ``INSIDE[key]``.

    CPU time of the thread (``time.thread_time``): what a call costs the training loop,
    robust to other processes taking the cores in the middle of it (wall time is not).
    Reading that clock costs about a microsecond, more in a real fit than in a tight
    loop, and one reading's worth falls inside each measure: right after each measure,
    the wrapper times an empty span the same way and adds it to ``INSIDE[key + "_timer"]``,
    which is subtracted.
    """
    timer = f"{key}_timer"

    def timed(*args, **kwargs):
        if skip is not None and skip(args):
            return method(*args, **kwargs)
        depth[0] += 1
        start = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            end = time.thread_time()
            depth[0] -= 1
            if depth[0] == 0:  # nested entry points count once
                INSIDE[key] += end - start
                empty = time.thread_time()
                INSIDE[timer] += time.thread_time() - empty

    return timed


def hook_dispatch_s(calls: int = 20000) -> float:
    """CPU seconds a module call costs more in PyTorch when it has forward hooks (no-op ones).

    ``torch.nn.Module.__call__`` takes a slower path for a module with hooks; that
    cost is the straggler monitor's, but it runs in PyTorch, outside the hooks timed.
    """
    import torch

    module, x = torch.nn.Identity(), torch.zeros(1)

    def loop() -> float:
        start = time.thread_time()
        for _ in range(calls):
            module(x)
        return (time.thread_time() - start) / calls

    bare = min(loop() for _ in range(5))
    module.register_forward_pre_hook(lambda m, a: None)
    module.register_forward_hook(lambda m, a, o: None, always_call=True)
    return max(0.0, min(loop() for _ in range(5)) - bare)


def count_rankguard_threads() -> None:
    """Adds the CPU time of each ``rankguard-*`` thread to ``INSIDE["background"]`` as it ends.

    Read in the thread itself (``time.thread_time``) when its ``run`` returns: a
    per-thread clock, which other threads and processes do not inflate.
    """
    import threading

    run = threading.Thread.run

    def counted_run(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            if self.name.startswith(THREAD_PREFIX):
                INSIDE["background"] += time.thread_time()

    threading.Thread.run = counted_run


class SteadySampler:
    """Reads rankguard's CPU clocks from a thread of its own, past a third of the fit.

    Every ``period_s`` it reads the train batches the fit's step log has started,
    each ``rankguard-*`` thread's CPU clock (``time.pthread_getcpuclockid``) and what
    the training thread has spent inside rankguard so far (``INSIDE``): the first
    reading past ``steps // 3`` batches and the last before the fit ends give the CPU
    per batch in the steady state, without the fit's one-off costs (thread start,
    store connections, the first exchanges, the last ones at fit end; on the training
    thread, the first batches' wakes of the watchdog, the straggler monitor's warm-up,
    the first interval's exchange). Its own thread is not rankguard's: not counted.
    """

    def __init__(self, steps: int, period_s: float = 0.02) -> None:
        import threading

        self.steps, self.period_s = steps, period_s
        self.first: tuple[int, dict[int, float]] | None = None
        self.last: tuple[int, dict[int, float]] | None = None
        self.names: dict[int, str] = {}  # thread ident: its name, less the prefix
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def _read(self) -> tuple[int, dict[int, float], tuple[float, float, int]] | None:
        import threading

        runner = RUNNERS[-1] if RUNNERS else None
        if runner is None:
            return None
        batches = runner.steps.batches
        inside = spent_inside()
        clocks = {}
        for thread in threading.enumerate():
            if thread.name.startswith(THREAD_PREFIX) and thread.ident is not None:
                try:
                    clocks[thread.ident] = time.clock_gettime(
                        time.pthread_getcpuclockid(thread.ident)
                    )
                except OSError:  # ended meanwhile
                    continue
                self.names[thread.ident] = thread.name[len(THREAD_PREFIX) :]
        return batches, clocks, inside

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            reading = self._read()
            if reading is None or reading[0] < self.steps // 3 or reading[0] >= self.steps:
                continue
            if self.first is None:
                self.first = reading
            self.last = reading

    def _window(self) -> tuple[tuple, tuple] | None:
        """The first and last readings, if they span some batches."""
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return self.first, self.last

    def per_batch_s(self) -> dict[str, float] | None:
        """CPU seconds per train batch of each of rankguard's threads (by name), between the
        two readings."""
        self._stop.set()
        self._thread.join()
        window = self._window()
        if window is None:
            return None
        (b0, c0, _), (b1, c1, _) = window
        spent: dict[str, float] = {}
        for ident, cpu in c1.items():
            name = self.names[ident]
            spent[name] = spent.get(name, 0.0) + (cpu - c0.get(ident, 0.0)) / (b1 - b0)
        return spent

    def train_per_batch(self) -> dict[str, float] | None:
        """The training thread's figures (``adapter``, ``hooks`` in seconds, ``hook_calls``)
        per train batch between the two readings: rankguard's steady state, as in a long fit.

        Call after :meth:`per_batch_s` (which stops the sampler).
        """
        window = self._window()
        if window is None:
            return None
        (b0, _, i0), (b1, _, i1) = window
        keys = ("adapter", "hooks", "hook_calls")
        return {
            key: (after - before) / (b1 - b0)
            for key, before, after in zip(keys, i0, i1, strict=True)
        }


def spent_inside() -> tuple[float, float, int]:
    """What the training thread has spent inside rankguard so far (see ``INSIDE``): the
    adapter's and the hooks' CPU seconds, less the clock's own cost, and the hooked calls."""
    return (
        INSIDE["adapter"] - INSIDE["adapter_timer"],
        INSIDE["hooks"] - INSIDE["hooks_timer"],
        HOOK_CALLS[0],
    )


def track_runners() -> None:
    """Keeps each rankguard ``GuardRunner`` made (in ``RUNNERS``): the sampler reads its log."""
    from rankguard.callbacks.core.guard import GuardRunner

    init = GuardRunner.__init__

    def tracked(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if len(self.guards) > 1:  # RankGuard's runner, not a guard's own solo one
            RUNNERS.append(self)

    GuardRunner.__init__ = tracked


def join_rankguard_threads(timeout_s: float = 10.0) -> None:
    """Waits for rankguard's threads of the fit that ended (closed, finishing their last job)."""
    import threading

    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name.startswith(THREAD_PREFIX):
            thread.join(max(0.0, deadline - time.monotonic()))


def time_rankguard(framework: str) -> None:
    """Accumulates the CPU time spent inside rankguard on this rank (see INSIDE)."""
    import importlib

    from rankguard.callbacks.straggler.forward_clock import ForwardClock

    # Bound as hooks when a fit starts, so timing the methods here times the hooks.
    enter = _timed(ForwardClock._enter, "hooks", [0])

    def counted_enter(*args):
        HOOK_CALLS[0] += 1  # hooked module calls: PyTorch's slower path, once each
        return enter(*args)

    ForwardClock._enter = counted_enter
    ForwardClock._leave = _timed(ForwardClock._leave, "hooks", [0])
    module, name, methods = ENTRY_POINTS[framework]
    cls = getattr(importlib.import_module(module), name)
    depth = [0]
    skip = _fit_boundary if framework == "composer" else None
    for method in methods:
        if hasattr(cls, method):  # an older adapter may lack one
            setattr(cls, method, _timed(getattr(cls, method), "adapter", depth, skip))
    floor = floor_class(framework)
    for method in methods:
        if hasattr(floor, method):  # the loop's floor has no epoch start (once an epoch)
            setattr(floor, method, _timed(getattr(floor, method), "floor", [0], skip))
    count_rankguard_threads()


def floor_class(framework: str) -> type:
    """The floor's class: an empty callback of the framework, or :class:`FloorLoop`."""
    if framework == "torch":
        return FloorLoop
    if framework == "composer":
        from composer.core import Callback as base
    elif framework == "lightning":
        from lightning import Callback as base
    else:
        from transformers import TrainerCallback as base
    return FLOOR_CLASSES.setdefault(base, type("Floor", (base,), {}))


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (known before the process group exists)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def profiled(fit, mode: str, steps: int, path: str) -> float:
    """Runs ``fit`` under cProfile (this thread only) and writes its stats to ``path``."""
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        return fit(mode, steps)
    finally:
        profile.disable()
        profile.dump_stats(path)


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
    fit("without", 5)  # warm-up: imports, process group, allocator
    profile_dir = os.environ.get("RANKGUARD_BENCH_PROFILE")
    if not profile_dir:  # a profile times every call its own way
        time_rankguard(framework)
        track_runners()
    times: dict[str, list[float]] = {"without": [], "with": []}
    for key in (
        "adapter",
        "hooks",
        "background",
        "steady",
        "steady_train",
        "hook_calls",
        "floor",
        "floor_s",
    ):
        times[key] = []
    for i in range(2 * rounds):
        mode = "with" if i % 2 == (i // 2) % 2 else "without"  # ABBA order cancels drift
        INSIDE.update(dict.fromkeys(INSIDE, 0.0))
        HOOK_CALLS[0] = 0
        sampler = SteadySampler(steps) if mode == "with" and not profile_dir else None
        if profile_dir and is_rank_zero():
            elapsed = profiled(fit, mode, steps, f"{profile_dir}/{framework}-{mode}.prof")
        else:
            elapsed = fit(mode, steps)
        times[mode].append(elapsed)
        if mode == "with":
            steady = sampler.per_batch_s() if sampler is not None else None
            if steady is not None:
                times["steady"].append(steady)
                times["steady_train"].append(sampler.train_per_batch())
            join_rankguard_threads()
            adapter, hooks, hook_calls = spent_inside()
            times["adapter"].append(adapter)
            times["hooks"].append(hooks)
            times["hook_calls"].append(hook_calls)
            times["background"].append(INSIDE["background"])
            if not profile_dir:  # the floor: an empty callback at the same entry points
                times["floor_s"].append(fit("floor", steps))
                times["floor"].append(INSIDE["floor"] - INSIDE["floor_timer"])
    times["hook_dispatch_s"] = [hook_dispatch_s()]

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"framework": framework, "steps": steps, **times}, f)


if __name__ == "__main__":
    main()
