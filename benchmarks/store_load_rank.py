"""Virtual ranks for ``benchmarks/store_load.py``: one worker process hosts thousands of them.

Each virtual rank is one thread with its own ``TCPStore`` client (one connection to
the job's store, which runs in a process of its own) and a real :class:`SideChannel`
over it. What it sends is what rankguard sends: the real guards' fit-start, save and
resume checks (real loaders, model and checkpoint folder), the real hang watchdog's
thread loop (``WatchdogThread._run``: status exchanges with statuses built by
``rank_status``, the fault board's and the stop agreement's polls, its reports), and
the monitors' interval exchange (payloads built by the real data-stall and straggler
monitors, decided by their real decisions).

What differs from a job, and why (each is the machine's limit, not rankguard's):

- One store connection per virtual rank. A rank of a job has one per thread that
  exchanges (main, watchdog, interval exchange, torch's own): this machine allows a
  process 20,000 open files, so the store's process could not hold 16,384 x 4.
  The watchdog's loop and the interval exchange therefore share one thread: the
  interval exchanges due run right after each status exchange, on every rank in the
  same order (two at once where the interval is half the status period).
- The training loop is simulated: a heartbeat every ``step_s`` (a train batch start,
  after the previous one's end), and the loop's stack is a fixed realistic one (a
  frame in the user's code; in ``all_reduce`` once a peer stopped). Reading every
  thread's frames (``sys._current_frames``) with thousands of threads per process
  would cost the clients quadratic CPU that no job pays.
- What a worker's virtual ranks would each read alike from ``/proc`` (whether a
  node's peer process is alive: they all share one pid) is read once per 0.5 s.
- Report files hold the reporting thread's stack only (a job's process has a few
  threads; a worker here has thousands).
- Each virtual node holds :data:`PER_NODE` ranks: ``NODE_RANK``/``LOCAL_RANK`` are read
  per thread.
- At most four virtual ranks of a worker run Python at once (:class:`Slots`); a rank
  waiting on the store, sleeping, or waiting for an event or a thread holds no slot.
- The exit after an incident raises :class:`VirtualExit` in the rank's thread instead
  of ending the process (everything before ``os._exit`` runs: the ranks meet).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import re
import sys
import threading
import time
import tracemalloc
from collections import Counter, defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# RANKGUARD_SRC: another checkout's src (a measurement of the code before a change).
for _path in (str(ROOT), os.environ.get("RANKGUARD_SRC") or str(ROOT / "src")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from rankguard.callbacks import (  # noqa: E402
    Event,
    EventFacts,
    LoaderFacts,
    ResumeFacts,
    SideChannel,
)
from rankguard.callbacks.core import background_exchange, nodes  # noqa: E402
from rankguard.callbacks.core.guard import GuardRunner  # noqa: E402
from rankguard.callbacks.hang import (  # noqa: E402
    collectives,
    ending,
    fault_watch,
    report,
)
from rankguard.callbacks.hang import hang_watchdog as hang_module  # noqa: E402
from rankguard.callbacks.hang import watchdog_thread as thread_module  # noqa: E402
from rankguard.callbacks.hang.collective_compare import GroupRecord  # noqa: E402
from rankguard.callbacks.hang.heartbeats import HeartbeatReader  # noqa: E402
from rankguard.callbacks.registry import GUARDS, build_guards  # noqa: E402
from tests.e2e.common import Points  # noqa: E402

#: Ranks per simulated node (8 GPUs a node).
PER_NODE = 8
#: The guards whose checks run at fit start, a save and a resume (the watchdog and the
#: monitors run on the watchdog's loop, see :class:`VirtualRank`).
CHECK_GUARDS = (
    "data_consistency_guard",
    "drop_last_guard",
    "batch_parity_guard",
    "shared_dir_barrier",
    "resume_guard",
    "checkpoint_planner",
)
STATUS = thread_module.STATUS_EXCHANGE
_ORIGINAL_NODE_IDENTITY = nodes.node_identity
_current = threading.local()  # the virtual rank of this thread
logger = logging.getLogger("store_load")


class Slots:
    """At most ``n`` virtual ranks of a worker run Python at once; one that waits holds none.

    A thousand threads that all want the GIL at once (each verdict wakes every rank of a
    worker) spend the cores handing it over: each waiter wakes every switch interval.
    A rank takes a slot to run, and gives it back while it waits on the store, sleeps
    or waits for its watchdog's next wake; the requests and the waits are the same.
    """

    def __init__(self, n: int) -> None:
        self._slots = threading.Semaphore(n)

    def take(self) -> None:
        if getattr(_current, "rank", None) is not None and not getattr(_current, "slot", False):
            self._slots.acquire()
            _current.slot = True

    def give(self) -> bool:
        if getattr(_current, "slot", False):
            _current.slot = False
            self._slots.release()
            return True
        return False

    def waiting(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)`` without holding a slot."""
        held = self.give()
        try:
            return call(*args, **kwargs)
        finally:
            if held:
                self.take()


