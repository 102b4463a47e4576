"""What RankGuard() costs healthy 2-rank training: Composer, Lightning, a loop, the HF Trainer.

Runs interleaved fits with and without ``RankGuard()`` (ABBA order) in one
launch per framework (``torch``: a hand-written DDP loop with
``rankguard.integrations.torch``; ``transformers``: the Hugging Face
``Trainer``) and prints, per framework, what a user pays, each figure beside its
budget and ``OVER`` where it is above it:

* **train thread** (the headline figure): CPU time per step that rankguard takes
  from rank 0's training thread: the adapter's per-step entry points (translation,
  dispatch, every guard's handlers) and the straggler monitor's forward hooks,
  PyTorch's slower call of a hooked module included (measured apart, per call).
  Fit start and end (the one-off checks) are left out. The thread's own CPU clock
  (``time.thread_time``), less the clock's own cost per timed call: other
  processes on the cores do not inflate it. In the steady state, as a long fit
  pays it: what the thread had spent, read past a third of the fit and again near
  its end (900 steps hold an interval exchange of the monitors in that window).
  Budget: 10 us. Beside it, the same over the whole fit, with its one-off costs (the
  first batches' wakes of the watchdog, the straggler monitor's warm-up, the first
  interval's exchange).
* **over floor**: the train thread's figure less the floor's: the same entry points
  timed the same way in a fit with an empty callback of the framework in rankguard's
  place (a loop: a wrapper making the loop's two calls a batch to methods that do
  nothing). A framework calls every callback at each of its events (Composer about 13
  times a batch) and the first code to run after the forward or the backward runs on
  a cold cache; the floor is what any callback pays for that (over its whole fit: an
  empty callback has no one-off costs). Budget: 10 us.
* **background**: CPU time per step of rankguard's own threads (the hang
  watchdog, the interval exchange) in the steady state: each thread's clock read
  from another thread (``time.pthread_getcpuclockid``) past a third of the fit and
  again near its end, in all and by thread. Budget: 10 us. Beside it, the same
  over the whole fit (each thread's clock read when it ends), whose one-off costs
  (thread starts, store connections, the first and last exchanges) a short fit
  spreads thin enough to show; a real fit's thousands of steps do not.
* **ratio**: median wall time of the fits with rankguard over those without, and
  the run-to-run spread of every fit without rankguard (max - min over the median
  of those without): the fits without a callback and the floor's fits, whose
  empty callback costs at most 0.1% of these steps (two fits alone give a spread that
  is often near zero by chance). Budget: the ratio within 1 + spread. On a
  2-core machine running 2 ranks, that spread is several percent: the CPU figures
  are the ones to compare.

``--profile DIR`` profiles rank 0's training thread instead (cProfile, one fit
with and one without rankguard per framework, ``DIR/<framework>-with.prof``) and
prints rankguard's top entries: own time plus time in the non-rankguard functions
they call (cProfile's cost per call inflates them; read them as proportions).

``--collectives`` measures the record of collectives instead (``hang/collectives.py``): 2
gloo ranks, a loop of ``--per-step`` (128) small collectives a step (async ``all_reduce``
on a side group, waited for, as a metric flush does, plus a barrier), fits with the
record off and on in ABBA order; rank 0's training-thread CPU time per collective and
per step, and the record alone (its wrapper around a collective that does nothing, timed
100,000 times); what the record adds to each DDP forward (the group's count before it, the
mark after it), and its wrapper under FSDP2's hooks (the frames that say what issued a
collective, the module's name). Budget: 2 us per collective, a few percent of a small gloo
collective's own CPU time (the step's own work is on top).

``--metric-flush`` measures the check of metric names before OLMo-core's flush
(``hang/metric_reductions.py``): 2 gloo ranks on a TCP store, each flush holding
``--interval`` (5, OLMo-core's default) steps of 30 metrics with a reduce type; OLMo-core's
own reduction of them (two ``all_reduce``, as ``reduce_metrics`` does) with and without the
check (the rows, their digest, one store exchange), in ABBA order. Wall time per flush on
the training thread, where the check runs. Budget: 2 ms per flush, the exchange's three
store round trips on a loaded machine: under 0.5% of OLMo-core's steps (0.1 s and up on a
GPU) at one flush every 5 steps.

``--trees BEFORE,AFTER`` measures two git revisions' ``rankguard`` package with this tree's
job, in launches of ABBA order (the machine's speed drifts over minutes; interleaved, both
trees share it), and prints each one's figures.

Usage: ``python benchmarks/overhead.py [--rounds 2] [--steps 900] [--frameworks composer,torch]``
(about 8 minutes on 2 cores); ``--trees main~3,main`` (four launches per framework);
``python benchmarks/overhead.py --collectives [--steps 300]``;
``python benchmarks/overhead.py --metric-flush [--steps 300]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_framework(
    framework: str,
    rounds: int,
    steps: int,
    config: str = "{}",
    profile: str | None = None,
    src: Path = ROOT / "src",
) -> dict:
    """Runs one framework's job (2 ranks) and returns what rank 0 measured.

    ``src``: the ``rankguard`` package measured (this tree's; ``--trees``: a commit's).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        job = [str(HERE / "overhead_job.py"), framework, str(rounds), str(steps), str(out)]
        bin_dir = Path(sys.executable).parent
        if framework == "composer":
            cmd = [str(bin_dir / "composer"), "-n", "2", *job]
        elif framework in ("torch", "transformers"):
            cmd = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", *job]
        else:
            cmd = [sys.executable, *job]
        # This tree's own package first: an editable install may point at another checkout.
        path = os.pathsep.join((str(src), str(ROOT)))
        env = {**os.environ, "PYTHONPATH": path, "RANKGUARD_BENCH_CONFIG": config}
        if profile:
            Path(profile).mkdir(parents=True, exist_ok=True)
            env["RANKGUARD_BENCH_PROFILE"] = str(Path(profile).resolve())
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(
                f"{framework} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


#: What the floor is in each framework's fit (``overhead_job.py``'s ``floor`` mode).
FLOOR = {
    "composer": "Composer callback",
    "lightning": "Lightning callback",
    "transformers": "TrainerCallback",
    "torch": "wrapper making the loop's 2 calls a batch",
}

#: Per-step budgets (microseconds of CPU) of the training thread and of rankguard's threads.
TRAIN_BUDGET_US = BACKGROUND_BUDGET_US = 10.0


def budget(value: float, limit: float) -> str:
    """``value`` beside its budget, ``OVER`` when above it."""
    return f"{value:6.1f} us (budget {limit:.0f}){'  OVER' if value > limit else ''}"


def train_figures(
    adapter_s: float, hooks_s: float, hook_calls: float, hook_dispatch_s: float
) -> tuple[float, float, float, float]:
    """Per step, in us: adapter, hooks, PyTorch's hooked-call path; and hooked calls."""
    return 1e6 * adapter_s, 1e6 * hooks_s, 1e6 * hook_dispatch_s * hook_calls, hook_calls


def _listed(figures: list[float]) -> str:
    """Each fit's figure, in us, as the output lists them."""
    return ", ".join(f"{us:.1f}" for us in figures)


def report(framework: str, t: dict) -> None:
    """Prints one framework's figures beside their budgets."""
    steps = t["steps"]
    without, with_ = statistics.median(t["without"]), statistics.median(t["with"])
    ratio = with_ / without
    # Every fit without rankguard: those without a callback and those with the empty one
    # (the floor's; its calls cost at most 0.1% of these steps).
    quiet = t["without"] + t.get("floor_s", [])
    spread = (max(quiet) - min(quiet)) / without if len(quiet) > 1 else 0.0
    dispatch_s = t["hook_dispatch_s"][0]
    whole = train_figures(
        statistics.median(t["adapter"]) / steps,
        statistics.median(t["hooks"]) / steps,
        statistics.median(t["hook_calls"]) / steps,
        dispatch_s,
    )
    runs = [fit for fit in t.get("steady_train", []) if fit]
    steady_train = (
        train_figures(
            statistics.median(fit["adapter"] for fit in runs),
            statistics.median(fit["hooks"] for fit in runs),
            statistics.median(fit["hook_calls"] for fit in runs),
            dispatch_s,
        )
        if runs
        else None
    )
    adapter, hooks, dispatch, hooked = steady_train or whole
    train = adapter + hooks + dispatch
    background = 1e6 * statistics.median(t["background"]) / steps
    steady_fits = [1e6 * sum(fit.values()) for fit in t.get("steady", [])]  # each fit's
    steady = statistics.median(steady_fits) if steady_fits else None
    floor = 1e6 * statistics.median(t["floor"]) / steps if t.get("floor") else None
    over = "  OVER" if ratio > 1 + spread else ""
    print(f"{framework:<12} {steps:>5} {1000 * without / steps:>8.1f}")
    train_fits = [
        sum(train_figures(fit["adapter"], fit["hooks"], fit["hook_calls"], dispatch_s)[:3])
        for fit in runs
    ]
    state = f", steady state (median of fits {_listed(train_fits)})" if steady_train else ""
    print(f"  train thread: {budget(train, TRAIN_BUDGET_US)}  per step{state}")
    print(
        f"    adapter + dispatch + guards {adapter:.1f} us; forward hooks {hooks:.1f} us + "
        f"PyTorch's hooked-call path {dispatch:.1f} us ({hooked:.2f} hooked calls per step)"
    )
    if steady_train:
        whole_train = sum(whole[:3])
        print(
            f"    from a third of the fit to its end; {whole_train:.1f} us a step over the whole "
            f"fit, with its one-off costs ({1e-3 * steps * (whole_train - train):.1f} ms a fit: "
            "the first batches' wakes of the watchdog, the straggler monitor's warm-up, the "
            "first interval's exchange)"
        )
    if floor is not None:
        print(f"  over floor:   {budget(train - floor, TRAIN_BUDGET_US)}  per step")
        print(f"    floor: an empty {FLOOR[framework]}, timed the same way: {floor:.1f} us")
    if steady is None:
        print(f"  background:   {budget(background, BACKGROUND_BUDGET_US)}  per step")
    else:
        print(
            f"  background:   {budget(steady, BACKGROUND_BUDGET_US)}  per step, steady state "
            f"(median of fits {_listed(steady_fits)})"
        )
        names = sorted({name for fit in t["steady"] for name in fit})
        print(
            "    by thread: "
            + ", ".join(
                f"{name} {1e6 * statistics.median(fit.get(name, 0.0) for fit in t['steady']):.1f}"
                for name in names
            )
        )
        print(
            f"    from a third of the fit to its end; {background:.1f} us a step over the whole "
            f"fit, with its one-off costs ({1e-3 * steps * (background - steady):.1f} ms a fit: "
            "threads, store connections, the first and last exchanges)"
        )
    print(
        f"  ratio:        {ratio:.3f} (budget 1 + spread {spread:.3f}){over}  "
        f"fits without {[round(x, 2) for x in t['without']]} s, with "
        f"{[round(x, 2) for x in t['with']]} s"
        + (
            f", with the empty callback {[round(x, 2) for x in t['floor_s']]} s"
            if t.get("floor_s")
            else ""
        )
    )


def export_src(revision: str, into: Path) -> Path:
    """The ``src/`` folder of git ``revision`` of this repository, written under ``into``."""
    folder = into / revision.replace("/", "_")
    folder.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", revision, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def merged(runs: list[dict]) -> dict:
    """One framework's measurements of several launches of the same tree, as one launch's."""
    first = runs[0]
    return {
        key: [x for run in runs for x in run[key]] if isinstance(value, list) else value
        for key, value in first.items()
    }


def compare_trees(framework: str, revisions: list[str], args: argparse.Namespace) -> None:
    """Two commits' package in ABBA order of launches, this tree's job: each one's figures.

    The machine's speed drifts over minutes (an empty Composer callback's floor has
    moved by a quarter in 17); launches of the two trees interleaved share the drift.
    """
    with tempfile.TemporaryDirectory() as tmp:
        srcs = {rev: export_src(rev, Path(tmp)) for rev in revisions}
        a, b = revisions
        runs: dict[str, list[dict]] = {a: [], b: []}
        for rev in (a, b, b, a):
            runs[rev].append(
                run_framework(framework, args.rounds, args.steps, args.config, None, srcs[rev])
            )
    for rev in revisions:
        print(f"-- {rev}")
        report(framework, merged(runs[rev]))


def print_profile(path: Path, steps: int, top: int = 12) -> None:
    """Prints rankguard's top functions in a profile: own time plus non-rankguard callees.

    The training loop, where rankguard calls it, and the user's loader are not counted.
    """
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    ours = os.path.join(str(ROOT), "src", "rankguard", "")

    def is_ours(fn: tuple) -> bool:  # rankguard's package, not a framework's callbacks/
        return fn[0].startswith(ours)

    # The framework's own loop where rankguard calls it (the HF Trainer's ``train``, behind
    # the wrapper that reads its resume argument): the functions above rankguard's per-step
    # entry points (called every step), found through their callers (not through builtins,
    # which every caller shares).
    loop, frontier = set(), [fn for fn in stats if is_ours(fn) and stats[fn][1] >= steps]
    while frontier:
        for caller in stats[frontier.pop()][4]:
            if not is_ours(caller) and caller[0] != "~" and caller not in loop:
                loop.add(caller)
                frontier.append(caller)
    spent: dict[tuple, float] = {}
    for fn, (_, _, own, _, callers) in stats.items():
        if is_ours(fn):
            spent[fn] = spent.get(fn, 0.0) + own
            continue
        if fn in loop or fn[2] == "<built-in method builtins.next>":  # or the user's loader
            continue
        for caller, (_, _, _, cumulative) in callers.items():
            if is_ours(caller):
                spent[caller] = spent.get(caller, 0.0) + cumulative
    print(f"  profile {path.name}: {1e6 * sum(spent.values()) / steps:.1f} us/step in rankguard")
    for fn, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:top]:
        where = "/".join(Path(fn[0]).parts[-2:])
        calls = stats[fn][1]
        print(
            f"    {1e6 * seconds / steps:8.1f} us/step {calls:>6} calls  {where}:{fn[1]}({fn[2]})"
        )


