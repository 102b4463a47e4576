"""What rankguard asks of a job's store at 1,024 to 16,384 ranks, simulated on one machine.

One real ``TCPStore`` server runs in a process of its own, as a job's does (rank 0's
process or the launcher's agent hosts it; its server answers on one thread). A few
worker processes host the ranks (``benchmarks/store_load_rank.py``): each virtual
rank is a thread with its own store client and the real side channel, and sends what
rankguard sends with ``RankGuard()``'s defaults:

1. **fit start**: every guard's fit-start checks (real loaders, model, folder);
2. **the watchdog's run**: the real watchdog loop (status exchange every
   ``exchange_period_s``, the fault board's and the stop agreement's polls, its start:
   registration and the read of its node's peers) with a simulated training loop, and
   the monitors' interval exchange; a steady window is measured between two of its
   status exchanges; then a save (its exchanges), then fit end;
3. **resume**: a restarted fit's resume check;
4. at the largest size: **a stall** (a rank stops in its own code, the others wait in
   ``all_reduce``; reported past its calibrated deadline, then recovered) and **a raise**
   (a rank's training raises; every rank reports it and ends); then **the store's
   faults**: its host stopped (SIGSTOP) for a while, then gone (SIGKILL), and what each
   rank logs.

Figures: store requests per second and the server process's CPU (its utime + stime,
read from ``/proc``: the clients' CPU is counted apart), each exchange's latency on
the ranks that do not decide (p50/p99), rank 0's time reading and deciding and its
memory (the decision replayed under ``tracemalloc``), bytes, and the time from an
incident to every rank's report. Budgets are printed beside them.

The honest limit: every client shares this machine's cores with the server, so
latencies include the clients' own scheduling; the server's CPU is its own.

Usage: ``python benchmarks/store_load.py [--ranks 1024,4096,16384] [--json out.json]``;
``--ranks 256`` is a quick run. A full run takes about 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# RANKGUARD_SRC: another checkout's src (a measurement of the code before a change).
for _path in (str(HERE), str(ROOT), os.environ.get("RANKGUARD_SRC") or str(ROOT / "src")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

#: Budgets (docs/scale.md#16384-ranks-measured).
DECISION_BUDGET_S = 1.0
STEADY_CPU_BUDGET = 0.10  # of one core, at 16,384 ranks
#: Virtual ranks per worker process (rank 0 has a process of its own, as in a job).
PER_WORKER = 1024
#: The watchdog's settings for the incidents: the defaults, but a train step's ceiling of
#: 15 s and no calibration (a stall is reported and ends the job 15 s after it started,
#: plus the transport's part, which is what is measured), and a 5 s teardown bound.
INCIDENT_WATCHDOG = {"auto_calibrate": False, "timeout_s": 15.0, "teardown_timeout_s": 5.0}

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
typedef int (*gni_t)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int);
int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                char *serv, socklen_t servlen, int flags) {
    static gni_t real = 0;
    if (!real) real = (gni_t)dlsym(RTLD_NEXT, "getnameinfo");
    flags &= ~NI_NAMEREQD;
    return real(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST | NI_NUMERICSERV);
}
"""


def numeric_names(folder: Path) -> str | None:
    """A preload that keeps ``getnameinfo`` numeric (no reverse DNS per connection), or None.

    The TCPStore server and its clients look up each connection's peer by name to log
    it; where the resolver is unreachable, as in this sandbox, one lookup in 25 waits
    5 s (on the server's one thread too), which would be measured as the store's.
    """
    if shutil.which("gcc") is None:
        return None
    source, library = folder / "numeric.c", folder / "numeric.so"
    source.write_text(SHIM)
    done = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
        capture_output=True,
    )
    return str(library) if done.returncode == 0 else None