_slots = Slots(4)
_real_sleep = time.sleep
_real_event_wait = threading.Event.wait
_real_join = threading.Thread.join


def _sleep(seconds: float) -> None:
    _slots.waiting(_real_sleep, seconds)


def _event_wait(self: threading.Event, timeout: float | None = None) -> bool:
    return _slots.waiting(_real_event_wait, self, timeout)


def _join(self: threading.Thread, timeout: float | None = None) -> None:
    _slots.waiting(_real_join, self, timeout)


class VirtualExit(SystemExit):
    """Raised where a rank's process would end (``os._exit``), with its exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


# -- per-thread stand-ins for what is per process in a job -----------------------------------


def _node_identity(env: Any = None) -> nodes.NodeId:
    rank = getattr(_current, "rank", None)
    if env is not None or rank is None:
        return _ORIGINAL_NODE_IDENTITY(env)
    return nodes.NodeId("vm", str(rank // PER_NODE), rank % PER_NODE)


def _write_own_stack(directory: Any, rank: int, header: str, loop_thread: Any = None) -> Path:
    """``report.write_stacks`` for one thread: the reporting thread's frames only."""
    path = Path(directory) / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(
            f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}'
        )
        frame = frame.f_back
    path.write_text(f"{header}\n\nCurrent thread:\n" + "\n".join(frames) + "\n", encoding="utf-8")
    return path


_alive: dict[int, tuple[float, bool]] = {}
_real_is_alive = fault_watch.is_alive


def _is_alive(pid: int) -> bool:
    """``faults.is_alive``, read at most every 0.5 s per pid: every virtual rank has one pid."""
    now = time.monotonic()
    seen = _alive.get(pid)
    if seen is None or now - seen[0] > 0.5:
        seen = _alive[pid] = (now, _real_is_alive(pid))
    return seen[1]


def _virtual_exit(code: int) -> None:
    raise VirtualExit(code)


_real_end_process = ending.end_process


def _end_process(code: int, **kwargs: Any) -> Any:
    """The one exit path, whole, but for its last step (``os._exit``)."""
    vr = getattr(_current, "rank_object", None)
    if vr is not None:
        vr.marks.setdefault("end_began", time.time())
    kwargs["exit_"] = _virtual_exit
    return _real_end_process(code, **kwargs)


def _once_per_process(fn: Any, key: Any) -> Any:
    """``fn`` with its result kept per ``key(*args)``: virtual ranks share what it reads."""
    kept: dict[Any, Any] = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        k = key(*args)
        with lock:
            if k in kept:
                return copy.deepcopy(kept[k])
        value = fn(*args)
        with lock:
            kept[k] = value
        return copy.deepcopy(value)

    return wrapper


def install_stand_ins() -> None:
    """Makes what is per process in a job per thread here (see the module's docstring).

    Also: what every virtual rank of a worker would compute alike from the objects they
    share is computed once per worker (the hash of a dataset's sampled items, the digests
    of the process's random generators): the payloads are the same, the clients' CPU is
    not spent 2,048 times.
    """
    from rankguard.callbacks.data import data_consistency_guard, fingerprint
    from rankguard.callbacks.resume import position, resume_guard

    fingerprint._hash_sample = _once_per_process(
        fingerprint._hash_sample, lambda dataset, indices: (id(dataset), tuple(indices))
    )
    resume_guard.rng_digests = _once_per_process(position.rng_digests, lambda: None)
    data_consistency_guard.rng_digest = _once_per_process(
        data_consistency_guard.rng_digest, lambda: None
    )
    nodes.node_identity = _node_identity
    for module in (
        "rankguard.callbacks.resume.resume_guard",
        "rankguard.callbacks.hang.fault_watch",
        "rankguard.callbacks.straggler.straggler_monitor",
        "rankguard.callbacks.checkpoint.checkpoint_planner",
        "rankguard.callbacks.checkpoint.shared_dir_barrier",
    ):
        mod = sys.modules.get(module) or __import__(module, fromlist=["x"])
        if hasattr(mod, "node_identity"):
            mod.node_identity = _node_identity
    time.sleep = _sleep  # a rank that sleeps or waits holds no slot (see Slots)
    threading.Event.wait = _event_wait
    threading.Thread.join = _join
    report.write_stacks = _write_own_stack
    fault_watch.end_process = _end_process
    fault_watch.is_alive = _is_alive
    threading.excepthook = _thread_exit