def _collective_rank(rank: int, init: str, rounds: int, steps: int, per_step: int, out: str):
    """One rank of ``--collectives``: CPU time of the loop with the record off and on."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from rankguard.callbacks.hang.collectives import CollectiveRecorder
    from rankguard.callbacks.hang.stacks import library_paths

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    side = dist.new_group(backend="gloo")
    metric = torch.ones(1)

    def fit() -> float:
        start = time.thread_time()
        for _ in range(steps):
            works = [
                dist.all_reduce(metric, group=side, async_op=True) for _ in range(per_step - 1)
            ]
            for work in works:
                work.wait()
            dist.barrier()
        return time.thread_time() - start

    def wrapper_alone(recorder: CollectiveRecorder, calls: int = 100_000) -> float:
        """The record's own cost: its wrapper around a collective that does nothing."""
        wrapped = recorder._wrap("all_reduce", lambda *a, **k: None, "tensor")
        start = time.thread_time()
        for _ in range(calls):
            wrapped(metric, group=side, async_op=True)
        return (time.thread_time() - start) / calls

    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))

    def mark_alone(recorder: CollectiveRecorder, calls: int = 50_000) -> float:
        """What the record adds to each DDP forward: the count before it, the mark after it."""
        start = time.thread_time()
        for _ in range(calls):
            recorder._mark_forward(ddp, recorder._count_of(ddp.process_group))
        return (time.thread_time() - start) / calls

    under_fsdp = _under_fsdp_hooks()

    def fsdp_alone(recorder: CollectiveRecorder, calls: int = 50_000) -> float:
        """The wrapper under FSDP2's hooks (a forward's unshard): the frames say what issued it."""
        wrapped = recorder._wrap("all_gather_into_tensor", lambda *a, **k: None, "input_tensor")
        start = time.thread_time()
        for _ in range(calls):
            under_fsdp(lambda: wrapped(metric, metric, group=side, async_op=True))
        return (time.thread_time() - start) / calls

    times: dict[str, list[float]] = {"off": [], "on": [], "wrapper": [], "mark": [], "fsdp": []}
    with tempfile.TemporaryDirectory() as reports:
        for kind in ["off", "on", "on", "off"] * rounds:
            recorder = CollectiveRecorder(reports, rank, library_paths())
            if kind == "on":
                recorder.install()
            times[kind].append(fit())
            if kind == "on":
                times["wrapper"].append(wrapper_alone(recorder))
                times["mark"].append(mark_alone(recorder))
                times["fsdp"].append(fsdp_alone(recorder))
            recorder.close(keep=False)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _under_fsdp_hooks():
    """A call made under FSDP2's ``pre_forward`` and ``unshard``, as torch's frames name them.

    The functions are compiled under the file name of torch's FSDP2 parameter group, so the
    record's walk meets frames of the roles a real all-gather has (``collective_sources``).
    """
    import torch

    path = os.path.join(
        os.path.dirname(torch.__file__),
        "distributed",
        "fsdp",
        "_fully_shard",
        "_fsdp_param_group.py",
    )
    source = (
        "class FSDPParamGroup:\n"
        "    _module_fqn = 'layers.0'\n"
        "    def pre_forward(self, call):\n"
        "        return self.unshard(call)\n"
        "    def unshard(self, call):\n"
        "        return call()\n"
    )
    scope: dict = {}
    exec(compile(source, path, "exec"), scope)
    return scope["FSDPParamGroup"]().pre_forward