def serve(queue: Any) -> None:
    """The job's store, alone in its process."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue.put((store.port, os.getpid()))
    while True:
        time.sleep(3600)


def record_template(folder: Path) -> Any:
    """A real record of collectives (the default group's last calls) from a one-rank run."""
    import torch
    import torch.distributed as dist

    from rankguard.callbacks.hang.collectives import CollectiveRecorder
    from rankguard.callbacks.hang.stacks import library_paths

    init = folder / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    recorder = CollectiveRecorder(folder / "record", 0, library_paths())
    try:
        recorder.install()
        loss, grads = torch.zeros(1), torch.zeros(1024)
        for _ in range(6):  # a step's: the gradients' bucket and the logged loss
            dist.all_reduce(grads)
            dist.all_reduce(loss)
        record = recorder.snapshot()
    finally:
        recorder.close(keep=False)
        dist.destroy_process_group()
    return record[0] if record else None


class ServerWatch:
    """The store process's CPU time (utime + stime) and memory, sampled every 0.25 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def read(self) -> tuple[float, int] | None:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            rss = 0
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS"):
                        rss = int(line.split()[1]) * 1024
            return (int(fields[11]) + int(fields[12])) / self._tick, rss
        except (OSError, IndexError, ValueError):
            return None

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            got = self.read()
            if got is not None:
                self.samples.append((time.time(), *got))

    def cpu_at(self, t: float) -> float:
        """CPU seconds at wall time ``t`` (interpolated between samples)."""
        s = self.samples
        if not s:
            return 0.0
        if t <= s[0][0]:
            return s[0][1]
        for (t0, c0, _), (t1, c1, _) in itertools.pairwise(s):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
        return s[-1][1]

    def rss_max(self, a: float, b: float) -> int:
        return max((r for t, _, r in self.samples if a <= t <= b), default=0)

    def stop(self) -> None:
        self._stop.set()


class Job:
    """One simulated job of ``world`` ranks: the store's process and the workers."""

    def __init__(
        self, world: int, args: argparse.Namespace, folder: Path, record: Any, payloads: list
    ) -> None:
        import store_load_rank

        self.world = world
        self.saved: Any = None  # called after each phase (the figures so far, written)
        self.out: dict[str, Any] = {}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        self.server = ctx.Process(target=serve, args=(queue,), daemon=True)
        self.server.start()
        port, pid = queue.get(timeout=60)
        self.watch = ServerWatch(pid)
        config = {
            "world": world,
            "host": "127.0.0.1",
            "port": port,
            "client_timeout_s": 600.0,
            "exchange_timeout_s": 300.0,  # RankGuard(): exchange_timeout_s
            "connect_parallel": 256,
            "step_s": args.step_s,
            "folder": str(folder / f"ckpt{world}"),
            "record": record,
            "interval_payloads": payloads,
            "watchdog": {"report_dir": str(folder / f"reports{world}")},
        }
        self.config = config
        others = list(range(1, world))
        chunks = max(1, math.ceil(len(others) / PER_WORKER))
        groups = [[0]] + [others[i::chunks] for i in range(chunks)]
        self.pipes, self.halts, self.workers = [], [], []
        for index, ranks in enumerate(groups):
            parent, child = ctx.Pipe()
            halt, halted = ctx.Pipe()
            proc = ctx.Process(
                target=store_load_rank.worker_main,
                args=(index, sorted(ranks), config, child, halted),
                daemon=True,
            )
            proc.start()
            self.pipes.append(parent)
            self.halts.append(halt)
            self.workers.append(proc)
        for pipe in self.pipes:
            pipe.recv()

    def run(self, name: str, args: tuple = (), limit_s: float = 300.0, lead_s: float = 0.5) -> dict:
        """Runs a phase on every rank; returns the workers' results merged, and the server's CPU."""
        start_at = time.time() + lead_s
        for pipe in self.pipes:
            pipe.send((name, list(args), start_at, limit_s))
        results = [pipe.recv()[1] for pipe in self.pipes]
        end = time.time()
        time.sleep(0.3)  # one more sample of the server's CPU
        merged = merge(results)
        merged.update(
            phase=name,
            start=start_at,
            end=end,
            wall_s=end - start_at,
            server_cpu_s=self.watch.cpu_at(end) - self.watch.cpu_at(start_at),
            server_rss=self.watch.rss_max(start_at, end),
        )
        print(f"    {self.world} ranks, {name}: {merged['wall_s']:.1f} s", flush=True)
        if self.saved is not None:
            self.saved()
        if merged["finished"] < merged["ranks"]:
            raise PhaseIncomplete(
                f"{name}: {merged['finished']}/{merged['ranks']} ranks done in {limit_s:.0f} s"
            )
        return merged

    def run_async(self, name: str, args: tuple = (), limit_s: float = 300.0) -> tuple[float, Any]:
        start_at = time.time() + 0.5
        for pipe in self.pipes:
            pipe.send((name, list(args), start_at, limit_s))

        def finish() -> dict:
            results = [pipe.recv()[1] for pipe in self.pipes]
            end = time.time()
            merged = merge(results)
            merged.update(
                phase=name,
                start=start_at,
                end=end,
                wall_s=end - start_at,
                server_cpu_s=self.watch.cpu_at(end) - self.watch.cpu_at(start_at),
                server_rss=self.watch.rss_max(start_at, end),
            )
            return merged

        return start_at, finish

    def signal_server(self, signum: int) -> None:
        os.kill(self.server.pid, signum)

    def halt(self) -> None:
        """Every rank's training stops, as in its next collective once rank 0 is gone."""
        for pipe in self.halts:
            pipe.send(True)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("quit", [], 0.0, 1.0))
            except OSError:
                pass
        for proc in self.workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.watch.stop()
        if self.server.is_alive():
            self.server.kill()
        self.server.join(5)


