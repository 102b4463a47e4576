"""Tiny data, a per-rank outcome recorder and a lagging shared folder for the end-to-end jobs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

from rankguard.callbacks.checkpoint.dir_probe import MARKER_PREFIX
from rankguard.callbacks.core.guard import PER_STEP, RAISED, Guard
from rankguard.callbacks.core.step_log import expand


@contextmanager
def own_node(rank: int, disk: Path) -> Iterator[Path]:
    """This rank plays a node of its own whose local disk is ``disk`` (made here).

    rankguard tells nodes apart by ``NODE_RANK``; it is restored on exit.
    """
    previous = os.environ.get("NODE_RANK")
    os.environ["NODE_RANK"] = str(rank)
    try:
        disk.mkdir()  # a disk is there before the job
        yield disk
    finally:
        if previous is None:
            del os.environ["NODE_RANK"]
        else:
            os.environ["NODE_RANK"] = previous


class Mirror(threading.Thread):
    """Shows one view of a shared folder in another, as a lagging NFS client would.

    Each pair is ``(src, dst, lag)``: marker files (fresh names, which a real NFS
    client looks up on the server at once) are copied at once, directories only
    after ``lag`` seconds, or ``lag(path relative to src)`` (``math.inf``: never),
    as NFS shows a directory that a polling client has already cached as missing;
    never before its parent. Other files are not copied.
    """

    def __init__(self, pairs: list[tuple[str, str, float | Callable[[str], float]]]) -> None:
        super().__init__(daemon=True)
        self.pairs, self.stop, self.first_seen = pairs, threading.Event(), {}

    def run(self) -> None:
        while not self.stop.is_set():
            for src, dst, lag in self.pairs:
                try:
                    self._sync(src, dst, lag)
                except OSError:  # src changed under the walk: look again
                    pass
            time.sleep(0.02)

    def _sync(self, src: str, dst: str, lag: float | Callable[[str], float]) -> None:
        now = time.monotonic()
        for here, dirs, files in os.walk(src):
            rel = os.path.relpath(here, src)
            for d in dirs:
                key = os.path.join(src, rel, d)
                wait = lag(os.path.normpath(os.path.join(rel, d))) if callable(lag) else lag
                shown = now - self.first_seen.setdefault(key, now) >= wait
                if shown and os.path.isdir(os.path.join(dst, rel)):  # its parent is shown
                    os.makedirs(os.path.join(dst, rel, d), exist_ok=True)
            for f in files:
                target = os.path.join(dst, rel, f)
                if f.startswith(MARKER_PREFIX) and os.path.isdir(os.path.dirname(target)):
                    if not os.path.exists(target):
                        shutil.copyfile(os.path.join(here, f), target)
        for here, _, files in os.walk(dst):
            for f in files:
                rel = os.path.relpath(os.path.join(here, f), dst)
                if f.startswith(MARKER_PREFIX) and not os.path.exists(os.path.join(src, rel)):
                    os.remove(os.path.join(here, f))


class Points(Dataset):
    """``n`` deterministic (x, label) pairs: 4 features, 2 classes."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class SlowItems(Dataset):
    """``data`` whose every item takes ``delay_s`` more to read (``0``: as ``data`` does).

    A scenario gives the delay to the slow rank's loader only, and ``0`` to the others'.
    """

    def __init__(self, data: Dataset, delay_s: float) -> None:
        self.data = data
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.data[i]


class LyingSampler(DistributedSampler):
    """Claims ``claimed`` samples but yields ``actual`` (a loader whose __len__ lies)."""

    def __init__(self, dataset: Dataset, claimed: int, actual: int) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=False)
        self.claimed, self.actual = claimed, actual

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.actual))


