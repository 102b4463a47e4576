"""Time from a hang to its report, with rankguard's defaults, with short deadlines, and without.

Each scenario is a plain 2-rank ``torch.distributed`` job (gloo on CPU,
``env://`` rendezvous hosted by rank 0, as under Composer's launcher and
Lightning) training a DDP model with steps of ~50 ms, in epochs of 60 steps
each ending in an eval (4 batches and a metric ``all_reduce``). rankguard's
core guards run behind a ``GuardRunner`` fed the same events (and loader,
model and optimizer facts) the Composer and Lightning adapters send
(``tests/frameworks/test_hang_e2e.py`` covers the real trainers). Rank 1 hangs:

- ``post-eval stall``: blocks in a hook right after the first eval (rank 0
  goes on to the next epoch and waits in ``BatchParityGuard``'s epoch-start
  check, the field report of the MosaicBERT run);
- ``mid-eval stall``: blocks inside batch 2 of the first eval (rank 0 waits
  in the metric all-reduce);
- ``train-step stall``: blocks inside train step 30 (rank 0 waits in DDP's
  gradient all-reduce, inside autograd's backward);
- ``unmatched collective``: after the first eval, calls an ``all_reduce`` on
  a second group that rank 0 never calls;
- ``frozen rank``: its whole process stops (SIGSTOP) after train step 90
  (after the first eval), watchdog thread included;
- ``desync: rank-0 collective`` (the loop): after the first eval, rank 0
  alone calls an ``all_reduce`` (``if rank == 0:``); rank 1 goes on and waits
  in DDP's backward or rankguard's epoch-start check: a proven deadlock,
  ended at once with exit code 70. Here rank 0 hangs; "stack" reads its file;
- ``FSDP2: extra forward`` (``fsdp_uneven_forward``): the model is a 2-block MLP
  sharded with FSDP2 (``fully_shard`` per block, then the root) instead of DDP;
  after the first eval rank 1 alone runs a debug forward on a fixed batch, so
  FSDP2's parameter all-gathers inside that forward are issued on rank 1 only.
  Where rank 0 waits in a rankguard check (``defaults``: the epoch-start check)
  the all-gather stays unmatched: a proven deadlock, 70. Where rank 0 goes
  straight on (``short``, ``none``), gloo pairs rank 1's all-gathers with those
  of rank 0's next forward and backward, whose sizes differ: gloo aborts.

``--frameworks`` adds "desync" rows from the real trainers' test jobs, one per
tracker case, every watchdog setting at its default: in Composer (``composer
-n 2``) and Lightning (``ddp``) a collective under ``if rank == 0`` at epoch end,
a metric synced on one rank only (Lightning: a key logged with
``sync_dist=True``; Composer: a torchmetrics metric computed on rank 0),
an ``all_gather`` at epoch end on a path rank 1 skips, training stopped on one
rank, a collective save on rank 0 only; the HF Trainer's early stop on one rank
and the loop's rank-0 collective (torchrun). From the split: the first report,
the job's end with each rank's exit code (Lightning: rank 0's), the rank "Next"
names and the user line it names. On gloo a collective left unmatched may pair
with another rank's next one instead of hanging (NCCL would hang); the jobs put
their own collectives on a group of their own, so the rows show the hang.
Two OLMo-core rows (torchrun; the job's quick watchdog settings, which this
check does not depend on): rank 1 alone records a metric with a reduce type at
step 5, after OLMo-core's first flush. With rankguard its check before the next
flush raises ``MetricMismatchError`` on every rank; the job re-raises it
(``E2E_RERAISE=1``), and the report is the first output line "Ranks would
reduce different metrics" (timed as it arrives), naming the rank, the metric
and its step. The same fault without rankguard: gloo aborts at the flush.
``--rows olmo,hf``: only the rows whose label contains one of these words.

Three ways to run each:

- ``defaults``: every guard of ``RankGuard()`` with only ``report_dir`` set:
  calibrated deadlines report (stage 1), the ceiling (600 s on gloo) or a
  check that gives up waiting (``exchange_timeout_s``, 300 s) ends the job;
- ``short``: the HangWatchdog alone with short deadlines (:data:`WATCHDOG`);
- ``none``: no rankguard, watched for ``--cap`` seconds for any rank to exit
  or print an error (gloo's default process-group timeout is 30 minutes).

Rank 1 writes the moment it starts to hang. The report time is the first
hang line a rank logs; the job ends when the ranks exit (75: the watchdog's
abort; -9: killed by the benchmark, the frozen rank or whatever is left at
the end). "stack" says whether rank 1's stack file shows the function it
hangs in. Runs without rankguard and with the defaults run side by side
(after the hang they only wait; starts are staggered); short runs one at a
time. All figures are from a shared machine: indicative.

Usage: ``python benchmarks/detection.py [--cap 60] [--defaults-cap 700] [--modes defaults,short]
[--scenarios frozen_rank,...] [--frameworks | --frameworks-only [--rows olmo-core,...]]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from launch import free_port  # noqa: E402

ROOT = HERE.parent
#: The jobs' path: this checkout's rankguard (src) before any installed one, e.g. an editable
#: install of another checkout whose environment this one shares (as ``tests/mp.py``).
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "src")])
SCENARIOS = {
    "post_eval_stall": "post-eval stall",
    "mid_eval_stall": "mid-eval stall",
    "train_step_stall": "train-step stall",
    "unmatched_collective": "unmatched collective",
    "frozen_rank": "frozen rank",
    "desync_collective": "desync: rank-0 coll.",
    "async_one_rank": "desync: async, 1 rank",
    "metric_reductions": "desync: extra metric",
    "killed_rank": "killed (SIGKILL)",
    "gloo_abort": "gloo size abort",
    "fsdp_uneven_forward": "FSDP2: extra forward",
}
#: Scenarios read back with ``rankguard report`` after the job (the ranks died).
POST_MORTEM = ("killed_rank", "gloo_abort", "fsdp_uneven_forward")
#: The function rank 1 hangs in (its stack file must show it); none for a frozen process.
CULPRITS = {
    "post_eval_stall": "stall",
    "mid_eval_stall": "stall",
    "train_step_stall": "stall",
    "unmatched_collective": "unmatched_all_reduce",
    "frozen_rank": None,
    "desync_collective": "rank0_all_reduce",
    "async_one_rank": "flush_metrics",
    "metric_reductions": "reduce_metrics",
    "killed_rank": None,
    "gloo_abort": None,
    "fsdp_uneven_forward": "debug_forward",
}
#: The rank that hangs first (its stack file is read); rank 1 unless named here.
CULPRIT_RANK = {"desync_collective": 0, "async_one_rank": 0}
WATCHDOG = {
    "timeout_s": 10.0,
    "eval_timeout_s": 10.0,
    "post_eval_timeout_s": 5.0,
    "exchange_period_s": 1.0,
}
DEADLINE_S = {  # the deadline of the phase rank 1 hangs in, short settings
    "post_eval_stall": WATCHDOG["post_eval_timeout_s"],
    "mid_eval_stall": WATCHDOG["eval_timeout_s"],
    "train_step_stall": WATCHDOG["timeout_s"],
    "unmatched_collective": WATCHDOG["post_eval_timeout_s"],
    "frozen_rank": WATCHDOG["timeout_s"],
    "desync_collective": WATCHDOG["post_eval_timeout_s"],
    "async_one_rank": WATCHDOG["timeout_s"],
    "metric_reductions": WATCHDOG["timeout_s"],
    "killed_rank": WATCHDOG["timeout_s"],
    "gloo_abort": WATCHDOG["timeout_s"],
    "fsdp_uneven_forward": WATCHDOG["post_eval_timeout_s"],
}
MODES = ("defaults", "short", "none")
# The freeze comes after status exchanges (every 10 s by default) have seen train steps: a
# rank frozen before any exchange saw it past its first step is held to
# `first_step_timeout_s` (30 min).
EPOCHS, EPOCH_STEPS, FREEZE_AFTER, TRAIN_STALL_AT, STEP_S = 3, 60, 90, 30, 0.05
STARTUP_TIMEOUT_S = 240
STAGGER_S = 15.0  # between the starts of runs side by side
EXIT_GRACE_S = 10.0  # a frozen rank never exits: it is killed (-9) this long after the others
_HANG_LINE = re.compile(
    r"^(\d+\.\d+) .*rankguard hang_watchdog: (Hang suspected|Hang|Deadlock): (.*)$"
)


# -- worker (one rank) -------------------------------------------------------------------


def worker(scenario: str, out: Path, mode: str) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from rankguard.callbacks.core.events import Event, EventFacts, LoaderFacts
    from rankguard.callbacks.core.guard import GuardRunner
    from rankguard.callbacks.hang.hang_watchdog import HangWatchdog
    from rankguard.callbacks.registry import build_guards

    logging.basicConfig(format="%(created).3f %(name)s %(levelname)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    side_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    if scenario == "fsdp_uneven_forward":
        from torch.distributed.fsdp import fully_shard

        # FSDP2 as its docs apply it: each block sharded, then the root.
        net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = module = fully_shard(net)
    else:
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        module = model.module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    reports = str(out / "reports")
    runner = None
    if mode == "defaults":
        runner = GuardRunner(build_guards({"hang_watchdog": {"report_dir": reports}}))
    elif mode == "short":
        runner = GuardRunner([HangWatchdog(report_dir=reports, **WATCHDOG)])

    def loader(batches: int) -> DataLoader:  # what the guards see (never iterated here)
        data = TensorDataset(torch.arange(batches * 8 * world, dtype=torch.float32))
        return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, world, rank))

    train_loader = LoaderFacts("train", loader(EPOCH_STEPS), is_train=True)
    eval_loader = LoaderFacts("eval", loader(4), is_train=False)

    def fire(event: Event, **facts) -> None:
        if runner is not None:
            runner.fire(event, EventFacts(**facts))

    def mark_hang() -> None:
        (out / "hang.json").write_text(json.dumps({"t": time.time()}))

    def stall() -> None:
        mark_hang()
        time.sleep(3600)

    def unmatched_all_reduce() -> None:
        mark_hang()
        dist.all_reduce(torch.ones(1), group=side_group)

    def rank0_all_reduce() -> None:
        # On its own group: on the training group gloo may pair it with rank 1's next one.
        mark_hang()
        dist.all_reduce(torch.ones(1), group=side_group)

    pending: list = []  # async metric reductions issued, waited for at the next flush

    def issue_extra_metric() -> None:
        # Rank 0 alone reduces one more metric, async, on the metrics group (NCCL-style:
        # the call returns at once); it is waited for later, in another function.
        mark_hang()
        pending.append(dist.all_reduce(torch.ones(1), group=side_group, async_op=True))

    def flush_metrics() -> None:
        while pending:
            pending.pop(0).wait()

    def reduce_metrics(names: list[str]) -> None:
        # One async all_reduce per metric this rank recorded, then wait for them all.
        works = [dist.all_reduce(torch.ones(1), group=side_group, async_op=True) for _ in names]
        for work in works:
            work.wait()

    def metric_names(step: int, epoch: int) -> list[str]:
        extra = scenario == "metric_reductions" and rank == 1 and epoch >= 1
        if extra and step == EPOCH_STEPS + 1:
            mark_hang()
        return ["loss", "lr"] + (["grad_norm"] if extra and step > EPOCH_STEPS else [])

    def die(step: int) -> None:
        if scenario == "killed_rank" and rank == 1 and step == EPOCH_STEPS + 1:
            pending.append(dist.all_reduce(torch.ones(1), group=side_group, async_op=True))
            mark_hang()
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer: nothing runs after it
        if scenario == "gloo_abort" and step == EPOCH_STEPS + 1:
            if rank == 1:
                mark_hang()
            # One flush sized by the metric names each rank recorded: rank 1 has one more.
            dist.all_reduce(torch.ones(2 + 256 * rank), group=side_group)

    probe = torch.randn(8, 4)

    def debug_forward(step: int) -> None:
        # A debug metric on one rank: its output on a fixed batch, after the eval. Under
        # FSDP2 this forward all-gathers each block's parameters: rank 1 alone issues them.
        mark_hang()
        with torch.no_grad():
            value = model(probe).mean().item()
        logging.getLogger("debug").info("step %d: probe output %.4f", step, value)

    def evaluate(step: int, epoch: int) -> None:
        fire(Event.EVAL_START, step=step, epoch=epoch, loader=eval_loader)
        total = torch.zeros(1)
        for index in range(4):
            fire(Event.EVAL_BATCH_START, step=step, loader=eval_loader, batch_index=index)
            if scenario == "mid_eval_stall" and rank == 1 and index == 2:
                stall()
            with torch.no_grad():
                total += module(torch.randn(8, 4)).sum()
            time.sleep(STEP_S)
            fire(Event.EVAL_BATCH_END, step=step, loader=eval_loader, batch_index=index)
        dist.all_reduce(total)  # the metric sync
        fire(Event.EVAL_END, step=step, epoch=epoch, loader=eval_loader)
        if rank == 1 and scenario == "post_eval_stall":
            stall()
        if rank == 1 and scenario == "unmatched_collective":
            unmatched_all_reduce()
        if rank == 0 and scenario == "desync_collective" and epoch == 0:
            rank0_all_reduce()
        if rank == 0 and scenario == "async_one_rank" and epoch == 0:
            issue_extra_metric()
        if rank == 1 and scenario == "fsdp_uneven_forward" and epoch == 0:
            debug_forward(step)

    fire(
        Event.FIT_START,
        loaders=[train_loader, eval_loader],
        model=module,
        optimizer=optimizer,
    )
    step = 0
    for epoch in range(EPOCHS):
        fire(Event.EPOCH_START, step=step, epoch=epoch, loader=train_loader)
        for _ in range(EPOCH_STEPS):
            fire(Event.DATA_FETCH_START, step=step, epoch=epoch, loader=train_loader)
            batch = torch.randn(8, 4)
            fire(Event.DATA_FETCH_END, step=step, epoch=epoch)
            fire(Event.TRAIN_BATCH_START, step=step, epoch=epoch)
            if scenario == "train_step_stall" and rank == 1 and step == TRAIN_STALL_AT:
                stall()
            flush_metrics()
            if scenario in ("metric_reductions", "killed_rank", "gloo_abort"):
                reduce_metrics(metric_names(step, epoch))
                die(step)
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(STEP_S)
            step += 1
            fire(Event.TRAIN_BATCH_END, step=step, epoch=epoch)
            if scenario == "frozen_rank" and rank == 1 and step == FREEZE_AFTER:
                mark_hang()
                os.kill(os.getpid(), signal.SIGSTOP)
        evaluate(step, epoch)
    fire(Event.FIT_END, step=step)
    if runner is not None:
        runner.close()


# -- driver ------------------------------------------------------------------------------


def start(scenario: str, out: Path, mode: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": PYTHONPATH,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, __file__, "--worker", scenario, str(out), mode]
        log = open(out / f"rank{rank}.log", "w")  # closed when the process ends
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def watch(procs: list[subprocess.Popen], out: Path, cap_s: float) -> dict:
    """Waits for the hang, then until every rank exits, ``cap_s`` passes, or the ranks left
    have not followed the first one out within EXIT_GRACE_S; kills what is left."""
    started = time.monotonic()
    hang_t = None
    exits: dict[int, float] = {}
    while True:
        now = time.time()
        if hang_t is None and (out / "hang.json").exists():
            try:
                hang_t = json.loads((out / "hang.json").read_text())["t"]
            except ValueError:
                pass  # being written
        for rank, proc in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = now
        if len(exits) == len(procs):
            break
        if exits and now - min(exits.values()) > EXIT_GRACE_S:
            break
        if hang_t is None and time.monotonic() - started > STARTUP_TIMEOUT_S:
            break
        if hang_t is not None and now - hang_t > cap_s:
            break
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL also ends a stopped process
        proc.wait()
    logs = [(out / f"rank{r}.log").read_text() for r in range(len(procs))]
    hangs = sorted(m.groups() for log in logs for m in map(_HANG_LINE.match, log.splitlines()) if m)
    rank1 = out / "reports" / f"rank{CULPRIT_RANK.get(out.name.rsplit('-', 1)[0], 1)}.txt"
    return {
        "hang_t": hang_t,
        "exits": {r: t - hang_t for r, t in exits.items()} if hang_t else {},
        "codes": [p.returncode for p in procs],
        "report_s": float(hangs[0][0]) - hang_t if hangs and hang_t else None,
        "verdict": hangs[0][2] if hangs else "",
        "rank1_stack": rank1.read_text() if rank1.exists() else "",
        "summary": _read(out / "reports" / "summary.txt"),
        "post_mortem": _post_mortem(out / "reports"),
        "errors": [line for log in logs for line in log.splitlines() if "rror" in line],
    }


#: The "desync" rows from the real trainers (see ``--frameworks``): (label, launcher, job,
#: scenario), one per tracker case and framework. The launcher is ``composer`` (``composer -n
#: 2``), ``torchrun`` (2 processes) or ``python`` (Lightning starts rank 1 itself). A fifth
#: item, a pattern: the case ends in an error raised (the job re-raises it, ``E2E_RERAISE``),
#: reported at the first output line that matches it, not in a watchdog ``summary.txt``.
_METRIC = "Ranks would reduce different metrics"  # rankguard's MetricMismatchError, logged
FRAMEWORK_DESYNC: tuple[tuple[str, ...], ...] = (
    ("Composer: rank-0 collective", "composer", "composer_job.py", "rank0_collective"),
    ("Composer: metric on rank 0", "composer", "composer_job.py", "metric_on_rank0"),
    ("Composer: all_gather skipped", "composer", "composer_job.py", "epoch_end_all_gather"),
    ("Composer: stop on one rank", "composer", "composer_job.py", "stop_one_rank"),
    ("Composer: save on rank 0", "composer", "composer_job.py", "save_on_rank0"),
    ("Lightning: rank-0 collective", "python", "lightning_job.py", "rank0_collective"),
    ("Lightning: sync_dist key", "python", "lightning_job.py", "sync_dist_key"),
    ("Lightning: all_gather skipped", "python", "lightning_job.py", "epoch_end_all_gather"),
    ("Lightning: should_stop 1 rank", "python", "lightning_job.py", "should_stop_leaves_fit"),
    ("Lightning: save is_global_zero", "python", "lightning_job.py", "save_on_rank0"),
    ("HF: early stop on one rank", "torchrun", "hf_trainer_job.py", "early_stop_one_rank"),
    ("loop: rank-0 collective", "torchrun", "torch_loop_job.py", "rank0_collective"),
    ("OLMo-core: metric on rank 1", "torchrun", "olmo_core_job.py", "metric_on_one_rank", _METRIC),
    ("OLMo-core: same, no rankguard", "torchrun", "olmo_core_job.py", "metric_on_one_rank_bare",
     _METRIC),
)  # fmt: skip
#: Each rank's exit code in a launcher's output: Composer's, then torchrun's.
_RANK_CODES = (
    re.compile(r"Global rank (\d+) \(PID \d+\) exited with code (-?\d+)"),
    re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)"),
)
_SOURCE_PATH = re.compile(r"\[[^]]*\]\s*")  # "[enforce fail at .../pair.cc:446] "
_METRIC_NAMED = re.compile(r"rank (\d+) recorded ('[^']+' \(\w+\) at step \d+)")
_NEXT_RANK = re.compile(r"Next: (?:fix the code path at|fix the stop decision of|read) rank ?(\d+)")


def _launch(launcher: str, script: str, out: str, scenario: str) -> list[str]:
    bin_dir = Path(sys.executable).parent
    head = {
        "composer": [str(bin_dir / "composer"), "-n", "2"],
        "torchrun": [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2"],
        "python": [sys.executable],
    }[launcher]
    return [*head, script, out, scenario]


def _codes(output: str, returncode: int) -> str:
    """The ranks' exit codes where the launcher prints them, else the launcher's own."""
    for pattern in _RANK_CODES:
        codes = dict(pattern.findall(output))
        if codes:
            return ",".join(codes[r] for r in sorted(codes))
    return str(returncode)


def _summary(out: Path, scenario: str) -> Path | None:
    for folder in (f"reports_{scenario}", "rankguard_reports"):
        if (out / folder / "summary.txt").exists():
            return out / folder / "summary.txt"
    return None


def framework_desync(
    label: str, launcher: str, job: str, scenario: str, error: str | None = None, *, cap_s: float
) -> str:
    """Runs one test job with the watchdog's defaults; one table row from its report (or from
    its first output line matching ``error``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = _launch(launcher, str(ROOT / "tests" / "e2e" / job), tmp, scenario)
        env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(name, None)
        if error:
            env["E2E_RERAISE"] = "1"  # the error ends the job, as in a user's script
        proc = subprocess.Popen(
            cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, text=True,
        )  # fmt: skip
        lines: list[tuple[float, str]] = []  # each output line and when it came

        def read() -> None:
            for text in proc.stdout or ():
                lines.append((time.time(), text))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ended = time.time()
        reader.join()
        output = "".join(text for _, text in lines)
        codes = _codes(output, proc.returncode)
        split_file, summary = out / "split.json", _summary(out, scenario)
        if not split_file.exists():
            return f"{label:<30} | did not reach the split (exit {codes})"
        split = json.loads(split_file.read_text())["t"]
        said = next(((t, text) for t, text in lines if error and error in text), None)
        if said is not None:
            named = _METRIC_NAMED.search(output)
            rank, what = named.groups() if named else ("?", "-")
            return (
                f"{label:<30} | {said[0] - split:>6.1f} s | {ended - split:>6.1f} s ({codes}) | "
                f"rank {rank} | {what}"
            )
        if summary is None:
            errors = [
                line.strip()
                for line in output.splitlines()
                if "what():" in line or line.startswith("RuntimeError")
            ]
            # gloo's own words, without the source path: "op.preamble.length <= ... 12 vs 4".
            error = f"; {_SOURCE_PATH.sub('', errors[0])[:70]}" if errors else ""
            return (
                f"{label:<30} | {'none':>6}   | {ended - split:>6.1f} s ({codes}) | - | "
                f"no report{error}"
            )
        text = summary.read_text()
        named = _NEXT_RANK.search(text)
        rank = named.group(1) if named else "?"
        line = re.search(rf"^rank {rank}: your code at (.*?)(; blocked in|$)", text, re.M)
        return (
            f"{label:<30} | {summary.stat().st_mtime - split:>6.1f} s | {ended - split:>6.1f} s "
            f"({codes}) | rank {rank} | {line.group(1) if line else '-'}"
        )


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _post_mortem(reports: Path) -> str:
    """``rankguard report`` on the folder (the ranks' record files); its first difference."""
    if not reports.is_dir():
        return ""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from rankguard.cli import main; sys.exit(main())",
            "report",
            str(reports),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
    )
    keep = ("First difference", "Collectives each rank", "The ranks' records agree")
    lines = proc.stdout.splitlines()
    return "\n".join(line for line in lines if line.startswith(keep) or "fatal signal" in line)