def merge(results: list[dict]) -> dict:
    """The workers' results of one phase, as one."""
    out: dict[str, Any] = {
        "ranks": 0,
        "finished": 0,
        "client_cpu_s": 0.0,
        "requests": {},
        "exchanges": {},
        "leader": {},
        "windows": {},
        "errors": {},
        "marks": {},
        "logs": {},
        "first_log": {},
        "memory": {},
    }
    for r in results:
        out["ranks"] += r["ranks"]
        out["finished"] += r["finished"]
        out["client_cpu_s"] += r["cpu_s"]
        for op, n in r["requests"].items():
            out["requests"][op] = out["requests"].get(op, 0) + n
        for kind, rows in r["exchanges"].items():
            out["exchanges"].setdefault(kind, []).extend(rows)
        out["leader"].update(r["leader"])
        out["windows"].update(r["windows"])
        for e, n in r["errors"].items():
            out["errors"][e] = out["errors"].get(e, 0) + n
        out["marks"].update(r["marks"])
        for level, template, count, example in r["logs"]:
            key = f"{level}|{template}"
            have = out["logs"].get(key, [0, example])
            out["logs"][key] = [have[0] + count, have[1]]
        out["first_log"].update(r["first_log"])
        out["memory"].update(r["memory"])
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def exchange_rows(result: dict) -> dict[str, dict[str, float]]:
    """Per exchange: its latency on the other ranks, rank 0's decision and memory, bytes."""
    rows = {}
    for kind, samples in result["exchanges"].items():
        lat = [s[1] for s in samples if s[5] is None]
        failed = sum(1 for s in samples if s[5] is not None)
        lead = result["leader"].get(kind, [])
        ok = [s for s in lead if s[5] is None]
        mem = result["memory"].get(kind, {})
        rows[kind] = {
            "n": len(lead) or 1,
            "p50": pct(lat, 0.5),
            "p99": pct(lat, 0.99),
            "max": max(lat, default=float("nan")),
            "failed": failed,
            "decide": max((s[2] for s in ok), default=float("nan")),
            "cpu0": max((s[6] for s in ok), default=float("nan")),
            "leader_wall": max((s[1] for s in ok), default=float("nan")),
            "sent": statistics.fmean(s[3] for s in samples) if samples else 0,
            "got": statistics.fmean(s[4] for s in samples) if samples else 0,
            "in0": max((s[4] for s in ok), default=0),
            "peak_mb": mem.get("peak_mb", float("nan")),
        }
    return rows