_real_excepthook = threading.excepthook


def _thread_exit(args: Any) -> None:
    """A virtual rank's exit from another of its threads (its teardown's bound) is no error."""
    if not isinstance(args.exc_value, VirtualExit):
        _real_excepthook(args)


# -- what the store sees: a counting client ---------------------------------------------------


class CountingStore:
    """A ``TCPStore`` client that counts its requests (``set_timeout`` is local)."""

    OPS = ("set", "get", "add", "check", "wait", "multi_get", "multi_set", "delete_key")

    def __init__(self, client: Any) -> None:
        self._client = client
        self.counts: Counter[str] = Counter()
        self.bytes_out = 0
        self.bytes_in = 0
        self.host, self.port = client.host, client.port

    def set_timeout(self, timeout: timedelta) -> None:
        self._client.set_timeout(timeout)

    def set(self, key: str, value: Any) -> None:
        self.counts["set"] += 1
        self.bytes_out += len(value)
        _slots.waiting(self._client.set, key, value)

    def get(self, key: str) -> bytes:
        self.counts["get"] += 1
        value = _slots.waiting(self._client.get, key)
        self.bytes_in += len(value)
        return value

    def add(self, key: str, value: int) -> int:
        self.counts["add"] += 1
        return _slots.waiting(self._client.add, key, value)

    def check(self, keys: list[str]) -> bool:
        self.counts["check"] += 1
        return _slots.waiting(self._client.check, keys)

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self.counts["wait"] += 1
        _slots.waiting(self._client.wait, keys, *timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.counts["multi_get"] += 1
        values = _slots.waiting(self._client.multi_get, keys)
        self.bytes_in += sum(len(v) for v in values)
        return values

    def delete_key(self, key: str) -> bool:
        self.counts["delete_key"] += 1
        return _slots.waiting(self._client.delete_key, key)

    def __getattr__(self, name: str) -> Any:
        self.counts[name] += 1
        return getattr(self._client, name)


class VirtualChannel(SideChannel):
    """The real side channel on one virtual rank's counted client; times each exchange."""

    def __init__(self, vr: VirtualRank, client: Any, timeout_s: float, prefix: str) -> None:
        super().__init__(
            client, rank=vr.rank, world_size=vr.world, timeout_s=timeout_s, prefix=prefix
        )
        self.vr = vr
        self._local.client = vr.counting  # this thread's client is the rank's one connection
        self.raw: dict[str, tuple[list[bytes], Any, Any]] = {}  # rank 0: one exchange per name

    def exchange(self, name: str, payload: Any, decide: Any, **kwargs: Any) -> Any:
        vr = self.vr
        started, decided = time.perf_counter(), self.decide_s
        cpu = time.thread_time()  # this thread's own CPU: what a rank with a core would take
        sent, received = self.bytes_sent, self.bytes_received
        error = None
        try:
            if self.is_leader:
                self._deciding = (name, payload, decide)
            return super().exchange(name, payload, decide, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            vr.record_exchange(
                name,
                time.perf_counter() - started,
                self.decide_s - decided,
                self.bytes_sent - sent,
                self.bytes_received - received,
                error,
                time.thread_time() - cpu,
            )
            if name == STATUS and threading.current_thread() is vr.thread:
                vr.after_status()

    def _read(self, keys: list[str], timeout: float) -> list[bytes] | None:
        raw = super()._read(keys, timeout)
        deciding = getattr(self, "_deciding", None)
        if raw is not None and self.is_leader and deciding is not None and len(keys) > 1:
            name, payload, decide = deciding
            kind = exchange_kind(name)
            if kind not in self.raw or sum(map(len, raw)) > sum(map(len, self.raw[kind][0])):
                self.raw[kind] = (raw, payload, decide)  # replayed for its memory (measure_memory)
            if os.environ.get("STORE_LOAD_DUMP"):  # every exchange rank 0 read, for a profile
                dump = (
                    Path(os.environ["STORE_LOAD_DUMP"])
                    / f"{time.time():.3f}-{kind.replace('/', '_')}.pkl"
                )
                dump.write_bytes(pickle.dumps((name, raw, payload)))
            self._deciding = None
        return raw


def exchange_kind(name: str) -> str:
    """An exchange's name without what varies per loader or directory."""
    return re.sub(r"/(eval|fit)_start/.*$", r"/\1_start", name)


# -- the simulated training loop and its watchdog ---------------------------------------------


def _frames() -> dict[str, list[tuple[str, int, str]]]:
    """Realistic training-loop stacks, innermost first (real files of the installed torch)."""
    import torch.distributed.c10d_logger as c10d_logger
    import torch.distributed.distributed_c10d as c10d

    train = "/job/train.py"
    loop = [(train, 120, "train_epoch"), (train, 200, "main"), (train, 210, "<module>")]
    reduce_line = c10d.all_reduce.__wrapped__.__code__.co_firstlineno + 40
    return {
        "computing": [(train, 88, "train_step"), *loop],
        "all_reduce": [
            (c10d.__file__, reduce_line, "all_reduce"),
            (c10d_logger.__file__, 83, "wrapper"),
            (train, 91, "train_step"),
            *loop,
        ],
        "stuck": [("/job/data.py", 40, "read_shard"), (train, 77, "train_step"), *loop],
    }


class VirtualThread(thread_module.WatchdogThread):
    """The real watchdog thread's loop, run on the virtual rank's thread; a fixed stack.

    Its record of collectives is the one a recorder keeps at this world size: the
    default group (every rank its member, as the recorder reads them), its count (two
    collectives a step, one more where the loop waits in one) and its last calls (a
    real recorder's, from the coordinator's one-rank run).
    """

    vr: VirtualRank

    def _loop_stack(self) -> list[tuple[str, int, str]]:
        return self.vr.stack

    def collectives(self) -> tuple:
        vr = self.vr
        template = vr.worker.record
        if template is None:
            return ()
        count = 2 * vr.step + (1 if vr.stack is vr.worker.frames["all_reduce"] else 0)
        by_parity = {i.seq % 2: i for i in template.last}  # a step: the gradients, the loss
        first = max(1, count - len(template.last) + 1)
        last = tuple(by_parity[q % 2]._replace(seq=q) for q in range(first, count + 1))
        return (GroupRecord(template.name, vr.worker.members, count, last),)


class VirtualHeartbeats(HeartbeatReader):
    """The real reader of the step log, which first appends the beats the virtual loop made.

    Each read (the thread's, before each status) records the train steps the virtual rank's
    clock says ended since the last, stamped when the loop beat, not when read.
    """

    def __init__(self, vr: VirtualRank, handle: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vr = vr
        self.handle = handle  # the watchdog's: a beat goes where the adapter's would

    def read_step_log(self) -> None:
        vr = self.vr
        if vr.training and vr.worker.halted:  # the job's collectives stopped (rank 0 gone)
            vr.training, vr.stack = False, vr.worker.frames["all_reduce"]
        if vr.training and not vr.beating and threading.current_thread() is vr.thread:
            vr.beating = True
            try:
                now, entries = time.perf_counter(), self.steps.entries
                while vr.training and now >= vr.next_beat:
                    vr.step += 1
                    first = len(entries)
                    self.handle(Event.TRAIN_BATCH_END, EventFacts(step=vr.step - 1))
                    self.handle(Event.TRAIN_BATCH_START, EventFacts(step=vr.step))
                    for i in range(first, len(entries)):  # when the loop beat, not when read
                        entries[i] = (vr.next_beat, *entries[i][1:])
                    vr.next_beat += vr.step_s
            finally:
                vr.beating = False
        super().read_step_log()


class VirtualWatchdog(hang_module.HangWatchdog):
    """The real HangWatchdog whose heartbeats come from :class:`VirtualRank`'s clock."""

    def __init__(self, vr: VirtualRank, **settings: Any) -> None:
        self.vr = vr  # before the guard builds its reader and thread, which read it
        super().__init__(**settings)

    def _new_heartbeats(self) -> HeartbeatReader:
        return VirtualHeartbeats(
            self.vr, self.handle, measure=self.auto_calibrate, warmup=self.warmup_steps
        )

    def _new_thread(self) -> thread_module.WatchdogThread:
        thread = VirtualThread(
            self.name,
            self.current_settings(),
            self.heartbeats,
            self._incident,
            warn_once=self.warn_once,
            stop_agreement=self.stop_agreement,
        )
        thread.vr = self.vr
        return thread

    def _start(self) -> None:  # no thread of its own: the virtual rank's thread runs the loop
        self._watch.thread = threading.current_thread()
        self._adopt(self._watch.prepare(self.current_settings(), self.channel))


# -- one virtual rank ------------------------------------------------------------------------


class VirtualRank:
    """One rank: its connection, channel, guards, watchdog, and what it measured."""

    def __init__(self, worker: Worker, rank: int) -> None:
        self.worker = worker
        self.rank = rank
        self.world = worker.world
        self.thread: threading.Thread | None = None
        self.client: Any = None
        self.counting: CountingStore | None = None
        self.channel: VirtualChannel | None = None
        self.runner: GuardRunner | None = None
        self.watchdog: VirtualWatchdog | None = None
        self.stack = worker.frames["computing"]
        self.training = False
        self.beating = False
        self.step = 0
        self.step_s = worker.config["step_s"]
        self.next_beat = 0.0
        self.statuses = 0  # status exchanges done in this watchdog run
        self.intervals = 0  # interval exchanges done in this watchdog run
        self.plan: dict[str, Any] = {}
        self.exchanges: dict[str, list[tuple]] = defaultdict(list)
        self.marks: dict[str, float] = {}
        self.counts_at: dict[str, tuple[Counter, int, int]] = {}
        self.error: str | None = None

    # -- set-up ----------------------------------------------------------------------

    def connect(self) -> None:
        cfg = self.worker.config
        with self.worker.connecting:
            self.client = dist.TCPStore(
                cfg["host"],
                cfg["port"],
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=cfg["client_timeout_s"]),
            )
        self.counting = CountingStore(self.client)
        self.new_channel(1)

    def set_watchdog(self, settings: dict[str, Any]) -> None:
        self.worker.config["watchdog"].update(settings)

    def new_channel(self, fit: int) -> None:
        timeout = self.worker.config["exchange_timeout_s"]
        self.channel = VirtualChannel(self, self.client, timeout, f"rankguard/{fit}")

    def record_exchange(
        self, name: str, wall: float, decide: float, sent: int, got: int, error: Any, cpu: float
    ) -> None:
        kind = exchange_kind(name)
        failed = None if error is None else type(error).__name__
        self.exchanges[kind].append((time.time(), wall, decide, sent, got, failed, cpu))

    def snapshot_counts(self, mark: str) -> None:
        c = self.counting
        self.counts_at[mark] = (Counter(c.counts), c.bytes_out, c.bytes_in)
        self.marks[mark] = time.time()

    # -- the guards' checks ----------------------------------------------------------

    def facts(self) -> EventFacts:
        w = self.worker
        train, evals = w.datasets
        # Not shuffled: the guards count each rank's batches by iterating its sampler, and
        # 16,384 permutations of the whole dataset would cost the clients' CPU for nothing.
        sampler = functools.partial(
            DistributedSampler, num_replicas=self.world, rank=self.rank, shuffle=False
        )
        loaders = [
            LoaderFacts("train", DataLoader(train, 4, sampler=sampler(train)), True),
            LoaderFacts("eval", DataLoader(evals, 4, sampler=sampler(evals)), False),
        ]
        return EventFacts(
            loaders=loaders, model=w.model, optimizer=w.optimizer, directories=[w.config["folder"]]
        )

    def fit_start(self) -> None:
        guards = build_guards({name: name in CHECK_GUARDS for name in GUARDS})
        self.runner = runner = GuardRunner(guards)
        runner.channel = self.channel
        for guard in guards:
            guard.bind(self.channel)
        self._facts = self.facts()
        runner.dispatch(Event.FIT_START, self._facts)

    def save(self, step: int) -> None:
        folder = self.worker.config["folder"]
        facts = EventFacts(step=step, model=self.worker.model, directories=[folder])
        self.marks["save_start"] = time.time()
        if self.watchdog is not None:
            self.watchdog.handle(Event.CHECKPOINT_SAVE_START, facts)
        self.runner.dispatch(Event.CHECKPOINT_SAVE_START, facts)
        self.runner.dispatch(Event.CHECKPOINT_SAVE_END, facts)
        if self.watchdog is not None:
            self.watchdog.handle(Event.CHECKPOINT_SAVE_END, facts)
        self.marks["save_end"] = time.time()

    def resume(self) -> None:
        folder = self.worker.config["folder"]
        self.runner.load_state_dict(self.runner.state_dict())
        train = self._facts.loaders[0]
        resume = ResumeFacts("store_load", folder, {"step": 8}, train.loader, folder=folder)
        self.runner.dispatch(Event.RESUMED, EventFacts(step=8, resume=resume))

    # -- the watchdog's loop -----------------------------------------------------------

    def run_watchdog(self, plan: dict[str, Any]) -> None:
        """The real watchdog loop for one fit, until every rank's fit ended (or an exit)."""
        cfg = self.worker.config
        self.plan = plan
        self.statuses = self.intervals = 0
        self.step, self.training, self.stack = 0, True, self.worker.frames["computing"]
        # Before the fit starts: its first heartbeat reads the clock from here (a clock left
        # in the past would replay every step since, on every rank).
        self.next_beat = time.perf_counter() + self.step_s
        self.watchdog = wd = VirtualWatchdog(self, **cfg["watchdog"])
        wd.bind(self.channel)
        wd.handle(Event.FIT_START, EventFacts(step=0))
        self.snapshot_counts("run_start")
        try:
            wd._watch.run()
        except VirtualExit as exc:
            self.marks["exit"] = time.time()
            self.marks["exit_code"] = exc.code
        finally:
            wd.stop_agreement.restore()
            self.snapshot_counts("run_end")

    def after_status(self) -> None:
        """After each status exchange: the interval exchanges due, then this run's events."""
        self.statuses += 1
        n, plan = self.statuses, self.plan
        due = int(n * plan["status_period_s"] / plan["interval_s"]) if plan.get("intervals") else 0
        while self.intervals < due:
            self.intervals += 1
            self.interval_exchange()
        if n == plan.get("window_from"):
            self.snapshot_counts("window_from")
        if n == plan.get("window_to"):
            self.snapshot_counts("window_to")
        if n == plan.get("save_at"):
            self.save(self.step)
        if n == plan.get("stall_at") and self.training:
            self.marks["stall"] = time.time()
            self.stack = self.worker.frames[
                "stuck" if self.rank == plan["victim"] else "all_reduce"
            ]
            self.training = False
        if n == plan.get("recover_at") and not self.training:
            self.marks["recovered"] = time.time()
            self.stack, self.training = self.worker.frames["computing"], True
            self.next_beat = time.perf_counter()
        if n == plan.get("raise_at") and self.training:
            self.training = False
            self.marks["raise"] = time.time()
            self.stack = self.worker.frames["all_reduce"]
            if self.rank == plan["victim"]:
                self.stack = self.worker.frames["stuck"]
                try:
                    raise ValueError("sample 4711 has no tokens")
                except ValueError as exc:
                    self.watchdog.on_error(exc, EventFacts(step=self.step))
                self.marks["published"] = time.time()
                self.watchdog._watch.stop.set()  # its training raised: only its teardown is left
        if n == plan.get("end_at") and self.watchdog is not None:
            self.training = False
            self.watchdog.handle(Event.FIT_END, EventFacts(step=self.step))

    def interval_exchange(self) -> None:
        """The monitors' interval exchange: this rank's part, built by the real monitors."""
        template, decide = self.worker.interval_templates[
            self.rank % len(self.worker.interval_templates)
        ]
        _, parts, pace, left_late = template
        payload = (self.intervals * 50, copy.deepcopy(parts), pace, left_late)
        try:
            self.channel.exchange("intervals", payload, decide)
        except Exception as exc:  # the monitors warn and go on
            logger.debug("interval exchange failed: %s", exc)


# -- the worker process -----------------------------------------------------------------------


class RankLog(logging.Handler):
    """Keeps what rankguard logged, per virtual rank: each message's template, and times."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lock_ = threading.Lock()
        self.templates: Counter[tuple[str, str]] = Counter()
        self.examples: dict[tuple[str, str], str] = {}
        self.first: dict[tuple[int, str], float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.INFO:
            return
        rank = getattr(_current, "rank", -1)
        try:
            text = record.getMessage()
        except Exception:
            return
        first_line = text.split("\n", 1)[0]
        template = re.sub(r"\d+(\.\d+)?", "#", first_line)[:220]
        key = (record.levelname, template)
        with self.lock_:
            self.templates[key] += 1
            self.examples.setdefault(key, first_line[:400])
            if record.levelno >= logging.WARNING:
                self.first.setdefault((rank, record.levelname), record.created)


class Worker:
    """Hosts the virtual ranks ``ranks`` of a world of ``world``; run by :func:`worker_main`."""

    def __init__(self, index: int, ranks: list[int], config: dict) -> None:
        self.index = index
        self.world = config["world"]
        self.config = config
        self.connecting = threading.BoundedSemaphore(config["connect_parallel"])
        self.frames = _frames()
        n = config["world"]
        self.datasets = (Points(16 * n), Points(4 * n, seed=1))
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
        self.optimizer = torch.optim.Adam(self.model.parameters())
        # Rank 0 decides: it builds its own (payload, decision); the others send the payloads
        # the coordinator's monitors built (the same function, run once).
        if 0 in ranks or not config.get("interval_payloads"):
            self.interval_templates = interval_templates()
        else:
            self.interval_templates = [(p, None) for p in config["interval_payloads"]]
        self.record = config.get("record")
        members = getattr(collectives, "group_members", tuple)
        self.members = members(range(n))  # the default group's, as the recorder keeps them
        self.ranks = [VirtualRank(self, r) for r in ranks]
        self.log = RankLog()
        root = logging.getLogger("rankguard")
        root.addHandler(self.log)
        root.setLevel(logging.INFO)
        root.propagate = False
        self.halted: float | None = None  # when the coordinator said the job's collectives stopped
        self._lock = threading.Lock()
        self._starts: dict[int, tuple[threading.Event, list]] = {}  # per command: go, command
        self._done = threading.Event()
        self._finished = 0
        self._generation = 0

    def _slot(self, generation: int) -> tuple[threading.Event, list]:
        with self._lock:
            return self._starts.setdefault(generation, (threading.Event(), []))

    def start(self) -> None:
        for vr in self.ranks:
            vr.thread = threading.Thread(
                target=self._serve, args=(vr,), name=f"vrank{vr.rank}", daemon=True
            )
            vr.thread.start()

    def _serve(self, vr: VirtualRank) -> None:
        _current.rank = vr.rank
        _current.rank_object = vr
        generation = 0
        while True:
            generation += 1
            go, command = self._slot(generation)
            go.wait()
            name, args, start_at = command[0]
            if name == "quit":
                return
            delay = start_at - time.time()
            if delay > 0:
                _real_sleep(delay)
            _slots.take()
            try:
                getattr(vr, name)(*args)
            except BaseException as exc:
                vr.error = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                _slots.give()
            with self._lock:
                self._finished += 1
                if self._finished == len(self.ranks):
                    self._done.set()

    def run(self, name: str, args: tuple, start_at: float, limit_s: float) -> dict:
        """Runs ``name`` on every virtual rank here; returns what they measured."""
        for vr in self.ranks:
            vr.exchanges.clear()
            vr.marks.clear()
            vr.counts_at.clear()
            vr.error = None
        self.log.templates.clear()
        self.log.examples.clear()
        self.log.first.clear()
        before = {
            vr.rank: (Counter(vr.counting.counts) if vr.counting else Counter())
            for vr in self.ranks
        }
        cpu = time.process_time()
        with self._lock:
            self._finished = 0
            self._done.clear()
        self._generation += 1
        go, command = self._slot(self._generation)
        command.append((name, args, start_at))
        go.set()
        self._done.wait(limit_s)
        finished = self._finished
        cpu = time.process_time() - cpu
        return self.collect(name, before, cpu, finished)

    def collect(self, name: str, before: dict, cpu: float, finished: int) -> dict:
        requests: Counter[str] = Counter()
        for vr in self.ranks:
            if vr.counting is not None:
                requests.update(vr.counting.counts)
                requests.subtract(before[vr.rank])
        exchanges: dict[str, list] = defaultdict(list)
        leader: dict[str, list] = {}
        for vr in self.ranks:
            for kind, rows in vr.exchanges.items():
                if vr.rank == 0:
                    leader[kind] = rows
                else:
                    exchanges[kind].extend(rows)
        windows = {}
        for vr in self.ranks:
            if "window_from" in vr.counts_at and "window_to" in vr.counts_at:
                a, b = vr.counts_at["window_from"], vr.counts_at["window_to"]
                windows[vr.rank] = (
                    vr.marks["window_from"],
                    vr.marks["window_to"],
                    sum((b[0] - a[0]).values()),
                    dict(b[0] - a[0]),
                    b[1] - a[1],
                    b[2] - a[2],
                )
        errors = Counter(vr.error for vr in self.ranks if vr.error)
        marks = {vr.rank: dict(vr.marks) for vr in self.ranks if vr.marks}
        memory = {}
        if any(vr.rank == 0 for vr in self.ranks):
            memory = measure_memory(self.ranks[0].channel)
        return {
            "worker": self.index,
            "phase": name,
            "ranks": len(self.ranks),
            "finished": finished,
            "cpu_s": cpu,
            "requests": dict(+requests),
            "exchanges": dict(exchanges),
            "leader": leader,
            "windows": windows,
            "errors": dict(errors),
            "marks": marks,
            "logs": [
                (level, template, count, self.log.examples[(level, template)])
                for (level, template), count in self.log.templates.items()
            ],
            "first_log": {f"{r}:{lvl}": t for (r, lvl), t in self.log.first.items()},
            "memory": memory,
        }


def measure_memory(channel: VirtualChannel | None) -> dict[str, dict[str, float]]:
    """Rank 0: each exchange's decision replayed under tracemalloc (payloads read, decided)."""
    out = {}
    if channel is None:
        return out
    for name, (raw, payload, decide) in list(channel.raw.items()):
        tracemalloc.start()
        started = time.perf_counter()
        values = {r: pickle.loads(b) for r, b in enumerate(raw, start=1)}
        values[0] = payload
        try:
            decide(dict(sorted(values.items())))
        except Exception:
            pass
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[name] = {"peak_mb": peak / 2**20, "replay_s": took, "bytes_in": sum(map(len, raw))}
        del values
    channel.raw.clear()
    return out


def interval_templates(count: int = 4) -> list[tuple[tuple, Any]]:
    """Interval payloads built by the real data-stall and straggler monitors, and their decision.

    A one-rank fit of ``count`` x 110 batches (a forward of a small model, a few ms a
    batch); each exchange the monitors post is captured: what it sent and how it is
    decided.
    """
    captured: list[tuple[tuple, Any]] = []
    real_post = background_exchange.BackgroundExchange.post

    def post(self: Any, build: Any, decide: Any = None) -> Any:
        pending = real_post(self, build, decide)
        if self.name == "intervals" and pending.payload is not None:
            captured.append((pending.payload, decide if decide is not None else self.decide))
        return pending

    background_exchange.BackgroundExchange.post = post
    try:
        for seed in range(count):
            monitors = ("data_stall_monitor", "straggler_monitor")
            guards = build_guards({name: name in monitors for name in GUARDS})
            runner = GuardRunner(guards)
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
            data = Points(256, seed=seed)
            loader = LoaderFacts("train", DataLoader(data, 4), True)
            runner.fire(Event.FIT_START, EventFacts(loaders=[loader], model=model))
            x = torch.zeros(4, 64)
            for step in range(1, 111):
                runner.fire(Event.DATA_FETCH_START, EventFacts(step=step, loader=loader))
                runner.fire(Event.DATA_FETCH_END, EventFacts(step=step))
                runner.fire(Event.TRAIN_BATCH_START, EventFacts(step=step))
                model(x)
                time.sleep(0.001 * (1 + seed))
                runner.fire(Event.TRAIN_BATCH_END, EventFacts(step=step))
            runner.fire(Event.FIT_END, EventFacts(step=110))
            runner.close()
    finally:
        background_exchange.BackgroundExchange.post = real_post
    full = [c for c in captured if len(c[0][1]) == 2] or captured
    return full[-count:]


def _where_threads_are(signum: int, frame: Any) -> None:
    """How many threads are in which function (innermost three frames), to stderr."""
    places: Counter[str] = Counter()
    for stack in sys._current_frames().values():
        names = []
        while stack is not None and len(names) < 4:
            names.append(
                f"{os.path.basename(stack.f_code.co_filename)}:{stack.f_lineno}:{stack.f_code.co_name}"
            )
            stack = stack.f_back
        places[" < ".join(names)] += 1
    for place, n in places.most_common(15):
        print(f"{n:6d} {place}", file=sys.stderr, flush=True)


def worker_main(index: int, ranks: list[int], config: dict, conn: Any, halt: Any) -> None:
    """A worker process: hosts ``ranks``, runs each command the coordinator sends.

    ``halt``: a pipe on which the coordinator says, during a phase, that the job's
    collectives stopped (its store's host is gone): every rank's loop stops making
    progress, as it would in its next collective.
    """
    threading.stack_size(512 * 1024)
    # Each thread that waits for the GIL wakes every switch interval; with a thousand
    # threads at 5 ms the wake-ups alone take the cores. A thread that waits on the store
    # holds no GIL, so a longer interval only delays a thread that computes.
    sys.setswitchinterval(0.05)

    def dump_on_request() -> None:  # touch /tmp/store_load_dump.<pid>: where the threads are
        flag = Path(f"/tmp/store_load_dump.{os.getpid()}")
        while True:
            time.sleep(1.0)
            if flag.exists():
                flag.unlink()
                _where_threads_are(0, None)

    threading.Thread(target=dump_on_request, name="dump", daemon=True).start()
    install_stand_ins()
    os.makedirs(config["folder"], exist_ok=True)
    worker = Worker(index, ranks, config)
    worker.start()

    def listen() -> None:
        while True:
            try:
                halt.recv()
            except (EOFError, OSError):
                return
            worker.halted = time.time()

    threading.Thread(target=listen, name="halt", daemon=True).start()
    conn.send(("ready", index, time.process_time()))
    while True:
        name, args, start_at, limit_s = conn.recv()
        if name == "quit":
            conn.send(("bye", index))
            return
        conn.send(("result", worker.run(name, tuple(args), start_at, limit_s)))


__all__ = ["CountingStore", "VirtualChannel", "VirtualExit", "VirtualRank", "Worker", "worker_main"]