_NAMED = re.compile(r"Next: fix the code path (?:that issued rank |at rank |of rank )(\d+)")
_LINE = re.compile(r" at ([\w.]+\.py:\d+ \([^)]*\): .*?)(?:, thread|$)", re.M)


def _named(result: dict) -> str:
    """The rank "Next" names and the issuing line the report names, from summary.txt."""
    summary = result.get("summary") or ""
    rank = next(iter(_NAMED.findall(summary)), "-")
    line = _LINE.search(summary.split("\n", 1)[0])
    if line:
        return f"rank {rank}, {line.group(1)}"
    # A collective issued outside the record (no line in the first): the rank's own frame.
    frame = re.search(rf"^rank {rank}: your code at (.*?)(; blocked in|$)", summary, re.M)
    return f"rank {rank}, {frame.group(1) if frame else '-'}"


def _ends(result: dict) -> str:
    ends = f"{max(result['exits'].values()):.1f} s" if result["exits"] else "never"
    return ends + f" ({','.join(str(c) for c in result['codes'])})"


def _report(result: dict) -> str:
    return f"{result['report_s']:.1f} s" if result["report_s"] is not None else "none"


def _without(result: dict, cap_s: float) -> str:
    if result["exits"] or result["errors"]:
        first = min(result["exits"].values()) if result["exits"] else None
        return f"exit after {first:.1f} s" if first is not None else "error logged"
    if result["hang_t"] is None:
        return "did not reach the hang"
    return f"no report within {cap_s:g} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="seconds to wait without rankguard")
    parser.add_argument(
        "--defaults-cap",
        type=float,
        default=700.0,
        help="seconds to wait with the defaults (their ceiling on gloo is 600 s)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help="which of: " + ", ".join(MODES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="which scenarios")
    parser.add_argument(
        "--frameworks", action="store_true", help="add the desync rows of the real trainers"
    )
    parser.add_argument(
        "--frameworks-only", action="store_true", help="only the desync rows of the trainers"
    )
    parser.add_argument(
        "--rows", default="", help="only the trainers' rows whose label contains one of these (a,b)"
    )
    args = parser.parse_args()
    if args.frameworks or args.frameworks_only:
        print("desync, real trainers, every watchdog setting at its default; from the split:")
        print(f"{'case':<30} | report   | job ends (codes) | Next   | user line named")
        wanted = [word.lower() for word in args.rows.split(",") if word]
        for case in FRAMEWORK_DESYNC:
            if not wanted or any(word in case[0].lower() for word in wanted):
                print(framework_desync(*case, cap_s=args.cap + 60), flush=True)
        if args.frameworks_only:
            return
    modes = args.modes.split(",")
    scenarios = {name: SCENARIOS[name] for name in args.scenarios.split(",")}
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        caps = {"defaults": args.defaults_cap, "none": args.cap, "short": args.cap}
        watchers = []
        for mode in (m for m in ("none", "defaults") if m in modes):  # side by side
            for scenario in scenarios:
                out = Path(tmp) / f"{scenario}-{mode}"
                out.mkdir()
                procs = start(scenario, out, mode)

                def run(key=(scenario, mode), procs=procs, out=out) -> None:
                    results[key] = watch(procs, out, cap_s=caps[key[1]])

                watchers.append(threading.Thread(target=run))
                watchers[-1].start()
                time.sleep(STAGGER_S if mode == "defaults" else 0.0)
        if "short" in modes:
            for scenario in scenarios:  # one at a time: the timing is what is measured
                out = Path(tmp) / f"{scenario}-short"
                out.mkdir()
                results[scenario, "short"] = watch(start(scenario, out, "short"), out, args.cap)
        for thread in watchers:
            thread.join()
    print(
        f"2 ranks, gloo on CPU, steps of {1000 * STEP_S:.0f} ms, an eval every {EPOCH_STEPS} "
        "steps; times from the start of the hang. defaults: RankGuard() with only report_dir. "
        f"short: HangWatchdog deadlines train {WATCHDOG['timeout_s']:g} s, eval "
        f"{WATCHDOG['eval_timeout_s']:g} s, after eval {WATCHDOG['post_eval_timeout_s']:g} s, "
        f"exchange every {WATCHDOG['exchange_period_s']:g} s."
    )
    header = (
        f"{'scenario':<20} | {'defaults: report':>16} | {'job ends (codes)':<18} | "
        f"{'stack':<5} | {'short: deadline':>15} | {'report':>6} | {'job ends (codes)':<17} | "
        f"{'without rankguard':<23}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    for scenario, label in scenarios.items():
        d, s, n = (results.get((scenario, m)) for m in MODES)
        culprit = CULPRITS[scenario]
        stack = "-" if d is None else ("n/a" if culprit is None else "no")
        if d is not None and culprit and f"in {culprit}\n" in d["rank1_stack"]:
            stack = "yes"
        print(
            f"{label:<20} | {_report(d) if d else '-':>16} | {_ends(d) if d else '-':<18} | "
            f"{stack:<5} | {DEADLINE_S[scenario]:>13g} s | {_report(s) if s else '-':>6} | "
            f"{_ends(s) if s else '-':<17} | {_without(n, args.cap) if n else '-':<23}"
        )
        if d is not None:
            verdicts.append(f"{label} (defaults): {d['verdict']}")
    desyncs = [
        n for n in scenarios if n in ("async_one_rank", "metric_reductions", "fsdp_uneven_forward")
    ]
    if desyncs:
        print("\nDesyncs proven (short, else defaults, the first with a report): Next names, line:")
    for scenario in desyncs:
        runs = [results.get((scenario, m)) for m in ("short", "defaults")]
        result = next((r for r in runs if r and r["summary"]), runs[0] or runs[1])
        if result:
            print(f"- {SCENARIOS[scenario]}: {_named(result)}")
    for scenario in (n for n in scenarios if n in POST_MORTEM):
        result = results.get((scenario, "short")) or results.get((scenario, "defaults"))
        if result:
            print(f"- {SCENARIOS[scenario]}: rankguard report says:\n{result['post_mortem']}")
    print("\nFirst report with the defaults, per scenario:")
    for line in verdicts:
        print(f"- {line}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
    else:
        main()