class WarningCollector(logging.Handler):
    """Collects rankguard's warnings (the job configures logging, rankguard never does).

    An error a guard logs and then raises is the scenario's outcome, not a warning.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, RAISED, False):
            self.messages.append(record.getMessage())


#: Threads a process keeps for the rest of its life once something started them, whichever
#: scenario that was (name prefixes); a thread a scenario leaves behind is none of these.
PROCESS_WIDE: tuple[str, ...] = ()


class ThreadAudit:
    """The threads a scenario left running into the next, in a process that runs several.

    A job's process ends after its fit, and its threads with it: Python joins them at exit.
    Here each scenario must end its own (its saves finished, its executors shut down); one it
    left running acts inside the next scenario (a save's done-callback that records a metric
    and reaches a collective there), whose outcome is then no longer its own.
    """

    def __init__(self) -> None:
        self._before = set(threading.enumerate())
        self._started_in: dict[threading.Thread, str] = {}

    def leftovers(self) -> list[str]:
        """At a scenario's start: each live thread a previous one started, ``name (scenario)``."""
        return sorted(
            f"{thread.name} (from {scenario})"
            for thread, scenario in self._started_in.items()
            if thread.is_alive() and not thread.name.startswith(PROCESS_WIDE)
        )

    def ended(self, scenario: str) -> None:
        """Marks each live thread not seen before as started by ``scenario`` (or after it)."""
        for thread in threading.enumerate():
            if thread not in self._before and thread not in self._started_in:
                self._started_in[thread] = scenario


def join_started_since(before: set[threading.Thread], timeout_s: float = 60.0) -> None:
    """Joins the non-daemon threads started since ``before``, as a process's exit does.

    Call it once their executors are shut down; one still alive after ``timeout_s`` is left
    to :class:`ThreadAudit`, which names it at the next scenario's start.
    """
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread not in before and not thread.daemon and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


class Recorder:
    """Writes each scenario's outcome on this rank to ``out_dir/rank{N}.json``.

    Each record holds ``leftover_threads``: the threads an earlier scenario left running
    when it started (:class:`ThreadAudit`), written before the scenario runs (one may
    never return).
    """

    def __init__(self, out_dir: str) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.path = Path(out_dir) / f"rank{self.rank}.json"
        self.results: dict[str, dict] = {}
        self.collector = WarningCollector()
        self.threads = ThreadAudit()
        self._running: tuple[str, dict] = ("", {})  # the scenario running, and its counters
        logging.getLogger("rankguard").addHandler(self.collector)

    def outcome(self, fn, counters: dict) -> dict:
        """Runs ``fn``; returns its outcome, rankguard's warnings and ``counters``."""
        self.collector.messages.clear()
        try:
            fn()
        except Exception as exc:
            return self._record(exc, counters, traceback.format_exc())
        return self._record(None, counters)

    def _record(self, exc: BaseException | None, counters: dict, trace: str = "") -> dict:
        """An outcome: ``exc`` (``None``: ok; ``trace``: its traceback), the warnings, counters."""
        result: dict = {"outcome": "ok"}
        if exc is not None:
            result = {"outcome": type(exc).__name__, "message": str(exc)}
        if trace:
            result["traceback"] = trace
        return {**result, "warnings": list(self.collector.messages), "counters": dict(counters)}

    def run(self, name: str, fn, counters: dict) -> None:
        global RECORDER
        leftovers = self.threads.leftovers()
        self.results[name] = {"leftover_threads": leftovers}
        self.path.write_text(json.dumps(self.results, indent=1))
        RECORDER, self._running = self, (name, counters)
        result = self.outcome(fn, counters)
        self.threads.ended(name)
        self.results[name] = result = {**result, "leftover_threads": leftovers}
        self.path.write_text(json.dumps(self.results, indent=1))
        if result["outcome"] != "ok" and os.environ.get("E2E_RERAISE") == "1":
            raise SystemExit(f"{result['outcome']}: {result['message']}")

    def at_raise(self, exc: BaseException) -> None:
        """Records the running scenario's outcome as ``exc`` leaves its loop, before the fit's
        teardown: rankguard then tells the other ranks, which end within a second, and the
        launcher stops this rank, maybe before the scenario returns (its record is then this
        one: no traceback)."""
        name, counters = self._running
        self.results[name] = {**self.results[name], **self._record(exc, counters)}
        self.path.write_text(json.dumps(self.results, indent=1))


#: The recorder of the scenario running in this process (set by :meth:`Recorder.run`).
RECORDER: Recorder | None = None


def record_at_raise(exc: BaseException) -> None:
    """:meth:`Recorder.at_raise` of the running scenario's recorder (none: nothing)."""
    if RECORDER is not None:
        RECORDER.at_raise(exc)