def _two_ranks(target, rendezvous, *args) -> dict:
    """Runs ``target(rank, *rendezvous(tmp), *args, out)`` on 2 spawned ranks; rank 0's JSON."""
    import multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        ctx = mp.get_context("spawn")
        full = (*rendezvous(tmp), *args, out)
        procs = [ctx.Process(target=target, args=(r, *full)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=1200)
        return json.loads(Path(out).read_text())


def collective_cost(rounds: int, steps: int, per_step: int) -> None:
    """``--collectives``: prints the record's cost per collective and per step (rank 0)."""
    times = _two_ranks(
        _collective_rank, lambda tmp: (str(Path(tmp) / "init"),), rounds, steps, per_step
    )
    calls = steps * per_step
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"collectives: {steps} steps of {per_step} (async all_reduce + barrier), 2 gloo ranks")
    for kind in ("off", "on"):
        fits = _listed([1e6 * t / calls for t in times[kind]])
        print(f"  record {kind:<3}: {fits} us of training-thread CPU per collective")
    print(f"  difference of the medians: {1e6 * (on - off) / calls:.2f} us per collective")
    alone = 1e6 * statistics.median(times["wrapper"])
    mark, fsdp = (1e6 * statistics.median(times[k]) for k in ("mark", "fsdp"))
    print(
        f"  the record alone: {budget(alone, 2.0)} per collective; {alone * per_step:.0f} us "
        f"per step of {per_step}, {100 * alone / (1e6 * off / calls):.0f}% of a collective's "
        "own CPU time"
    )
    print(
        f"  a DDP forward's mark (the count before it, a slot after it): {mark:.1f} us per "
        f"forward; a collective under FSDP2's hooks (its origin from the frames): "
        f"{budget(fsdp, 2.0)}"
    )