def steady(result: dict, job: Job) -> dict[str, float]:
    """The steady window: requests per second, server CPU share, bytes per second."""
    windows = result["windows"]
    if not windows:
        return {}
    a = statistics.median(w[0] for w in windows.values())
    b = statistics.median(w[1] for w in windows.values())
    seconds = max(b - a, 1e-9)
    ops: dict[str, int] = {}
    for w in windows.values():
        for op, n in w[3].items():
            ops[op] = ops.get(op, 0) + n
    total = sum(ops.values())
    return {
        "seconds": seconds,
        "req_s": total / seconds,
        "ops_s": {op: n / seconds for op, n in sorted(ops.items())},
        "server_cpu": (job.watch.cpu_at(b) - job.watch.cpu_at(a)) / seconds,
        "out_Bps": sum(w[4] for w in windows.values()) / seconds,
        "in_Bps": sum(w[5] for w in windows.values()) / seconds,
        "per_rank_req_s": total / seconds / len(windows),
    }


def incident_times(result: dict, level: str, since: str) -> dict[str, float]:
    """Seconds from the incident (``since`` mark) to each rank's first ``level`` log line."""
    marks = result["marks"]
    onset = min((m[since] for m in marks.values() if since in m), default=None)
    if onset is None:
        return {}
    times = [
        t - onset
        for key, t in result["first_log"].items()
        if key.endswith(f":{level}") and t >= onset
    ]
    exits = [m["exit"] - onset for m in marks.values() if "exit" in m]
    return {
        "reported": len(times),
        "first": min(times, default=float("nan")),
        "p50": pct(times, 0.5),
        "all": max(times, default=float("nan")),
        "exited": len(exits),
        "exit_all": max(exits, default=float("nan")),
    }