def destroy_process_group_waits() -> None:
    """NCCL's communicator teardown waiting for a peer that never comes: the process stays.

    A rank whose script calls ``destroy_process_group()`` in its ``finally`` after it raised
    waits there (NCCL's teardown, unlike gloo's, waits for its peers); here a long sleep.
    """
    time.sleep(600)


def wait_at_host_sync() -> None:
    """Under NCCL a collective returns at once; the thread waits at its next host sync."""
    time.sleep(600)


def rankguard_off() -> bool:
    """``E2E_RANKGUARD=off``: a scenario that honours it runs without rankguard (the
    "without" column of ``benchmarks/faults.py``)."""
    return os.environ.get("E2E_RANKGUARD") == "off"


def run_scenarios(scenarios: dict, counters: dict) -> None:
    """A job's main: ``job.py OUT_DIR SCENARIO...`` runs each scenario, recording its outcome.

    Log lines carry the rank (``[rank N]``).
    """
    out_dir, *names = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    recorder = Recorder(out_dir)
    for name in names:
        recorder.run(name, scenarios[name], counters)


class Stream(IterableDataset):
    """An iterable (streaming-style) dataset without ``__len__``: ``n`` points.

    ``seed``: which points (a rank's own stream gives its rank: a stream that ignores
    the rank gives every rank the same batches, which rankguard names).
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.points = Points(n, seed)

    def __iter__(self):
        return (self.points[i] for i in range(len(self.points)))


#: Token ids run from 1 to VOCAB - 1 in :func:`token_dataset`.
VOCAB = 32


def token_dataset(n: int):
    """A Hugging Face ``datasets.Dataset`` of ``n`` short token sequences and 2-class labels.

    Deterministic, built in memory (no hub): ``input_ids`` of length 4, ``labels``.
    """
    from datasets import Dataset

    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(1, VOCAB, (n, 4), generator=gen)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids.sum(dim=1) % 2).tolist()})


def seed_everything(seed: int) -> None:
    """Seeds python ``random``, numpy and torch with ``seed`` (the same on every rank)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seeded_split(n: int = 64, test_size: float = 0.25):
    """``token_dataset(n)`` split as it should be: ``train_test_split(..., seed=42)``."""
    split = token_dataset(n).train_test_split(test_size=test_size, seed=42)
    return split["train"], split["test"]


def tiny_bert():
    """A 2-layer BERT classifier over :data:`VOCAB` tokens, built from a config (no hub)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=8,
    )
    return BertForSequenceClassification(config)


def unseeded_split(n: int, test_size: float):
    """Seed 003: ``train_test_split`` without a seed, in a process whose numpy is not seeded.

    The split draws from numpy's global generator, seeded from OS entropy in a fresh
    process, so each rank gets its own split. Returns the train and test datasets.
    """
    import numpy as np

    np.random.set_state(np.random.RandomState().get_state())  # a fresh, unseeded process's
    split = token_dataset(n).train_test_split(test_size=test_size)
    return split["train"], split["test"]


class EventLog(Guard):
    """A core guard that records every event it sees as ``(event, step, loader name)``."""

    name = "event_log"

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, str | None]] = []

    def handler(self, event):
        def record(facts) -> None:
            loader = facts.loader.name if facts.loader is not None else None
            self.events.append((event.value, facts.step, loader))

        return record

    def read_steps(self, entries) -> None:
        """The per-step events, from the step log (read before each other event)."""
        for _, event, step, _, loader, _ in expand(entries):
            if event in PER_STEP_NAMES:
                self.events.append((event, step, loader))


PER_STEP_NAMES = frozenset(event.value for event in PER_STEP)


class ClaimedStream(Stream):
    """An iterable dataset whose ``__len__`` says ``claimed`` samples; it yields ``n``."""

    def __init__(self, n: int, claimed: int, seed: int = 0) -> None:
        super().__init__(n, seed)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed


def cpu_trainer(**settings):
    """A one-process Lightning trainer on the CPU that logs and prints nothing of its own.

    One epoch and no checkpoints unless ``settings`` say otherwise.
    """
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"max_epochs": 1, "enable_checkpointing": False, **settings},
    )


def gloo_training_args(output_dir: str | Path, **settings):
    """The Hugging Face Trainer's arguments for a rank of a CPU job over gloo, reporting and
    printing nothing of its own (the Trainer's twin of :func:`cpu_trainer`); ``settings``
    give the rest."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
        **settings,
    )