def _flush_rank(rank: int, port: int, rounds: int, flushes: int, interval: int, out: str):
    """One rank of ``--metric-flush``: wall time per flush, checked and not."""
    import time

    import torch
    import torch.distributed as dist

    from rankguard.callbacks.core.side_channel import SideChannel
    from rankguard.callbacks.hang.metric_reductions import ReductionCheck, reduction_rows

    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    names = [f"train/metric {i}" for i in range(30)]
    types = {name: ("max" if i % 3 == 0 else "mean") for i, name in enumerate(names)}
    channel = SideChannel.from_environment(timeout_s=60)
    check = ReductionCheck(channel, name="flush", where="the flush", fix="-")

    def flush(step: int, checked: bool) -> None:
        metrics = {s: dict.fromkeys(names, torch.ones(())) for s in range(step, step + interval)}
        if checked:
            check.check(reduction_rows(metrics, types))
        sums = torch.ones(interval, 20)
        maxes = torch.ones(interval, 10)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)

    times: dict[str, list[float]] = {"off": [], "on": [], "rows": []}
    for kind in ["off", "on", "on", "off"] * rounds:
        dist.barrier()
        start = time.perf_counter()
        for i in range(flushes):
            flush(i * interval, kind == "on")
        times[kind].append((time.perf_counter() - start) / flushes)
    metrics = {s: dict.fromkeys(names, 1.0) for s in range(interval)}
    start = time.perf_counter()
    for _ in range(1000):
        reduction_rows(metrics, types)
    times["rows"].append((time.perf_counter() - start) / 1000)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def metric_flush_cost(rounds: int, flushes: int, interval: int) -> None:
    """``--metric-flush``: prints the check's cost per flush (rank 0)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from launch import free_port

    times = _two_ranks(_flush_rank, lambda tmp: (free_port(),), rounds, flushes, interval)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"metric flush: {flushes} flushes of {interval} steps x 30 metrics, 2 gloo ranks")
    for kind in ("off", "on"):
        print(f"  check {kind:<3}: {_listed([1e3 * t for t in times[kind]])} ms per flush")
    cost = 1e3 * (on - off)
    print(
        f"  the check: {budget(cost * 1e3, 2000.0)} per flush ({cost * 1e3 / interval:.0f} us "
        f"per step at one flush every {interval}); rows and digest alone "
        f"{1e6 * times['rows'][0]:.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--frameworks", default="composer,lightning,torch,transformers")
    parser.add_argument(
        "--config",
        default="{}",
        help="RankGuard settings as JSON, e.g. '{\"hang_watchdog\": false}'",
    )
    parser.add_argument("--profile", metavar="DIR", help="profile rank 0's training thread")
    parser.add_argument("--collectives", action="store_true", help="the record's cost")
    parser.add_argument("--per-step", type=int, default=128, help="collectives a step")
    parser.add_argument("--metric-flush", action="store_true", help="the flush check's cost")
    parser.add_argument("--interval", type=int, default=5, help="steps a metric flush holds")
    parser.add_argument(
        "--trees",
        metavar="REV,REV",
        help="two git revisions' package, launches in ABBA order (a change's before and after)",
    )
    args = parser.parse_args()
    if args.trees:
        revisions = args.trees.split(",")
        if len(revisions) != 2:
            parser.error("--trees takes two revisions, e.g. --trees main~3,main")
        for framework in args.frameworks.split(","):
            compare_trees(framework, revisions, args)
        return
    if args.metric_flush:
        metric_flush_cost(args.rounds, min(args.steps, 300), args.interval)
        return
    if args.collectives:
        collective_cost(args.rounds, min(args.steps, 300), args.per_step)
        return
    print(f"{'framework':<12} {'steps':>5} {'ms/step':>8}")
    for framework in args.frameworks.split(","):
        t = run_framework(framework, args.rounds, args.steps, args.config, args.profile)
        if not args.profile:
            report(framework, t)
            continue
        print(f"{framework:<12} {t['steps']:>5}")
        for kind in ("with", "without"):
            print_profile(Path(args.profile).resolve() / f"{framework}-{kind}.prof", t["steps"])


if __name__ == "__main__":
    main()