def per_request_cost(job: Job, count: int = 20000) -> dict[str, float]:
    """The store's CPU per request, each kind alone, with every rank's connection open and idle.

    One client (the coordinator's) sends ``count`` requests of each kind, one at a time,
    as a rank's thread does; the server process's CPU time over them, divided by
    ``count``. Payloads are a status's size (1 KB). Measured here, without the clients'
    contention, it prices the requests a job's ranks make at rankguard's periods.
    """
    from datetime import timedelta

    import torch.distributed as dist

    client = dist.TCPStore(
        job.config["host"],
        job.config["port"],
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    payload = b"x" * 1024
    keys = [f"cost/{i}" for i in range(count)]

    def timed(fn: Any) -> float:
        a = job.watch.read()
        fn()
        b = job.watch.read()
        return (b[0] - a[0]) / count if a and b else float("nan")

    out = {
        # A set is not answered: the check after them returns once the server did them all.
        "set": timed(lambda: ([client.set(k, payload) for k in keys], client.check(keys[-1:]))),
        "multi_get": timed(lambda: [client.multi_get([k]) for k in keys]),
        "add": timed(lambda: [client.add("cost/n", 1) for _ in keys]),
        "delete_key": timed(lambda: [client.delete_key(k) for k in keys]),
    }
    out["connections"] = job.world
    return out


def default_rates(world: int) -> dict[str, float]:
    """Requests a second, job-wide, that ``RankGuard()``'s periods ask of the store in steady state.

    A status exchange and an interval exchange: a set, a multi_get and a delete_key on
    each rank but 0 (rank 0's own differ by one, negligible); the watchdog's poll: one
    add at most every ``spread_period(0, world, POLLS_PER_S)``, and no more often than its
    wake while training goes on (2 s).
    """
    from rankguard.callbacks.core import background_exchange as bx

    try:
        from rankguard.callbacks.core.side_channel import POLLS_PER_S, spread_period
    except ImportError:  # a checkout before the polls were spread
        return {}
    interval_s = getattr(bx, "auto_interval_s", lambda w: bx.AUTO_INTERVAL_S)(world)
    exchanges = world * (1 / status_period(world) + 1 / interval_s)
    poll_s = max(2.0, spread_period(0.0, world, POLLS_PER_S))
    return {
        "set": exchanges,
        "multi_get": exchanges,
        "delete_key": exchanges,
        "add": world / poll_s,
    }


def status_period(world: int) -> float:
    """The status exchange's period the watchdog takes by default at ``world`` ranks."""
    try:
        from rankguard.callbacks.core.side_channel import spread_period
        from rankguard.callbacks.hang.watchdog_settings import STATUS_RANKS_PER_S
    except ImportError:  # a checkout before the period grew with the world
        return 10.0
    return spread_period(10.0, world, STATUS_RANKS_PER_S)


class PhaseIncomplete(RuntimeError):
    """A phase's limit passed before every rank finished it: the ranks after it would not start."""


def measure(
    world: int,
    args: argparse.Namespace,
    folder: Path,
    record: Any,
    payloads: list,
    largest: bool,
    out: dict[str, Any],
    saved: Any = None,
) -> dict:
    """Runs every phase at ``world`` ranks, filling ``out`` (``saved()`` after each phase)."""
    from rankguard.callbacks.core import background_exchange as bx

    period = status_period(world)
    interval_s = getattr(bx, "auto_interval_s", lambda w: bx.AUTO_INTERVAL_S)(world)
    out["world"] = world
    started = time.time()
    job = Job(world, args, folder, record, payloads)
    job.saved = saved
    job.out = out
    try:
        out["connect"] = job.run("connect", limit_s=300)
        out["per_request"] = per_request_cost(job)
        if saved is not None:
            saved()
        if args.cost_only:
            out["seconds"] = time.time() - started
            return out
        out["fit_start"] = job.run("fit_start", limit_s=600)
        m = args.steady_periods
        plan = {
            "status_period_s": period,
            "interval_s": interval_s,
            "intervals": True,
            "window_from": 2,
            "window_to": 2 + m,
            "save_at": 2 + m,
            "end_at": 3 + m,
        }
        out["watchdog"] = job.run("run_watchdog", (plan,), limit_s=(m + 12) * period + 120)
        out["steady"] = steady(out["watchdog"], job)
        out["resume"] = job.run("resume", limit_s=300)
        if largest and args.incidents:
            # Each incident ends every rank (exit 75, then 70): a fit of its own, a new channel.
            job.run("set_watchdog", (INCIDENT_WATCHDOG,), limit_s=60)
            victim = world // 2 + 3
            base = {"status_period_s": period, "interval_s": interval_s, "intervals": True}
            job.run("new_channel", (2,), limit_s=60)
            out["stall"] = job.run(
                "run_watchdog",
                ({**base, "stall_at": 2, "victim": victim},),
                limit_s=8 * period + 120,
            )
            job.run("new_channel", (3,), limit_s=60)
            out["raise"] = job.run(
                "run_watchdog",
                ({**base, "raise_at": 2, "victim": victim},),
                limit_s=6 * period + 120,
            )
        if largest and args.store_faults:
            job.run("new_channel", (4,), limit_s=60)
            plan = {"status_period_s": period, "interval_s": interval_s, "intervals": True}
            start_at, finish = job.run_async("run_watchdog", (plan,), limit_s=240)
            time.sleep(max(0.0, start_at + 1.5 * period - time.time()))
            slow_at = time.time()
            job.signal_server(signal.SIGSTOP)
            time.sleep(args.slow_s)
            job.signal_server(signal.SIGCONT)
            time.sleep(1.5 * period)
            gone_at = time.time()
            job.signal_server(signal.SIGKILL)
            job.halt()
            faults = finish()
            faults["slow_at"], faults["gone_at"] = slow_at, gone_at
            out["store_faults"] = faults
    finally:
        job.close()
    out["seconds"] = time.time() - started
    return out


def ms(x: float) -> str:
    return "-" if x != x else f"{1000 * x:,.0f}" if x >= 0.01 else f"{1000 * x:.1f}"


def report(runs: dict[int, dict], args: argparse.Namespace) -> None:
    sizes = sorted(runs)
    print(
        "\n== steady state: the watchdog's loop and the interval exchange, RankGuard() defaults =="
    )
    print(
        f"{'ranks':>6} | {'req/s':>8} {'per rank':>8} | {'server CPU':>10} {'budget':>7} | "
        f"{'client CPU':>10} | {'in MB/s':>7} {'out MB/s':>8} | requests by kind (/s)"
    )
    for world in sizes:
        s = runs[world].get("steady") or {}
        if not s:
            print(f"{world:>6} | (no steady window)")
            continue
        wd = runs[world]["watchdog"]
        client = wd["client_cpu_s"] / max(wd["wall_s"], 1e-9)
        budget = f"{STEADY_CPU_BUDGET:.0%}" if world >= 16384 else ""
        kinds = ", ".join(f"{op} {n:,.0f}" for op, n in s["ops_s"].items())
        print(
            f"{world:>6} | {s['req_s']:>8,.0f} {s['per_rank_req_s']:>8.2f} | "
            f"{s['server_cpu']:>10.1%} {budget:>7} | {client:>9.0%}  | "
            f"{s['in_Bps'] / 1e6:>7.2f} {s['out_Bps'] / 1e6:>8.2f} | {kinds}"
        )
    print(
        "\n== the store's CPU per request, alone (one client, every rank's connection open), "
        "and rankguard's steady load at its defaults' periods (that cost x the requests the "
        "defaults ask for: a status and an interval exchange 3 each a rank, a poll 1) =="
    )
    for world in sizes:
        cost = runs[world].get("per_request")
        if not cost:
            continue
        rates = default_rates(world)
        load = sum(cost[op] * n for op, n in rates.items())
        budget = f" (budget {STEADY_CPU_BUDGET:.0%})" if world >= 16384 else ""
        kinds = ("set", "multi_get", "add", "delete_key")
        each = ", ".join(f"{op} {1e6 * cost[op]:.0f} us" for op in kinds)
        asks = ", ".join(f"{op} {n:,.0f}/s" for op, n in rates.items())
        print(f"{world:>6} | {each} | defaults ask {asks} | load {load:.1%}{budget}")
    print(
        f"\n== each exchange: latency on the other ranks (p50/p99, ms); on rank 0 its reading and "
        f"deciding (budget {DECISION_BUDGET_S:g} s), its thread's CPU in the whole exchange, the "
        f"exchange's wall time and the decision's memory; bytes a rank sent and got, rank 0 got =="
    )
    print(
        f"{'ranks':>6} {'exchange':<38} {'n':>3} | {'p50':>7} {'p99':>7} {'fail':>4} | "
        f"{'decide':>7} {'cpu':>6} {'wall':>7} {'mem MB':>7} | {'sent':>7} {'got':>7} "
        f"{'in, r0':>11}"
    )
    for world in sizes:
        for phase in ("fit_start", "watchdog", "resume"):
            res = runs[world].get(phase)
            if not res:
                continue
            for kind, r in sorted(exchange_rows(res).items()):
                latency = f"{ms(r['p50']):>7} {ms(r['p99']):>7} {r['failed']:>4}"
                rank0 = (
                    f"{ms(r['decide']):>7} {ms(r['cpu0']):>6} {ms(r['leader_wall']):>7} "
                    f"{r['peak_mb']:>7.1f}"
                )
                sizes_ = f"{r['sent']:>7,.0f} {r['got']:>7,.0f} {r['in0']:>11,.0f}"
                print(f"{world:>6} {kind[:38]:<38} {r['n']:>3} | {latency} | {rank0} | {sizes_}")
    print("\n== phases: wall (all ranks), server CPU, store requests, errors ==")
    for world in sizes:
        phases = ("connect", "fit_start", "watchdog", "resume", "stall", "raise", "store_faults")
        for phase in phases:
            res = runs[world].get(phase)
            if not res:
                continue
            reqs = sum(res["requests"].values())
            errors = "; ".join(f"{n} x {e}" for e, n in res["errors"].items()) or "none"
            done = f"{res['finished']}/{res['ranks']} ranks done"
            print(
                f"{world:>6} {phase:<13} wall {res['wall_s']:7.1f} s, server CPU "
                f"{res['server_cpu_s']:6.2f} s, server RSS {res['server_rss'] / 2**20:6.0f} MB, "
                f"{reqs:>9,} requests, {done}; errors: {errors}"
            )
        print(f"{world:>6} (all)         {runs[world].get('seconds', 0):.0f} s")
        if "broke" in runs[world]:
            print(f"{world:>6} stopped there: {runs[world]['broke']}")
    for world in sizes:
        run = runs[world]
        if "stall" in run:
            st = incident_times(run["stall"], "ERROR", "stall")
            print(f"\n== incidents at {world} ranks ==")
            print(
                f"stall (a rank in its own code, the others in all_reduce; ceiling "
                f"{INCIDENT_WATCHDOG['timeout_s']:g} s, status every {status_period(world):g} s): "
                f"{st.get('reported', 0)} ranks reported; from the stall: first "
                f"{st.get('first', 0):.1f} s, p50 {st.get('p50', 0):.1f} s, every rank "
                f"{st.get('all', 0):.1f} s; {st.get('exited', 0)} at their exit, the last "
                f"{st.get('exit_all', 0):.1f} s after"
            )
            print_logs(run["stall"], "logged (level | message template | lines)")
        if "raise" in run:
            rs = incident_times(run["raise"], "ERROR", "raise")
            print(
                f"raise: {rs.get('reported', 0)} ranks reported; from its publication: first "
                f"{rs.get('first', 0):.1f} s, p50 {rs.get('p50', 0):.1f} s, every rank "
                f"{rs.get('all', 0):.1f} s; {rs.get('exited', 0)} ranks at their exit, the last "
                f"{rs.get('exit_all', 0):.1f} s after"
            )
            print_logs(run["raise"], "logged (level | message template | lines)")
        if "store_faults" in run:
            f = run["store_faults"]
            print(
                f"\n== the store's faults at {world} ranks: stopped {args.slow_s:g} s "
                f"(SIGSTOP) at +{f['slow_at'] - f['start']:.0f} s, gone (SIGKILL) at "
                f"+{f['gone_at'] - f['start']:.0f} s =="
            )
            exits = [m["exit"] - f["gone_at"] for m in f["marks"].values() if "exit" in m]
            print(
                f"{len(exits)}/{f['ranks']} ranks ended after the store was gone; the last "
                f"{max(exits, default=float('nan')):.0f} s after"
            )
            print_logs(f, "logged (level | message template | lines)")


def print_logs(result: dict, title: str) -> None:
    print(title)
    for key, (count, example) in sorted(result["logs"].items(), key=lambda kv: -kv[1][0]):
        level, _ = key.split("|", 1)
        print(f"  {level:<7} {count:>6} x {example[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1024,4096,16384", help="world sizes, comma-separated")
    parser.add_argument("--steady-periods", type=int, default=2, help="status periods measured")
    parser.add_argument("--step-s", type=float, default=1.0, help="simulated train step (s)")
    parser.add_argument("--slow-s", type=float, default=10.0, help="how long the store stops")
    parser.add_argument("--no-incidents", dest="incidents", action="store_false")
    parser.add_argument("--no-store-faults", dest="store_faults", action="store_false")
    parser.add_argument(
        "--cost-only",
        action="store_true",
        help="only connect every rank and measure the store's CPU per request",
    )
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="store_load") as tmp:
        folder = Path(tmp)
        shim = numeric_names(folder)
        if shim:
            os.environ["LD_PRELOAD"] = shim
        else:
            print("note: no C compiler: the store's reverse DNS lookups are left on")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        record = record_template(folder)
        import store_load_rank  # the monitors' interval payloads, built once here

        payloads = [payload for payload, _ in store_load_rank.interval_templates()]
        uptime = Path("/proc/loadavg").read_text().split()[:3]
        print(f"store_load: ranks {sizes}, {os.cpu_count()} cores, load average {' '.join(uptime)}")
        runs: dict[int, dict] = {}

        def saved() -> None:
            if args.json:
                Path(args.json).write_text(json.dumps(runs, default=str))

        for world in sizes:
            runs[world] = {}
            begun = time.time()
            try:
                measure(
                    world, args, folder, record, payloads, world == max(sizes), runs[world], saved
                )
            except (PhaseIncomplete, EOFError, OSError) as exc:  # the machine's limit: say where
                runs[world]["broke"] = f"{type(exc).__name__}: {exc}"
                runs[world]["seconds"] = time.time() - begun
                print(f"  {world} ranks: stopped: {runs[world]['broke']}", flush=True)
                saved()
                break
            print(f"  {world} ranks: {runs[world]['seconds']:.0f} s", flush=True)
        report(runs, args)
        saved()


if __name__ == "__main__":
    main()
